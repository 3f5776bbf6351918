"""Fleet health through the whole product: `seawall up` (local supervisor as the actuator,
the gateway in-process) with real `seawall sim` replicas and a real client.

A hang keeps /health at 200 while inference is dead: the gateway must end the streams it
had on that replica by the inter-token timeout, stop routing to it within a few deep-probe
intervals, and have the supervisor restart it. A slow replica must lose traffic to the
healthy ones before anything fails.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.fleet import MODEL, metric_sum, running, scrape, wait_until
from tests.support.up import Up, start_up

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.parametrize("running_gauge", ["keep", "zero"])
def test_hung_replica_streams_time_out_and_it_is_restarted(
    running_gauge: str, artifacts: Path
) -> None:
    up = start_up(
        artifacts,
        replicas=2,
        gateway={"timeouts": {"itl_s": 1.5}},
        fleet={"watchdog_window_s": 3.0, "deep_probe_timeout_s": 0.5},
    )
    with running(up.proc):
        result: dict[str, bytes] = {}

        def stream() -> None:
            result["body"] = httpx.post(
                up.api + "/v1/completions",
                timeout=60,
                json={
                    "model": MODEL,
                    "prompt": "x",
                    "max_tokens": 2000,
                    "ignore_eos": True,
                    "stream": True,
                },
            ).content

        t = threading.Thread(target=stream)
        t.start()
        wait_until(
            lambda: any(r["inflight"] for r in up.state()["replicas"]),
            10,
            what="a stream in flight",
        )
        victim = next(r for r in up.state()["replicas"] if r["inflight"])
        set_fault_url(victim["url"], {"kind": "hang", "running": running_gauge})
        t.join(timeout=30)
        events = [e for e in result["body"].split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "itl_timeout"
        wait_until(
            lambda: not up.replica(victim["id"])["routable"], 15, what="hung replica out of routing"
        )
        # The local actuator restarts it; a fresh process serves again.
        wait_until(
            lambda: (
                up.replica(victim["id"])["restarts"] >= 1 and up.replica(victim["id"])["routable"]
            ),
            30,
            what="restart",
        )
        r = httpx.post(
            victim["url"] + "/v1/completions",
            timeout=10,
            json={"model": MODEL, "prompt": "x", "max_tokens": 3},
        )
        assert r.status_code == 200


def set_fault_url(url: str, fault: dict[str, object]) -> None:
    httpx.post(url + "/sim/fault", json=fault, timeout=5).raise_for_status()


def test_slow_replica_loses_traffic_before_it_fails(up: Up) -> None:
    replicas = up.state()["replicas"]
    slow = replicas[0]
    set_fault_url(slow["url"], {"kind": "slow", "factor": 8})
    body = {"model": MODEL, "prompt": "x", "max_tokens": 8}
    # Warm-up traffic lets the gateway see the slow replica's latency.
    for _ in range(30):
        assert httpx.post(up.api + "/v1/completions", json=body, timeout=30).status_code == 200

    # The gateway's own attempts there: the engine's count also has the monitor's deep
    # probes (one a second), which on a loaded machine made up half of what it served.
    def attempts() -> float:
        return metric_sum(scrape(up.api), "seawall_upstream_attempts_total", replica=slow["id"])

    before = attempts()
    n = 60
    for _ in range(n):
        assert httpx.post(up.api + "/v1/completions", json=body, timeout=30).status_code == 200
    served = attempts() - before
    # A fair share would be n/3 = 20.
    assert served < n / 3 / 2, served
    assert up.replica(slow["id"])["score"] < 1.0


def test_hung_replica_is_not_readmitted_on_health_alone_when_nothing_restarts_it(
    artifacts: Path,
) -> None:
    """Actuator `none`: the monitor's "restart" does nothing, and a hung engine still
    answers /health. It must stay out of routing until a real token comes back."""
    from seawall.auth import hash_key
    from tests.support.fleet import start_gateway, start_sim
    from tests.support.procs import free_port

    token = "sk-sw-admin-none-actuator-0000000000000000000000"
    auth = {"Authorization": f"Bearer {token}"}
    sims = [start_sim(artifacts, name=f"s{i}") for i in range(2)]
    admin_port = free_port()
    gw = start_gateway(
        artifacts,
        sims,
        {
            "admin": {"enabled": True, "port": admin_port, "token_hash": hash_key(token)},
            "timeouts": {"itl_s": 1.0},
            "fleet": {
                "liveness_interval_s": 0.25,
                "scrape_interval_s": 0.25,
                "deep_probe_interval_s": 0.5,
                "deep_probe_idle_interval_s": 0.5,
                "deep_probe_timeout_s": 0.5,
                "watchdog_window_s": 2.0,
            },
        },
    )
    admin = f"http://127.0.0.1:{admin_port}"

    def routable(rid: str) -> bool:
        state = httpx.get(admin + "/admin/state", headers=auth).json()
        return bool(next(r for r in state["replicas"] if r["id"] == rid)["routable"])

    with running(gw, *sims):
        wait_until(lambda: routable("r0") and routable("r1"), 10, what="both routable")
        set_fault_url(sims[0].url, {"kind": "hang"})
        wait_until(lambda: not routable("r0"), 15, what="hung r0 out of routing")
        # Long enough for several liveness probes to pass and a restart to "happen".
        deadline_checks = [routable("r0") for _ in range(40) if not time.sleep(0.1)]
        assert not any(deadline_checks)
        set_fault_url(sims[0].url, {"kind": "clear"})
        wait_until(lambda: routable("r0"), 20, what="r0 readmitted once it produces tokens")
