"""`api_key: "${VLLM_API_KEY}"` in a replica's config reaches the engine resolved, as the
bearer token, and the gateway never prints it.

The engine: `seawall sim --api-key` when the sim has that flag (vLLM's: 401 without the
key). Otherwise a real `seawall sim` behind a recording hop on loopback: the hop notes
the Authorization header of each request and forwards it unchanged, because the point
is what the engine receives and the sim does not report request headers.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.support.procs import free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration

SECRET = "sk-engine-7c1d3f0e9b2a-never-logged"
MODEL = "sim-model"


def _sim_has_api_key_flag() -> bool:
    out = subprocess.run(
        seawall_argv("sim", "--help"), capture_output=True, text=True, timeout=60
    ).stdout
    return "--api-key" in out


@pytest.fixture
async def recording_engine(artifacts: Path) -> AsyncIterator[tuple[str, list[str]]]:
    """A real sim behind a hop that records each request's Authorization header."""
    seen: list[str] = []
    port = free_port()
    sim = spawn(
        seawall_argv("sim", "--port", str(port), "--model", MODEL),
        artifacts / "sim-behind-hop.log",
        port=port,
    )
    wait_http(sim.url + "/health", proc=sim)
    session = aiohttp.ClientSession(auto_decompress=False)

    async def forward(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            seen.append(request.headers.get("Authorization", ""))
        headers = {k: v for k, v in request.headers.items() if k.lower() != "host"}
        async with session.request(
            request.method, sim.url + request.path_qs, headers=headers, data=await request.read()
        ) as upstream:
            out = web.StreamResponse(status=upstream.status)
            for k, v in upstream.headers.items():
                if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                    out.headers[k] = v
            await out.prepare(request)
            async for chunk in upstream.content.iter_any():
                await out.write(chunk)
            await out.write_eof()
            return out

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    hop = free_port()
    await web.TCPSite(runner, "127.0.0.1", hop).start()
    try:
        yield f"http://127.0.0.1:{hop}", seen
    finally:
        await runner.cleanup()
        await session.close()
        sim.stop()


async def test_the_engine_receives_the_resolved_key_and_logs_never_show_it(
    tmp_path: Path, artifacts: Path, recording_engine: tuple[str, list[str]]
) -> None:
    procs = []
    try:
        if _sim_has_api_key_flag():
            port = free_port()
            sim = spawn(
                seawall_argv("sim", "--port", str(port), "--model", MODEL, "--api-key", SECRET),
                artifacts / "sim.log",
                port=port,
            )
            procs.append(sim)
            wait_http(sim.url + "/health", proc=sim)
            engine_url, seen = sim.url, None
        else:
            engine_url, seen = recording_engine
        config = tmp_path / "gateway.yaml"
        config.write_text(
            "replicas:\n"
            f"  - url: {engine_url}\n"
            f"    model: {MODEL}\n"
            '    api_key: "${VLLM_API_KEY}"\n'
        )
        port = free_port()
        gateway = spawn(
            seawall_argv("serve", "--config", str(config), "--port", str(port)),
            artifacts / "gateway.log",
            port=port,
            env={"VLLM_API_KEY": SECRET},
        )
        procs.append(gateway)
        # In a thread: the recording hop serves on this test's event loop.
        await asyncio.to_thread(
            wait_http, gateway.url + "/readyz?fleet=1", timeout=30, proc=gateway
        )
        async with (
            aiohttp.ClientSession() as session,
            session.post(
                gateway.url + "/v1/completions",
                json={"model": MODEL, "prompt": "hi", "max_tokens": 2},
            ) as resp,
        ):
            body = await resp.text()
            assert resp.status == 200, body
        if seen is not None:
            assert f"Bearer {SECRET}" in seen, seen
            assert "Bearer ${VLLM_API_KEY}" not in seen
    finally:
        for p in procs:
            p.stop()
    assert SECRET not in gateway.log(), "the gateway printed the key"


async def test_an_unset_variable_stops_serve_with_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "gateway.yaml"
    config.write_text(
        'replicas:\n  - url: http://127.0.0.1:9\n    api_key: "${NOT_SET_ANYWHERE}"\n'
    )
    env = {k: v for k, v in os.environ.items() if k != "NOT_SET_ANYWHERE"}
    result = subprocess.run(
        seawall_argv("serve", "--config", str(config)),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode != 0
    assert "replicas.0.api_key: environment variable NOT_SET_ANYWHERE is not set" in (
        result.stderr + result.stdout
    )
