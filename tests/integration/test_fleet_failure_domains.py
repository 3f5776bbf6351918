"""Failure domains through the real gateway: `seawall serve` with the admin API in front of
two `seawall sim` replicas, configured the way most users write it (no `node:` set).

One replica crashes again and again (the test plays the outside process manager that
brings it back on the same port, since actuator `none` restarts nothing). The other
replica never fails, so it must keep serving: nothing one replica does may take another
out of routing, not at the third crash, not after a gateway restart, not ever.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from seawall.auth import hash_key
from tests.support.fleet import MODEL, running, set_fault, start_sim, wait_until
from tests.support.procs import Proc, bound_port, seawall_argv, spawn, wait_http

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "sk-sw-admin-failure-domains-00000000000000000000"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Gateway:
    """`seawall serve` with replicas listed without a node, and its admin API."""

    def __init__(self, artifacts: Path, sims: list[Proc], ledger: Path, name: str) -> None:
        config: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "replicas": [{"url": s.url, "id": f"r{i}", "model": MODEL} for i, s in enumerate(sims)],
            "admin": {"enabled": True, "port": 0, "token_hash": hash_key(TOKEN)},
            "fleet": {
                "liveness_interval_s": 0.2,
                "scrape_interval_s": 0.2,
                "deep_probe_interval_s": 0.3,
                "deep_probe_idle_interval_s": 0.3,
                "deep_probe_timeout_s": 1.0,
                "ledger_path": str(ledger),
            },
        }
        path = artifacts / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.proc = spawn(seawall_argv("serve", "--config", str(path)), artifacts / f"{name}.log")
        try:
            # Both ports bound by the gateway itself and read back from its log.
            self.admin_port = bound_port(self.proc, b"seawall admin API listening")
            bound_port(self.proc, b"seawall gateway listening")
            wait_http(f"{self.proc.url}/readyz", timeout=30, proc=self.proc)
        except BaseException:
            self.proc.stop()
            raise

    def state(self) -> dict[str, Any]:
        r = httpx.get(f"http://127.0.0.1:{self.admin_port}/admin/state", headers=AUTH)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def replica(self, rid: str) -> dict[str, Any]:
        return next(r for r in self.state()["replicas"] if r["id"] == rid)

    def serves(self) -> bool:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        return (
            httpx.post(self.proc.url + "/v1/completions", json=body, timeout=10).status_code == 200
        )


def crash_and_bring_back(gw: Gateway, sims: list[Proc], artifacts: Path, n: int) -> None:
    """Crash r0; the test, as the outside process manager, starts it on the same port."""
    set_fault(sims[0], {"kind": "crash"})
    wait_until(lambda: not gw.replica("r0")["routable"], 15, what=f"r0 out after crash {n}")
    sims[0].stop()
    port = sims[0].port
    assert port is not None
    sims[0] = spawn(
        seawall_argv(
            "sim", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL, "--enable-faults"
        ),
        artifacts / f"r0-{n}.log",
        port,
    )
    wait_until(lambda: gw.replica("r0")["routable"], 30, what=f"r0 back after crash {n}")


def test_crashes_of_one_unnamed_replica_never_take_the_other_out(artifacts: Path) -> None:
    sims = [start_sim(artifacts, name=f"s{i}") for i in range(2)]
    ledger = artifacts / "ledger.sqlite"
    try:
        gw = Gateway(artifacts, sims, ledger, "gateway-1")
        with running(gw.proc):
            wait_until(lambda: gw.replica("r0")["routable"] and gw.replica("r1")["routable"], 15)
            for n in range(1, 4):
                crash_and_bring_back(gw, sims, artifacts, n)
                r1 = gw.replica("r1")
                assert r1["routable"] and r1["state"] == "ready", (n, r1)
            assert all(gw.serves() for _ in range(5))
            state = gw.state()
            r0, r1 = (next(r for r in state["replicas"] if r["id"] == i) for i in ("r0", "r1"))
            # Nothing was restarted (actuator `none`): three failures, no restart, no cordon.
            assert (r0["failures"], r0["restarts"]) == (3, 0), r0
            assert not any(node["cordoned"] for node in state["nodes"]), state["nodes"]
            assert r0["node"] != r1["node"]

        # A gateway restart on the same ledger file brings no cordon back, and one more
        # crash takes only r0 out.
        second = Gateway(artifacts, sims, ledger, "gateway-2")
        with running(second.proc):
            wait_until(
                lambda: second.replica("r0")["routable"] and second.replica("r1")["routable"],
                15,
                what="both routable after the gateway restart",
            )
            crash_and_bring_back(second, sims, artifacts, 4)
            assert second.replica("r1")["routable"]
            assert all(second.serves() for _ in range(5))
    finally:
        for sim in sims:
            sim.stop()
