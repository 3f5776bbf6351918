"""Pathological structured output through the gateway (issue 11, item 11, the gateway's part).

`seawall sim` costs a constrained sequence's grammar in every decode step it samples in,
as vLLM does (sampling waits for the batch's grammar bitmask), so a heavy schema slows
every stream batched with it (`test_sim_grammar.py`). The gateway's defences, each
tested against real sims through a real `seawall serve`:
- tier limits on a constraint's size and depth: a 400 before anything is sent;
- the bulkhead: a tier's constrained requests go to its grammar replicas only, and plain
  requests stay off those, so a plain stream keeps its unloaded inter-token latency
  while a heavy-schema flood runs (and, on the same sims without the bulkhead, does not).
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from seawall.protocol.structured import json_shape
from seawall.sim.scheduler import grammar_step_cost_s
from tests.support.fleet import MODEL, metric_sum, running, scrape, start_gateway, start_sim
from tests.support.fleet import wait_until as wait_for
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

STEP_MS = 10.0  # the forward pass of every step
PER_NODE_US = 2.0  # the sim's default grammar cost per schema node and depth level


def nested(depth: int, width: int = 2) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema for i in range(width)}}
    return schema


HEAVY = nested(9)
LIGHT = nested(2)
HEAVY_SHAPE = json_shape(HEAVY)
# each step a heavy request samples in takes this long (the forward pass is STEP_MS)
HEAVY_STEP_S = grammar_step_cost_s(HEAVY_SHAPE.nodes, HEAVY_SHAPE.depth, PER_NODE_US / 1e6)


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


def sims(artifacts: Path) -> list[Proc]:
    return [
        start_sim(artifacts, "--step-base-ms", str(STEP_MS), "--step-per-seq-ms", "0",
                  "--step-per-prefill-token-ms", "0", "--grammar-per-node-us", str(PER_NODE_US),
                  name=f"s{i}")
        for i in range(2)
    ]  # fmt: skip


def test_a_tier_refuses_an_oversized_schema_before_anything_is_sent(artifacts: Path) -> None:
    fleet = sims(artifacts)[:1]
    tiers = {"default": {"max_schema_nodes": 200, "max_schema_depth": 8}}
    gw = start_gateway(artifacts, fleet, {"tiers": tiers})
    with running(gw, *fleet):
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "json"}], "max_tokens": 4}
        refusals = (
            ("/v1/chat/completions", {**chat, "response_format": schema_format(HEAVY)},
             "response_format"),
            ("/v1/completions", {"model": MODEL, "prompt": "json", "max_tokens": 4,
                                 "structured_outputs": {"json": HEAVY}}, "structured_outputs.json"),
            ("/v1/responses", {"model": MODEL, "input": "json", "max_output_tokens": 4,
                               "text": {"format": {"type": "json_schema", "name": "s",
                                                   "schema": HEAVY}}}, "text.format"),
        )  # fmt: skip
        for path, body, param in refusals:
            r = httpx.post(gw.url + path, json=body, timeout=30)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == param and error["code"] in (
                "schema_too_large",
                "schema_too_deep",
            )
        # a deep but small schema: refused for its depth alone
        thin = {**chat, "response_format": schema_format(nested(9, width=1))}
        r = httpx.post(gw.url + "/v1/chat/completions", json=thin, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "schema_too_deep"
        # nothing reached the engine
        assert metric_sum(scrape(fleet[0].url), "vllm:request_success_total") == 0
        assert metric_sum(scrape(gw.url), "seawall_upstream_attempts_total") == 0
        # a schema within the limits is served
        r = httpx.post(gw.url + "/v1/chat/completions", timeout=30,
                       json={**chat, "response_format": schema_format(LIGHT)})  # fmt: skip
        assert r.status_code == 200, r.text


def plain_stream_gaps_s(gw: Proc, tokens: int = 25) -> list[float]:
    """A plain completion stream's gaps between content chunks, as its client sees them."""
    body = {"model": MODEL, "prompt": "plain", "max_tokens": tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    arrivals: list[float] = []
    with httpx.stream("POST", gw.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    return [b - a for a, b in itertools.pairwise(arrivals)][1:]


def heavy_flood(gw: Proc, count: int, tokens: int) -> list[threading.Thread]:
    """`count` heavy-schema requests at once, each `tokens` long, in the background."""
    body = {"model": MODEL, "prompt": "json please", "max_tokens": tokens, "ignore_eos": True,
            "response_format": schema_format(HEAVY)}  # fmt: skip

    def one() -> None:
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=one, daemon=True) for _ in range(count)]
    for t in threads:
        t.start()
    return threads


def running_requests(sim: Proc) -> float:
    return metric_sum(scrape(sim.url), "vllm:num_requests_running")


@pytest.fixture
def fleet(artifacts: Path) -> Iterator[tuple[list[Proc], Proc, Proc]]:
    """Two sims, a gateway whose default tier sends constrained requests to `r1` only
    (the bulkhead), and a gateway in front of the same sims without one."""
    two = sims(artifacts)
    bulkhead = start_gateway(artifacts, two, {"tiers": {"default": {"grammar_replicas": ["r1"]}}},
                             name="bulkhead")  # fmt: skip
    shared = start_gateway(artifacts, two, name="shared")
    with running(bulkhead, shared, *two):
        yield two, bulkhead, shared


def test_the_bulkhead_keeps_a_plain_streams_latency_while_heavy_schemas_run(
    fleet: tuple[list[Proc], Proc, Proc],
) -> None:
    (r0, r1), bulkhead, shared = fleet
    assert HEAVY_STEP_S > 5 * STEP_MS / 1000  # a heavy request's steps are >5x a plain one's
    unloaded = statistics.median(plain_stream_gaps_s(bulkhead))

    # The flood through the bulkhead gateway: every heavy request lands on r1...
    # (4 heavy requests on one replica: ~4 x 100 ms a step, so 15 tokens last ~6 s)
    flood = heavy_flood(bulkhead, count=4, tokens=15)
    wait_for(lambda: running_requests(r1) == 4, 20, what="the flood running on r1")
    assert running_requests(r0) == 0
    # ...and a plain stream, kept off r1, streams as if nothing ran.
    isolated = statistics.median(plain_stream_gaps_s(bulkhead))
    assert running_requests(r1) == 4  # measured while the flood ran
    for t in flood:
        t.join(120)

    # The same flood and stream on the same sims without the bulkhead: shared steps.
    # (2 on each replica: ~200 ms a step, so 40 tokens outlast the plain stream's 25)
    flood = heavy_flood(shared, count=4, tokens=40)
    wait_for(lambda: running_requests(r0) + running_requests(r1) == 4, 20, what="the flood")
    assert running_requests(r0) > 0 and running_requests(r1) > 0  # spread over both
    exposed = statistics.median(plain_stream_gaps_s(shared))
    for t in flood:
        t.join(120)

    assert isolated < 2.0 * unloaded, (unloaded, isolated, exposed)
    assert exposed > 4.0 * unloaded, (unloaded, isolated, exposed)
    # r0 never ran a constrained request through the bulkhead gateway
    attempts = scrape(bulkhead.url)
    assert metric_sum(attempts, "seawall_upstream_attempts_total", replica="r1") == 4
