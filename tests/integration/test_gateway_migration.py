"""Mid-stream migration against real `seawall sim` replicas.

A replica crashed mid-stream: with migration (opt-in per tier) the client's stream goes
on from another replica and, at temperature 0, carries exactly the text of an
uninterrupted run; without it, exactly the crashed replica's streams fail and no others.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    set_fault,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

FLEET_FAST = {
    "liveness_interval_s": 0.25,
    "deep_probe_idle_interval_s": 30,
    "deep_probe_interval_s": 30,
}


def events(body: bytes) -> list[dict[str, Any]]:
    out = []
    for e in body.split(b"\n\n"):
        if e.startswith(b"data: ") and e != b"data: [DONE]":
            out.append(json.loads(e[6:]))
    return out


def text_of(body: bytes) -> str:
    text = ""
    for ev in events(body):
        for c in ev.get("choices", []):
            text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


def running_on(sims: list[Proc]) -> list[Proc]:
    return [s for s in sims if metric_sum(scrape(s.url), "vllm:num_requests_running") > 0]


REQUESTS = {
    "completions": (
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "The sea wall at dawn",
            "max_tokens": 120,
            "temperature": 0,
            "ignore_eos": True,
        },
    ),
    "chat": (
        "/v1/chat/completions",
        {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 120,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell a story."}],
        },
    ),
}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_migrated_stream_equals_an_uninterrupted_run(route: str, artifacts: Path) -> None:
    path, body = REQUESTS[route]
    sims = [start_sim(artifacts, "--step-base-ms", "20", name=f"s{i}") for i in range(2)]
    gw = start_gateway(
        artifacts, sims, {"tiers": {"default": {"migrate": True}}, "fleet": FLEET_FAST}
    )
    with running(gw, *sims):
        body_with_usage = {**body, "stream": True, "stream_options": {"include_usage": True}}
        reference = httpx.post(gw.url + path, json=body_with_usage, timeout=30).content
        assert b'"error"' not in reference
        with httpx.stream("POST", gw.url + path, json=body_with_usage, timeout=30) as r:
            chunks = r.iter_raw()
            got = next(chunks)
            while got.count(b"data: ") < 10:
                got += next(chunks)
            victim = running_on(sims)
            assert len(victim) == 1
            set_fault(victim[0], {"kind": "crash"})
            got += b"".join(chunks)
        assert b'"error"' not in got and got.endswith(b"data: [DONE]\n\n")
        assert text_of(got) == text_of(reference)
        evs = events(got)
        assert len({e["id"] for e in evs}) == 1  # one stream id across both replicas
        usage = [e["usage"] for e in evs if e.get("usage")]
        assert len(usage) == 1 and usage[0] == events(reference)[-1]["usage"]
        if route == "chat":
            assert sum(1 for e in evs for c in e["choices"] if "role" in c.get("delta", {})) == 1
        assert metric_sum(scrape(gw.url), "seawall_migrations_total", outcome="ok") == 1


def stream_many(url: str, path: str, body: dict[str, Any], n: int) -> list[bytes]:
    results: list[bytes] = [b""] * n

    def one(i: int) -> None:
        try:
            results[i] = httpx.post(url + path, json={**body, "stream": True}, timeout=60).content
        except httpx.HTTPError as e:
            results[i] = f"transport error {e}".encode()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    return results  # filled in as the threads finish; callers join via wait


@pytest.mark.parametrize("migrate", [False, True])
def test_crash_under_load_fails_only_the_crashed_replicas_streams(
    migrate: bool, artifacts: Path
) -> None:
    path, body = REQUESTS["completions"]
    body = {**body, "max_tokens": 200}
    sims = [start_sim(artifacts, "--step-base-ms", "15", name=f"s{i}") for i in range(3)]
    gw = start_gateway(
        artifacts, sims, {"tiers": {"default": {"migrate": migrate}}, "fleet": FLEET_FAST}
    )
    with running(gw, *sims):
        n = 12
        results = stream_many(gw.url, path, body, n)
        wait_until(
            lambda: sum(metric_sum(scrape(s.url), "vllm:num_requests_running") for s in sims) == n,
            10,
            what="all streams running",
        )
        victim = sims[0]
        on_victim = int(metric_sum(scrape(victim.url), "vllm:num_requests_running"))
        assert on_victim > 0
        set_fault(victim, {"kind": "crash"})
        wait_until(lambda: all(results), 60, interval=0.05, what="every stream to end")
        failed = [r for r in results if b'"error"' in r or not r.endswith(b"data: [DONE]\n\n")]
        if migrate:
            assert failed == []  # every stream completed
            assert metric_sum(scrape(gw.url), "seawall_migrations_total", outcome="ok") == on_victim
        else:
            # The blast radius is one replica: exactly its streams failed, cleanly.
            assert len(failed) == on_victim
            assert all(r.endswith(b"data: [DONE]\n\n") for r in failed)


@pytest.mark.parametrize("migrate", [False, True])
def test_a_replica_shutting_down_mid_stream(migrate: bool, artifacts: Path) -> None:
    """vLLM's default SIGTERM aborts in-flight requests: each stream ends with
    finish_reason "abort" and [DONE], which looks finished but is not. The gateway counts
    it as a dropped stream, and with migration finishes the answer elsewhere."""
    import signal

    path, body = REQUESTS["completions"]
    sims = [start_sim(artifacts, "--step-base-ms", "20", name=f"s{i}") for i in range(2)]
    gw = start_gateway(
        artifacts, sims, {"tiers": {"default": {"migrate": migrate}}, "fleet": FLEET_FAST}
    )
    with running(gw, *sims):
        reference = httpx.post(gw.url + path, json={**body, "stream": True}, timeout=30).content
        with httpx.stream("POST", gw.url + path, json={**body, "stream": True}, timeout=30) as r:
            chunks = r.iter_raw()
            got = next(chunks)
            while got.count(b"data: ") < 10:
                got += next(chunks)
            victim = running_on(sims)
            assert len(victim) == 1
            victim[0].signal(signal.SIGTERM)
            got += b"".join(chunks)
        assert got.endswith(b"data: [DONE]\n\n")
        m = scrape(gw.url)
        if migrate:
            assert text_of(got) == text_of(reference) and b'"abort"' not in got
            assert metric_sum(m, "seawall_migrations_total", outcome="ok") == 1
        else:
            assert b'"finish_reason":"abort"' in got
            assert len(text_of(got)) < len(text_of(reference))
            assert metric_sum(m, "seawall_stream_errors_total", reason="upstream_aborted") == 1
