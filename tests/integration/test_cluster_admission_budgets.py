"""Retry budgets that bound the fleet, not the instance: three `seawall serve` instances,
two `seawall sim` replicas that fail every request, one redis-server.

Before (issue 15), each instance had a whole reserve of its own: three gateways could
send three reserves' worth of retries and hedges into a failing fleet (0.61 hedges per
request against 0.27 with one). Now each holds its share (`min_per_s x
reserve_window_s / N`, N from the role manager), so with nothing succeeding the fleet's
retries stay within one reserve and its refill.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from seawall.config import RetryConfig
from tests.support.cluster import redis_cluster, start_instances, wait_for_leader
from tests.support.fleet import MODEL, metric_sum, scrape, set_fault, start_sim, wait_until
from tests.support.procs import Proc
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NAMES = ("gw-a", "gw-b", "gw-c")
FLOOD_S = 3.0


@pytest.fixture
def sims(artifacts: Path) -> Iterator[list[Proc]]:
    started = [start_sim(artifacts, name=f"sim{i}") for i in range(2)]
    try:
        yield started
    finally:
        for s in started:
            s.stop()


def _budget(url: str) -> float:
    return metric_sum(scrape(url), "seawall_retry_budget_tokens")


def test_three_instances_retry_into_a_failing_fleet_within_one_reserve(
    artifacts: Path, sims: list[Proc], redis_server: RedisServer
) -> None:
    replicas = [
        {"url": s.url, "id": f"r{i}", "model": MODEL, "node": f"node-{i}"}
        for i, s in enumerate(sims)
    ]
    instances = start_instances(
        artifacts,
        NAMES,
        replicas,
        # Every replica fails here, on purpose: keep them in routing so that the budget,
        # not the monitor or outlier ejection, is what stops the retries.
        redis_cluster(redis_server.url, outlier_consecutive_failures=100_000),
        fleet={"deep_probe_failures_threshold": 100_000},
        extra={"admission": {"enabled": False}},
    )
    wait_for_leader(instances)
    for gw in instances:
        wait_until(lambda gw=gw: all(r["routable"] for r in gw.state()["replicas"]), 15)
        wait_until(lambda gw=gw: gw.cluster()["instances"] == 3, 10, what=f"3 on {gw.name}")
    r = RetryConfig()
    reserve = r.budget_min_per_s * r.budget_reserve_window_s
    # Each holds a third of the fleet's reserve, refilling at a third of its rate.
    for gw in instances:
        wait_until(lambda gw=gw: _budget(gw.url) >= reserve / 3 - 0.05, 15, what="a share")
        assert _budget(gw.url) <= reserve / 3 + 1e-6
    before = {gw.name: metric_sum(scrape(gw.url), "seawall_retries_total") for gw in instances}
    for s in sims:
        set_fault(s, {"kind": "errors", "rate": 1.0, "when": "before_first_token"})

    body = json.dumps({"model": MODEL, "prompt": "A seawall is", "max_tokens": 2})
    started = time.monotonic()
    flood = [sys.executable, "-m", "tests.support.flood"]
    procs = [
        subprocess.Popen(
            [*flood, f"{gw.url}/v1/completions", "x", str(FLOOD_S), "4", body],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for gw in instances
    ]
    floods: list[dict[str, Any]] = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err
        floods.append(json.loads(out.strip().splitlines()[-1]))
    elapsed_s = time.monotonic() - started
    retries = sum(
        metric_sum(scrape(gw.url), "seawall_retries_total") - before[gw.name] for gw in instances
    )
    requests = sum(sum(f.values()) for f in floods)
    print(f"\n{requests} requests, {retries} retries in {elapsed_s:.1f} s: {floods}")
    assert requests > 100  # the budget, not the load, was the limit
    assert all(set(f) <= {"500"} for f in floods), floods  # nothing succeeded
    # One reserve and its refill for the whole fleet (before: three of each, 39 here).
    assert retries <= reserve + r.budget_min_per_s * elapsed_s + 1, retries
    assert retries >= reserve / 2  # the reserve was spent, as it should be
