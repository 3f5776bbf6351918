"""What the gateway's readiness means, and the routes it answers itself.

Readiness is the gateway's own ability to answer (listening, config loaded, not
draining). When the whole fleet is down, every gateway pod must stay in the Service and
answer a clean, OpenAI-shaped 503 with Retry-After, not vanish so that clients get
connection errors. `/health`, `/version` and `/ping` answer as vllm-router and vLLM do,
for tools such as guidellm that check them before they start.
"""

from __future__ import annotations

import signal
from pathlib import Path

import httpx
import pytest

from tests.support.fleet import MODEL, running, start_gateway, start_sim, wait_until
from tests.support.procs import free_port

pytestmark = pytest.mark.integration

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}


def test_a_fleet_that_goes_down_leaves_the_gateway_ready_and_answering_503(
    artifacts: Path,
) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim])
    with running(gw, sim):
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 200
        assert ready.json() == {
            "status": "ready",
            "fleet": {"usable_replica": True, "replicas": 1},
        }
        sim.signal(signal.SIGKILL)
        sim.wait(10)
        wait_until(
            lambda: httpx.get(gw.url + "/readyz").json()["fleet"]["usable_replica"] is False,
            30,
            what="the gateway to see its only replica gone",
        )
        ready = httpx.get(gw.url + "/readyz")
        assert ready.status_code == 200, ready.text  # the pod stays in the Service
        assert httpx.get(gw.url + "/readyz?fleet=1").status_code == 503
        refused = httpx.post(gw.url + "/v1/completions", json=COMPLETION, timeout=30)
        assert refused.status_code == 503, refused.text
        assert float(refused.headers["retry-after"]) > 0
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}


def test_a_gateway_whose_replicas_never_came_up_is_ready(artifacts: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway(artifacts, [dead], wait_ready=False)
    with running(gw):
        r = httpx.get(gw.url + "/readyz")
        assert r.status_code == 200
        assert r.json()["fleet"] == {"usable_replica": False, "replicas": 1}


def test_health_version_and_ping_are_answered_by_the_gateway(artifacts: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    gw = start_gateway(artifacts, [dead], wait_ready=False)
    with running(gw):
        health = httpx.get(gw.url + "/health")
        assert health.status_code == 200 and health.json() == {"status": "healthy"}
        version = httpx.get(gw.url + "/version")
        assert version.status_code == 200 and version.json() == {"version": "0.1.0"}
        for method in ("GET", "POST"):
            ping = httpx.request(method, gw.url + "/ping")
            assert ping.status_code == 200 and ping.content == b""
        wrong = httpx.delete(gw.url + "/ping")
        assert wrong.status_code == 405
        assert set(wrong.json()["error"]) == {"message", "type", "param", "code"}
