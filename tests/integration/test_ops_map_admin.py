"""`seawall map --admin` against the real gateway admin API, and against a fixed document.

The last test drives a real gateway. The others use a small aiohttp app serving a fixed
`/admin/state` document, because some states it shows (a degraded Redis backend, a
saturated replica) take a whole outage to produce for real; it checks the bearer token
the way the admin API does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.procs import free_port, seawall_argv
from tests.unit.test_ops_map import STATE

pytestmark = pytest.mark.integration

TOKEN = "test-admin-token"


@pytest.fixture
async def admin_url() -> AsyncIterator[str]:
    async def state(request: web.Request) -> web.Response:
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return web.json_response({"error": "unauthorized"}, status=401)
        return web.json_response(STATE)

    app = web.Application()
    app.router.add_get("/admin/state", state)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _seawall(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    import os

    proc = await asyncio.create_subprocess_exec(
        *seawall_argv(*args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_map_shows_the_live_state_of_each_control(admin_url: str) -> None:
    rc, out, err = await _seawall("map", "--admin", admin_url, "--admin-token", TOKEN)
    assert rc == 0, err
    assert "live          1 of 2 replicas saturated (r1)" in out
    assert "1 of 2 nodes cordoned (n2)" in out
    assert "limits backend redis, DEGRADED" in out


async def test_map_takes_the_token_from_the_environment_and_prints_json(admin_url: str) -> None:
    rc, out, err = await _seawall(
        "map", "--admin", admin_url, "--json", env={"SEAWALL_ADMIN_TOKEN": TOKEN}
    )
    assert rc == 0, err
    doc = {d["domain"]: d for d in json.loads(out)}
    assert doc["fleet"]["live"].startswith("1 of 2 replicas routable")


async def test_map_explains_a_refused_token(admin_url: str) -> None:
    rc, _, err = await _seawall(
        "map", "--admin", admin_url, "--admin-token", "wrong", env={"SEAWALL_ADMIN_TOKEN": ""}
    )
    assert rc == 2
    assert "401" in err and "--admin-token" in err


def test_map_reads_a_real_gateway(artifacts: Path) -> None:
    import subprocess

    import httpx

    from seawall.auth import hash_key
    from tests.support.fleet import running, start_gateway, start_sim, wait_until

    sims = [start_sim(artifacts, name=f"s{i}") for i in range(2)]
    admin_port = free_port()
    gw = start_gateway(
        artifacts,
        sims,
        {
            "admin": {"enabled": True, "port": admin_port, "token_hash": hash_key(TOKEN)},
            "fleet": {"liveness_interval_s": 0.25},
        },
    )
    admin = f"http://127.0.0.1:{admin_port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with running(gw, *sims):
        httpx.post(admin + "/admin/nodes/node-1/cordon", headers=auth).raise_for_status()
        wait_until(
            lambda: (
                sum(
                    r["routable"]
                    for r in httpx.get(admin + "/admin/state", headers=auth).json()["replicas"]
                )
                == 1
            ),
            5,
            what="cordon",
        )
        out = subprocess.run(
            seawall_argv("map", "--admin", admin, "--admin-token", TOKEN, "--json"),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        doc = {d["domain"]: d for d in json.loads(out.stdout)}
        assert doc["fleet"]["live"].startswith("1 of 2 replicas routable")
        assert "node-1" in json.dumps(doc)
