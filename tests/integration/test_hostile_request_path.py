"""Hostile clients on the request path (issue 11, items 2, 3 and 8), against a real gateway
and real `seawall sim` replicas on loopback. Each test is bounded in count and time."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import socket
import sys
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from seawall.auth import hash_key
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.hostile import rss_kib
from tests.support.procs import spawn

pytestmark = pytest.mark.integration

KEY_GOLD = "sk-sw-hostile-gold-000000000000000000000000000000"
KEY_FREE = "sk-sw-hostile-free-000000000000000000000000000000"


def tenants() -> dict[str, object]:
    return {
        "tiers": {"gold": {"priority": 0}, "free": {"priority": 1}},
        "tenants": {
            "gold": {"tier": "gold", "api_key_hashes": [hash_key(KEY_GOLD)]},
            "free": {"tier": "free", "api_key_hashes": [hash_key(KEY_FREE)]},
        },
    }


def gold_records(log: str) -> list[dict[str, Any]]:
    # Polled while the flood logs thousands of refusals: parse only the gold tenant's lines.
    lines = "\n".join(line for line in log.splitlines() if '"tenant":"gold"' in line)
    return [r for r in access_records(lines) if r["tenant"] == "gold"]


def waited(gold: list[dict[str, Any]]) -> bool:
    """Whether a gold request waited for room (beyond the door's own few milliseconds)."""
    return any(g["queued_s"] > 0.05 for g in gold)


def test_without_a_key_nothing_but_401_and_no_body_is_read(artifacts: Path) -> None:
    """Item 2: a caller without a valid key must not learn the model list from a 404, nor
    get body errors, and the gateway must not read more than the headers."""
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim], tenants())
    with running(gw, sim):
        for body in (
            b"{not json",
            orjson.dumps({"model": "no-such-model", "prompt": "hi"}),
            orjson.dumps({"model": MODEL, "prompt": "hi"}),
        ):
            r = httpx.post(gw.url + "/v1/completions", content=body, timeout=10)
            assert r.status_code == 401, r.text
            assert MODEL not in r.text and "no-such-model" not in r.text
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
        # Headers promising 50 MB, then nothing: the 401 comes at once, unread body and all.
        with socket.create_connection(("127.0.0.1", gw.port or 0), timeout=5) as s:
            s.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 50000000\r\n\r\n{"
            )
            head = s.recv(4096)
        assert head.startswith(b"HTTP/1.1 401"), head[:200]


def test_client_strings_never_become_labels_and_are_cut_in_logs_and_errors(
    artifacts: Path,
) -> None:
    """Item 3: 10,000 distinct model names grew /metrics from 212 to 20,212 samples, and
    30 requests with 2 MB model names added 100 MB of RSS that was never released."""
    sim = start_sim(artifacts)
    gw = start_gateway(artifacts, [sim])
    with running(gw, sim):

        async def flood(first: int, n: int) -> set[int]:
            async with httpx.AsyncClient(timeout=30) as a:
                statuses: set[int] = set()
                for i in range(first, first + n, 100):
                    got = await asyncio.gather(
                        *(
                            a.post(
                                gw.url + "/v1/completions",
                                json={"model": f"m-{i + j}", "prompt": "x"},
                            )
                            for j in range(100)
                        )
                    )
                    statuses |= {r.status_code for r in got}
                return statuses

        assert asyncio.run(flood(0, 100)) == {404}
        before = len(scrape(gw.url))
        assert asyncio.run(flood(100, 1900)) == {404}
        after = scrape(gw.url)
        assert len(after) == before  # 1,900 more names, not one more series
        assert metric_sum(after, "seawall_requests_total", model="other") == 2000

        rss_before = rss_kib(gw.pid)
        log_before = gw.log_path.stat().st_size
        huge = "m" * 2_000_000
        with httpx.Client(timeout=30) as c:
            for _ in range(30):
                r = c.post(gw.url + "/v1/completions", json={"model": huge, "prompt": "x"})
                assert r.status_code == 404 and len(r.content) < 2000, len(r.content)
        grown_mib = (rss_kib(gw.pid) - rss_before) / 1024
        assert grown_mib < 20, f"RSS grew {grown_mib:.0f} MiB"
        assert gw.log_path.stat().st_size - log_before < 200_000


def access_records(gw_log: str) -> list[dict[str, Any]]:
    """The gateway's access log, each record with its arrival and first-token times."""
    out = []
    for line in gw_log.splitlines():
        if " seawall.access " not in line:
            continue
        stamp, _, payload = line.partition(" INFO seawall.access ")
        # The log's local time; only differences between records matter here.
        when = dt.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=dt.UTC)
        ended = when.timestamp()
        rec = json.loads(payload)
        rec["arrived"] = ended - rec["duration_s"]
        if rec["ttft_s"] is not None:
            rec["first_token"] = rec["arrived"] + rec["ttft_s"]
        out.append(rec)
    return out


def test_the_gold_tier_is_served_while_an_unlimited_lower_tier_is_shed(artifacts: Path) -> None:
    """Item 8: a priority-1 tier with no limits, 150 concurrent 400-token streams retried
    as soon as they are refused, kept winning the slots a waiting gold request needed
    (it waited 5 s and failed with queue_timeout in 3 of 3 runs). While a gold request
    waits, no lower-tier request may be admitted: freed capacity goes to gold first."""
    small_kv = ("--kv-blocks", "160", "--max-model-len", "2048", "--step-base-ms", "10")
    sims = [start_sim(artifacts, *small_kv, name=f"s{i}") for i in range(2)]
    # Gold may wait as long as a 400-token stream takes to end on a loaded CI machine; what
    # fails the old rule is a lower-tier request admitted meanwhile (`overtaken` below).
    config = {**tenants(), "admission": {"queue_timeout_s": 20}, "metrics": {"access": "public"}}
    gw = start_gateway(artifacts, sims, config)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 400, "stream": True}
    with running(gw, *sims):
        flood = spawn(
            [
                *(sys.executable, "-m", "tests.support.flood", gw.url + "/v1/completions"),
                *(KEY_FREE, "60", "150", orjson.dumps(body).decode()),  # stopped below
            ],
            artifacts / "flood.log",
        )
        wait_until(
            lambda: metric_sum(scrape(gw.url), "seawall_shed_total", tenant="free") > 100,
            15,
            what="the lower tier saturating the fleet and being shed",
        )
        # Whether a given gold request finds the fleet full depends on when the flood's streams
        # end (and, on a loaded machine, how fast the flood refills them): send gold requests
        # one at a time, at least 4 and at most 12, until one of them has had to wait.
        statuses: list[int] = []
        gold: list[dict[str, Any]] = []
        with httpx.Client(timeout=30) as c:
            while len(gold) < 12 and (len(gold) < 4 or not waited(gold)):
                with c.stream(
                    "POST",
                    gw.url + "/v1/completions",
                    json={**body, "prompt": "x"},
                    headers={"Authorization": f"Bearer {KEY_GOLD}"},
                ) as r:
                    statuses.append(r.status_code)
                    next(r.iter_raw(), b"")  # its first token; then leave
                # Its record is written once the gateway sees its client gone.
                wait_until(
                    lambda: len(gold_records(gw.log())) == len(statuses),
                    15,
                    interval=0.1,
                    what="the gold request's access record",
                )
                gold = gold_records(gw.log())
        assert flood.alive(), "the flood ended before the gold requests did"
        flood.stop()
        records = access_records(gw.log())
    assert statuses == [200] * len(gold)
    # A lower-tier request is admitted or shed as it arrives, except one refused twice
    # already, which waits its turn (queue_after_refusals) behind every gold request.
    free_admitted = [r for r in records if r["tenant"] == "free" and r["ttft_s"]]
    shed_free = [r for r in records if r["tenant"] == "free" and r["status"] == 429]
    assert len(shed_free) > 100
    assert waited(gold), f"no gold request of {len(gold)} had to wait for room: {gold}"
    for g in gold:
        # Margins for the log's millisecond stamps.
        waiting = (g["arrived"] + 0.02, g["arrived"] + g["queued_s"] - 0.02)
        # When a free request left the door (arrival, plus any wait for its turn).
        overtaken = [
            r for r in free_admitted if waiting[0] < r["arrived"] + r["queued_s"] < waiting[1]
        ]
        assert overtaken == [], f"admitted while gold {g} waited: {overtaken}"
