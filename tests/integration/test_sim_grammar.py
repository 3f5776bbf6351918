"""Pathological structured output in `seawall sim` (issue 11, item 11, the emulator's part):
a heavy JSON schema slows every decode step it takes part in, so a plain stream that shares
those steps sees its inter-token latency rise, as in vLLM, where sampling waits for the
batch's grammar bitmask (filled while the forward pass runs). vLLM 0.33 ignores the
removed `guided_json`, and so does the sim: that costs nothing."""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from seawall.sim.scheduler import grammar_step_cost_s, schema_shape
from tests.support.procs import ARTIFACTS, Proc, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration

BASE_STEP_MS = 5.0
PER_NODE_US = 2.0  # the flag's documented default


def heavy_schema(depth: int = 9, width: int = 2) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema for i in range(width)}}
    return schema


HEAVY = heavy_schema()
HEAVY_STEP_S = grammar_step_cost_s(*schema_shape(HEAVY), PER_NODE_US / 1e6)


@pytest.fixture(scope="module")
def sim() -> Iterator[Proc]:
    port = free_port()
    proc = spawn(
        seawall_argv(
            "sim", "--port", str(port), "--enable-faults",
            "--step-base-ms", str(BASE_STEP_MS), "--step-per-seq-ms", "0",
            "--step-per-prefill-token-ms", "0", "--grammar-per-node-us", str(PER_NODE_US),
        ),
        ARTIFACTS / "test_sim_grammar" / "sim.log",
        port=port,
    )  # fmt: skip
    wait_http(proc.url + "/health", proc=proc)
    try:
        yield proc
    finally:
        proc.stop()


def state(sim: Proc) -> dict[str, Any]:
    with urllib.request.urlopen(sim.url + "/sim/state", timeout=10) as r:
        loaded: dict[str, Any] = json.loads(r.read())
        return loaded


def stream_itl_s(sim: Proc, max_tokens: int = 12) -> list[float]:
    """A plain completion stream's gaps between content chunks, as its client sees them."""
    conn = http.client.HTTPConnection("127.0.0.1", sim.port, timeout=60)
    body = {"prompt": "plain", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    arrivals: list[float] = []
    while True:
        line = resp.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: "):
            arrivals.append(time.monotonic())
    conn.close()
    return [b - a for a, b in itertools.pairwise(arrivals)]


def run_in_background(sim: Proc, body: dict[str, Any]) -> threading.Thread:
    def send() -> None:
        req = urllib.request.Request(
            sim.url + "/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def wait_running(sim: Proc, count: int, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if len(state(sim)["running"]) >= count and state(sim)["steps"] > 0:
            return
        time.sleep(0.01)
    raise AssertionError(f"fewer than {count} requests running: {state(sim)}")


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def test_a_heavy_schema_raises_a_co_scheduled_streams_inter_token_latency(sim: Proc) -> None:
    assert HEAVY_STEP_S > 0.04  # the schema costs ~10x the 5 ms step per decode step
    alone = stream_itl_s(sim)

    # a constrained request long enough to share every step of the plain stream
    heavy = run_in_background(sim, {
        "prompt": "json please", "max_tokens": 30, "ignore_eos": True,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "deep", "schema": HEAVY}}})  # fmt: skip
    wait_running(sim, 1)
    shared = stream_itl_s(sim)
    # the engine's own account of the steps they shared (deterministic, not a timing)
    assert state(sim)["last_step_cost_s"] == pytest.approx(max(BASE_STEP_MS / 1000, HEAVY_STEP_S))
    heavy.join(timeout=60)

    # what the plain stream's client sees: every gap holds the heavy grammar's work
    assert mean(shared) > 3 * mean(alone), (alone, shared)
    assert min(shared) > 0.5 * HEAVY_STEP_S, shared


def test_removed_guided_json_costs_nothing_as_in_vllm_033(sim: Proc) -> None:
    ignored = run_in_background(sim, {
        "prompt": "json please", "max_tokens": 30, "ignore_eos": True,
        "guided_json": HEAVY})  # fmt: skip
    wait_running(sim, 1)
    stream_itl_s(sim, max_tokens=4)
    assert state(sim)["last_step_cost_s"] == pytest.approx(BASE_STEP_MS / 1000)
    ignored.join(timeout=60)
