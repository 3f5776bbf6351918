"""Tenant limits shared by three gateway processes through one real redis-server.

Users run several gateways behind a load balancer; a per-process limit would then admit
N times the limit. Here three `seawall serve` processes share one Redis, so the tenant's
limit holds for the fleet of gateways, and a Redis outage is survived in the configured
mode.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

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
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HASH_KEY = "sk-sw-shared-test-key-0000000000000000000000000"


def gateways(
    artifacts: Path, sim: Proc, redis: RedisServer, tier: dict[str, Any], fail_mode: str = "open"
) -> list[Proc]:
    from seawall.auth import hash_key

    cfg = {
        "ratelimit": {"backend": "redis", "redis_url": redis.url, "fail_mode": fail_mode},
        "tiers": {"t": tier},
        "tenants": {"acme": {"tier": "t", "api_key_hashes": [hash_key(HASH_KEY)]}},
        "admission": {"enabled": False},
        "metrics": {"access": "public"},  # this test reads each gateway's counters
    }
    return [start_gateway(artifacts, [sim], cfg, name=f"gw{i}") for i in range(3)]


async def hammer(
    urls: list[str], seconds: float, concurrency: int, body: dict[str, Any]
) -> tuple[int, int, float]:
    """Round-robin requests over the gateways for a bounded time, ending one second after
    the first refusal (a loaded machine may need longer to reach a limit, and the figures
    are per elapsed second); (ok, refused, elapsed)."""
    counts = {"ok": 0, "refused": 0}
    deadline = time.monotonic() + seconds
    cycle = itertools.cycle(urls)
    async with httpx.AsyncClient(
        timeout=10,
        headers={"Authorization": f"Bearer {HASH_KEY}"},
        limits=httpx.Limits(max_connections=concurrency),
    ) as c:

        async def worker() -> None:
            nonlocal deadline
            for _ in range(100_000):  # bounded in count as well as time
                if time.monotonic() >= deadline:
                    return
                r = await c.post(next(cycle) + "/v1/completions", json=body)
                counts["ok" if r.status_code == 200 else "refused"] += 1
                assert r.status_code in (200, 429), r.text
                if r.status_code == 429 and counts["refused"] == 1:
                    deadline = min(deadline, time.monotonic() + 1.0)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return counts["ok"], counts["refused"], time.monotonic() - start


def test_three_gateways_admit_within_two_percent_of_one_limit(
    redis_server: RedisServer, artifacts: Path
) -> None:
    sim = start_sim(artifacts, "--step-base-ms", "0.1", "--step-per-seq-ms", "0")
    per_min = 300  # a burst of 300, then 5 per second
    gws = gateways(artifacts, sim, redis_server, {"requests_per_min": per_min})
    with running(sim, *gws):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        ok, refused, elapsed = asyncio.run(hammer([g.url for g in gws], 15.0, 24, body))
        assert refused > 0  # the limit was really reached
        expected = per_min + per_min / 60 * elapsed
        assert abs(ok - expected) <= 0.02 * expected, (ok, expected, elapsed)
        # Each gateway alone would have admitted up to the whole limit: check it was shared.
        admitted = [metric_sum(scrape(g.url), "seawall_requests_total", status="200") for g in gws]
        assert all(a < per_min for a in admitted) and sum(admitted) == ok


def test_a_gateway_paused_mid_burst_does_not_grant_its_share_twice(
    redis_server: RedisServer, artifacts: Path
) -> None:
    """One gateway's process stops for 0.3 s while its acquires are in flight (a VM
    pause, a long GC pause, a CPU taken on a loaded host: what a CI run met), and Redis
    answers them meanwhile. Before: the answers were thrown away as timeouts, the
    gateway took it for a Redis outage and granted its share of the bucket from its
    fallback on top of what the other two took (415 admitted against 320 in that run;
    587-595 against 310 here, where no cluster tells a gateway of the other two, so
    its share is the whole level it last saw).
    To have acquires in flight when the process stops, Redis itself stops first for
    60 ms (shorter than the 0.1 s timeout: the other two gateways wait it out)."""
    sim = start_sim(artifacts, "--step-base-ms", "0.1", "--step-per-seq-ms", "0")
    per_min = 300
    gws = gateways(artifacts, sim, redis_server, {"requests_per_min": per_min})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    assert redis_server.proc is not None
    redis_proc = redis_server.proc

    async def burst_with_a_pause() -> tuple[int, int, float]:
        load = asyncio.create_task(hammer([g.url for g in gws], 15.0, 24, body))
        await asyncio.sleep(0.1)  # the burst is under way: the bucket is still full
        redis_proc.signal(signal.SIGSTOP)
        try:
            await asyncio.sleep(0.03)  # the gateways' acquires wait on Redis
            gws[0].signal(signal.SIGSTOP)
            await asyncio.sleep(0.03)
        finally:
            redis_proc.signal(signal.SIGCONT)
        try:
            await asyncio.sleep(0.3)  # Redis answers gw0 while gw0 is stopped
        finally:
            gws[0].signal(signal.SIGCONT)
        return await load

    with running(sim, *gws):
        ok, refused, elapsed = asyncio.run(burst_with_a_pause())
        assert refused > 0
        expected = per_min + per_min / 60 * elapsed
        assert abs(ok - expected) <= 0.02 * expected, (ok, expected, elapsed)
        assert metric_sum(scrape(gws[0].url), "seawall_ratelimit_backend_degraded") == 0
    assert "limits backend unreachable" not in gws[0].log()


def test_concurrency_limit_holds_across_three_gateways(
    redis_server: RedisServer, artifacts: Path
) -> None:
    sim = start_sim(artifacts)
    gws = gateways(artifacts, sim, redis_server, {"max_concurrent": 4, "max_tokens": 4000})
    with running(sim, *gws):
        clients = [
            httpx.Client(timeout=30, headers={"Authorization": f"Bearer {HASH_KEY}"})
            for _ in range(9)
        ]
        streams = []
        statuses = []
        for i, c in enumerate(clients):
            req = c.build_request(
                "POST",
                gws[i % 3].url + "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": "x",
                    "max_tokens": 3000,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            resp = c.send(req, stream=True)
            statuses.append(resp.status_code)
            streams.append(resp)
        assert statuses.count(200) == 4 and statuses.count(429) == 5
        for s, c in zip(streams, clients, strict=True):
            s.close()
            c.close()


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_redis_outage_is_survived_in_the_configured_mode(
    redis_server: RedisServer, artifacts: Path, mode: str
) -> None:
    sim = start_sim(artifacts)
    gws = gateways(artifacts, sim, redis_server, {"requests_per_min": 6000}, fail_mode=mode)
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    auth = {"Authorization": f"Bearer {HASH_KEY}"}
    with running(sim, *gws):
        assert (
            httpx.post(gws[0].url + "/v1/completions", json=body, headers=auth).status_code == 200
        )
        redis_server.stop()
        statuses = [
            httpx.post(g.url + "/v1/completions", json=body, headers=auth, timeout=10)
            for g in gws
            for _ in range(3)
        ]
        if mode == "open":
            assert all(r.status_code == 200 for r in statuses)
        else:
            assert all(r.status_code == 503 for r in statuses)
            assert all(r.json()["error"]["code"] == "limits_unavailable" for r in statuses)
            assert all("retry-after" in r.headers for r in statuses)
        assert all(
            metric_sum(scrape(g.url), "seawall_ratelimit_backend_degraded") == 1 for g in gws
        )
        redis_server.start()

        def recovered() -> bool:
            r = httpx.post(gws[0].url + "/v1/completions", json=body, headers=auth, timeout=10)
            return (
                r.status_code == 200
                and metric_sum(scrape(gws[0].url), "seawall_ratelimit_backend_degraded") == 0
            )

        wait_until(recovered, 15, interval=0.5, what="recovery after redis restart")
        assert "redis" in gws[0].log().lower()  # the outage is said in the logs
        # The restarted Redis lost the instances' count; they count each other again
        # (a gateway that took no request since still beats), ready for the next outage.
        wait_until(
            lambda: all(metric_sum(scrape(g.url), "seawall_ratelimit_instances") == 3 for g in gws),
            15,
            interval=0.2,
            what="each gateway counts three again",
        )


def test_without_a_cluster_the_gateways_count_each_other_and_share_an_outage(
    redis_server: RedisServer, artifacts: Path
) -> None:
    """`ratelimit: redis` and no `cluster:` (compose files, VMs behind a load balancer):
    the gateways count each other through Redis, so that when it goes down each fail-open
    fallback grants its third of what was left, not all of it. Before, a gateway without
    a cluster counted itself alone, and the three fallbacks together granted three times
    what was left of the tenant's bucket."""
    sim = start_sim(artifacts, "--step-base-ms", "0.1", "--step-per-seq-ms", "0")
    per_min = 120  # a burst of 120, then 2 per second
    gws = gateways(artifacts, sim, redis_server, {"requests_per_min": per_min})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    auth = {"Authorization": f"Bearer {HASH_KEY}"}
    with running(sim, *gws), httpx.Client(timeout=10, headers=auth) as c:
        wait_until(
            lambda: all(metric_sum(scrape(g.url), "seawall_ratelimit_instances") == 3 for g in gws),
            15,
            interval=0.2,
            what="each gateway counts three",
        )
        started = time.monotonic()
        spent = 60  # half the burst, round-robin: each gateway sees the bucket's level
        for i in range(spent):
            assert c.post(gws[i % 3].url + "/v1/completions", json=body).status_code == 200
        redis_server.stop()
        granted = 0
        for g in gws:  # each until its fallback refuses; bounded
            for _ in range(per_min):
                r = c.post(g.url + "/v1/completions", json=body)
                assert r.status_code in (200, 429), r.text
                if r.status_code == 429:
                    break
                granted += 1
        elapsed = time.monotonic() - started
        left = per_min - spent + per_min / 60 * elapsed  # what the shared bucket held
        print(f"\nduring the outage: {granted} granted of {left:.0f} left")
        assert granted <= 1.1 * left + 3, (granted, left)  # before: about 3x
        assert granted >= 0.7 * (per_min - spent)  # fail-open: the fallbacks do grant
        assert all(
            metric_sum(scrape(g.url), "seawall_ratelimit_backend_degraded") == 1 for g in gws
        )
