"""The admin API on its own port and credential, against a real gateway and real replicas."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest

from seawall.auth import hash_key
from tests.support.fleet import running, set_fault, start_gateway, start_sim, wait_until
from tests.support.procs import Proc, free_port, seawall_argv

pytestmark = pytest.mark.integration

ADMIN_TOKEN = "sk-sw-admin-token-for-tests-000000000000000000000"


def admin_gateway(
    artifacts: Path,
    sims: list[Proc],
    extra: dict[str, Any] | None = None,
) -> tuple[Proc, str]:
    port = free_port()
    cfg = {
        "admin": {"enabled": True, "port": port, "token_hash": hash_key(ADMIN_TOKEN)},
        "fleet": {
            "liveness_interval_s": 0.25,
            "scrape_interval_s": 0.25,
            "deep_probe_interval_s": 0.5,
            "deep_probe_idle_interval_s": 0.5,
            "deep_probe_timeout_s": 0.5,
        },
        **(extra or {}),
    }
    gw = start_gateway(artifacts, sims, cfg)
    return gw, f"http://127.0.0.1:{port}"


def state(admin: str) -> dict[str, Any]:
    r = httpx.get(admin + "/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def replica(admin: str, rid: str) -> dict[str, Any]:
    return next(r for r in state(admin)["replicas"] if r["id"] == rid)


def test_admin_api_needs_its_own_token(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw, admin = admin_gateway(artifacts, [sim])
    with running(gw, sim):
        assert httpx.get(admin + "/admin/state").status_code == 401
        bad = httpx.get(admin + "/admin/state", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "admin_unauthorized"
        assert httpx.get(gw.url + "/admin/state").status_code == 404  # not on the API port
        s = state(admin)
        assert [r["id"] for r in s["replicas"]] == ["r0"]
        assert {"retry_budget", "timeouts", "limits", "nodes"} <= set(s)


def test_engine_dead_leaves_routing_and_traffic_keeps_flowing(artifacts: Path) -> None:
    a, b = start_sim(artifacts, name="a"), start_sim(artifacts, name="b")
    gw, admin = admin_gateway(artifacts, [a, b])
    with running(gw, a, b):
        wait_until(
            lambda: all(r["routable"] for r in state(admin)["replicas"]),
            10,
            what="both replicas routable",
        )
        set_fault(a, {"kind": "engine_dead", "grace_s": 30})
        waited = wait_until(
            lambda: not replica(admin, "r0")["routable"], 5, what="r0 out of routing"
        )
        assert waited < 1.5  # within about one liveness interval (0.25 s) plus a scrape
        for _ in range(10):
            r = httpx.post(
                gw.url + "/v1/completions",
                timeout=10,
                json={"model": "sim-model", "prompt": "x", "max_tokens": 2},
            )
            assert r.status_code == 200


def test_operator_drain_cordon_and_status_command(artifacts: Path) -> None:
    a, b = start_sim(artifacts, name="a"), start_sim(artifacts, name="b")
    gw, admin = admin_gateway(artifacts, [a, b])
    auth = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with running(gw, a, b):
        wait_until(
            lambda: all(r["routable"] for r in state(admin)["replicas"]),
            10,
            what="both replicas routable",
        )
        assert httpx.post(admin + "/admin/replicas/r0/drain", headers=auth).status_code == 200
        wait_until(lambda: not replica(admin, "r0")["routable"], 5, what="r0 drained")
        for _ in range(6):
            httpx.post(
                gw.url + "/v1/completions",
                timeout=10,
                json={"model": "sim-model", "prompt": "x", "max_tokens": 2},
            )
        served = {r["id"]: r for r in state(admin)["replicas"]}
        assert served["r0"]["inflight"] == 0
        httpx.post(admin + "/admin/replicas/r0/undrain", headers=auth).raise_for_status()
        wait_until(lambda: replica(admin, "r0")["routable"], 5, what="r0 back")
        httpx.post(admin + "/admin/nodes/node-1/cordon", headers=auth).raise_for_status()
        wait_until(
            lambda: replica(admin, "r1")["cordoned"] and not replica(admin, "r1")["routable"],
            5,
            what="node-1 cordoned",
        )
        out = subprocess.run(
            seawall_argv("status", "--admin", admin, "--admin-token", ADMIN_TOKEN),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr
        assert "r0" in out.stdout and "r1" in out.stdout and "cordoned" in out.stdout
        assert ADMIN_TOKEN not in gw.log()
