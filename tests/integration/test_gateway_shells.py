"""Bugs that lived in the gateway's shells (issue 12), each shown against real processes:
the drain deadline, an engine abort split across two socket reads, and refused
connections spending the retry budget."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.chop import ChoppingRelay
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

COMPLETION_BODY = {"model": MODEL, "prompt": "A seawall is"}


def sse_events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


def test_the_drain_deadline_ends_every_request_cleanly_and_the_gateway_exits(
    artifacts: Path,
) -> None:
    """Issue 12 bug 2: with `drain.timeout_s: 2` a 30-second stream used to run to its end
    (aiohttp's own 60 s shutdown wait applied on top). At the deadline the stream must get
    an error event and [DONE], a request not yet answered a 503, and the process exits."""
    sim = start_sim(artifacts, "--step-base-ms", "200")  # 5 tokens/s: 150 tokens take 30 s
    gw = start_gateway(artifacts, [sim], {"drain": {"timeout_s": 2}})
    body = {**COMPLETION_BODY, "max_tokens": 150, "ignore_eos": True}
    with running(gw, sim), httpx.Client(timeout=60) as http:
        unary: dict[str, httpx.Response] = {}

        async def later_unary() -> None:
            async with httpx.AsyncClient(timeout=60) as a:
                unary["r"] = await a.post(gw.url + "/v1/completions", json=body)

        with http.stream("POST", gw.url + "/v1/completions", json={**body, "stream": True}) as r:
            it = r.iter_raw()
            got = next(it)
            t = threading.Thread(target=lambda: asyncio.run(later_unary()))
            t.start()
            wait_until(lambda: gw_inflight(gw) >= 2, 10, what="both requests in flight")
            signalled = time.monotonic()
            gw.signal(signal.SIGTERM)
            got += b"".join(it)
        t.join(timeout=30)
        exit_code = gw.wait(timeout=20)
        took = time.monotonic() - signalled
    events = sse_events(got)
    assert events[-1] == b"data: [DONE]"
    error = json.loads(events[-2].removeprefix(b"data: "))["error"]
    assert error["code"] == "gateway_draining"
    assert unary["r"].status_code == 503 and unary["r"].json()["error"]["code"] == "draining"
    assert exit_code == 0
    assert took < 10, f"the gateway took {took:.1f}s to exit with a 2 s drain deadline"


def gw_inflight(gw: Proc) -> float:
    return metric_sum(scrape(gw.url), "seawall_inflight_requests")


def test_an_engine_abort_split_across_two_reads_is_a_dropped_stream(artifacts: Path) -> None:
    """Issue 12 bug 3: the raw relay kept a 14-byte tail and looked for the 23-byte abort
    mark in each read alone, so vLLM's shutdown abort, split by the network, counted as a
    success. Here every byte from the engine arrives in 8-byte pieces."""
    sim = start_sim(artifacts, "--step-base-ms", "20")
    with running(sim), ChoppingRelay(sim.port or 0, piece=8) as relay:
        gw = start_gateway(artifacts, [relay.url])
        with running(gw):
            body = {**COMPLETION_BODY, "max_tokens": 200, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
                chunks = r.iter_raw()
                got = next(chunks)
                while got.count(b"data: ") < 10:
                    got += next(chunks)
                sim.signal(signal.SIGTERM)  # vLLM's default: abort what is in flight
                got += b"".join(chunks)
            assert b'"finish_reason":"abort"' in got
            wait_until(
                lambda: (
                    metric_sum(
                        scrape(gw.url), "seawall_stream_errors_total", reason="upstream_aborted"
                    )
                    == 1
                ),
                5,
                what="the aborted stream counted as dropped",
            )


async def test_refused_connections_do_not_spend_the_retry_budget(artifacts: Path) -> None:
    """Issue 12 bug 6: right after a replica crash, 50 simultaneous requests. Those sent to
    the dead replica were refused at connect, which costs the engine nothing; they used to
    spend the retry budget, and once it was empty the rest failed with a 503 that blamed
    the connection. Every one of them must be served by the replica that is fine."""
    dead, alive = start_sim(artifacts, name="dead"), start_sim(artifacts, name="alive")
    # The monitor is slow on purpose: only the request path's own view of the crash acts.
    slow_monitor = {
        "liveness_interval_s": 60,
        "scrape_interval_s": 60,
        "deep_probe_interval_s": 60,
        "deep_probe_idle_interval_s": 60,
    }
    gw = start_gateway(artifacts, [dead, alive], {"fleet": slow_monitor})
    with running(gw, dead, alive):
        # Both in routing first (readiness needs only one): the requests must find `dead`.
        wait_until(
            lambda: metric_sum(scrape(gw.url), "seawall_replica_state", state="ready") == 2,
            20,
            what="both replicas ready",
        )
        dead.popen.kill()
        dead.wait(timeout=5)
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=100)
        async with httpx.AsyncClient(timeout=30, limits=limits) as a:
            body = {**COMPLETION_BODY, "max_tokens": 2}
            responses = await asyncio.gather(
                *(a.post(gw.url + "/v1/completions", json=body) for _ in range(50))
            )
        statuses = [r.status_code for r in responses]
        assert statuses == [200] * 50, [r.text for r in responses if r.status_code != 200][:3]
        m = scrape(gw.url)
        assert metric_sum(m, "seawall_upstream_attempts_total", outcome="connect_error") >= 1
        assert metric_sum(m, "seawall_retry_budget_exhausted_total") == 0
        # The reserve (10 tokens) is untouched: a refused connection is not a retry.
        assert metric_sum(m, "seawall_retry_budget_tokens") >= 10.0
