"""Limits shared through a real redis-server on loopback: the same decisions as the
in-memory backend, exact across OS processes, and the promised behaviour when Redis dies
and comes back."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from seawall import clock
from seawall.state.limits import Denied, Lease, MemoryLimits, TenantLimits
from seawall.state.limits_redis import RedisLimits
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    await client.aclose()


# -------------------------------------------------------------------------------- parity

PARITY_LIMITS = {
    "acme": TenantLimits(requests_per_min=30, prompt_tokens_per_min=3000, max_concurrent=3),
    "globex": TenantLimits(prompt_tokens_per_min=600),
    "initech": TenantLimits(requests_per_min=12, max_concurrent=2),
}


def _decision(result: Lease | Denied) -> tuple[object, ...]:
    if isinstance(result, Lease):
        return ("lease", result.tenant, result.charged_prompt_tokens)
    return ("denied", result.reason, result.retry_after_s, result.message)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_redis_script_decides_exactly_like_the_memory_backend(
    redis_server: RedisServer, seed: int
) -> None:
    """One random sequence of acquires and releases, with time stepped by the caller,
    through both backends: every decision, Retry-After included, must be identical."""
    rng = random.Random(seed)
    memory = MemoryLimits(lease_ttl_s=20.0)
    shared = RedisLimits(
        redis_server.url, "closed", f"parity{seed}:", lease_ttl_s=20.0, clock="caller"
    )
    held: list[tuple[Lease, Lease]] = []
    now = 1_000.0 + rng.random()
    granted = denied = 0
    try:
        for _ in range(400):
            now += rng.choice([0.0, 0.0, rng.uniform(0.0, 4.0)])
            if held and rng.random() < 0.35:
                mem_lease, redis_lease = held.pop(rng.randrange(len(held)))
                actual = rng.choice([None, 0, rng.randrange(0, 700)])
                await memory.release(mem_lease, actual, now)
                await shared.release(redis_lease, actual, now)
                continue
            tenant = rng.choice(list(PARITY_LIMITS))
            tokens = rng.choice([0, rng.randrange(1, 400), rng.randrange(400, 3500)])
            expected = await memory.acquire(tenant, PARITY_LIMITS[tenant], tokens, now)
            actual_result = await shared.acquire(tenant, PARITY_LIMITS[tenant], tokens, now)
            assert _decision(actual_result) == _decision(expected), (tenant, tokens, now)
            if isinstance(expected, Lease) and isinstance(actual_result, Lease):
                held.append((expected, actual_result))
                granted += 1
            else:
                denied += 1
        assert not shared.degraded
        assert granted > 50 and denied > 50  # the sequence exercised both outcomes
    finally:
        await shared.close()


# ------------------------------------------------------------------------ reconciliation


async def test_release_reconciles_the_estimate_with_real_usage(redis_server: RedisServer) -> None:
    backend = RedisLimits(redis_server.url, "closed", "reconcile:", clock="caller")
    limits = TenantLimits(prompt_tokens_per_min=1000)
    try:
        estimate = await backend.acquire("acme", limits, 1000, now=10.0)
        assert isinstance(estimate, Lease) and estimate.charged_prompt_tokens == 1000
        await backend.release(estimate, actual_prompt_tokens=100, now=10.0)  # 900 back
        assert isinstance(await backend.acquire("acme", limits, 900, now=10.0), Lease)
        empty = await backend.acquire("acme", limits, 1, now=10.0)
        assert isinstance(empty, Denied) and empty.reason == "prompt_tokens_per_min"
        assert empty.retry_after_s == pytest.approx(0.06, abs=1e-4)  # 1 token at 1000/min

        # The reverse: an estimate of 100 that really cost 1000 leaves a debt of 900
        # on top of the (now full) bucket's remaining 900.
        low = await backend.acquire("globex", limits, 100, now=10.0)
        assert isinstance(low, Lease)
        await backend.release(low, actual_prompt_tokens=1000, now=10.0)
        owed = await backend.acquire("globex", limits, 100, now=10.0)
        assert isinstance(owed, Denied)
        assert owed.retry_after_s == pytest.approx(6.0, abs=1e-4)  # 100 tokens at 1000/min

        # A second release of the same lease must not refund again.
        await backend.release(low, actual_prompt_tokens=0, now=10.0)
        assert isinstance(await backend.acquire("globex", limits, 100, now=10.0), Denied)
    finally:
        await backend.close()


async def test_script_survives_a_script_cache_flush(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    backend = RedisLimits(redis_server.url, "closed", "flush:")
    try:
        assert isinstance(await backend.acquire("acme", TenantLimits(), 1, 0.0), Lease)
        await client.script_flush()  # what a Redis restart does to loaded scripts
        lease = await backend.acquire("acme", TenantLimits(), 1, 0.0)
        assert isinstance(lease, Lease) and not backend.degraded
        await backend.release(lease, 1, 0.0)
        assert not backend.degraded
    finally:
        await backend.close()


# ----------------------------------------------------------------- several OS processes

WORKER = r"""
import asyncio, json, sys
import redis.asyncio as aioredis
from seawall import clock
from seawall.state.limits import Lease, TenantLimits
from seawall.state.limits_redis import RedisLimits

async def main(cfg):
    # Fail closed: a decision that did not come from Redis must not be counted.
    backend = RedisLimits(cfg["url"], "closed", cfg["prefix"], socket_timeout_s=5.0)
    limits = TenantLimits(**cfg["limits"])
    side = aioredis.Redis.from_url(cfg["url"])
    await side.rpush(cfg["ready_key"], 1)
    await side.blpop([cfg["go_key"]], timeout=60)  # start together
    deadline = clock.monotonic() + cfg["duration_s"]
    stats = {"admitted": 0, "denied": {}, "max_in_flight": 0}

    async def hammer():
        for _ in range(cfg["max_attempts"]):
            if clock.monotonic() >= deadline:
                return
            now = clock.monotonic()
            result = await backend.acquire(cfg["tenant"], limits, cfg["prompt_tokens"], now)
            if isinstance(result, Lease):
                stats["admitted"] += 1
                if cfg["hold_s"]:
                    in_flight = await side.incr(cfg["in_flight_key"])
                    stats["max_in_flight"] = max(stats["max_in_flight"], in_flight)
                    await asyncio.sleep(cfg["hold_s"])
                    await side.decr(cfg["in_flight_key"])
                await backend.release(result, None, clock.monotonic())
            else:
                stats["denied"][result.reason] = stats["denied"].get(result.reason, 0) + 1
                await asyncio.sleep(cfg["denied_pause_s"])

    await asyncio.gather(*(hammer() for _ in range(cfg["tasks"])))
    await backend.close()
    await side.aclose()
    print(json.dumps(stats))

asyncio.run(main(json.loads(sys.argv[1])))
"""


async def run_workers(
    server: RedisServer, client: aioredis.Redis, count: int, **cfg: object
) -> tuple[list[dict[str, Any]], float]:
    """Each worker's stats, and Redis's clock when they were told to start (all of them
    up and connected by then: starting a process on a loaded machine takes seconds)."""
    base = {
        "url": server.url,
        "go_key": "go",
        "ready_key": "ready",
        "in_flight_key": "in_flight",
        **cfg,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WORKER, json.dumps(base)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(count)
    ]
    try:
        for _ in range(count):
            assert await client.blpop(["ready"], timeout=60), "a worker never came up"
        seconds, micros = await client.time()
        go_at = seconds + micros / 1e6
        await client.rpush("go", *range(count))
        results = []
        for proc in procs:
            out, err = await asyncio.to_thread(proc.communicate, timeout=90)
            assert proc.returncode == 0, err
            results.append(json.loads(out))
        return results, go_at
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.slow
async def test_three_processes_admit_exactly_burst_plus_refill(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    limits = {"requests_per_min": 600}  # burst 600, then 10 per second
    prefix = "exact:"
    namer = RedisLimits(redis_server.url, "closed", prefix)
    requests_key = namer.keys("acme")[0]
    await namer.close()
    # The bucket is created (full) by the first request, after the start signal.
    results, started_at = await run_workers(
        redis_server,
        client,
        3,
        prefix=prefix,
        tenant="acme",
        limits=limits,
        prompt_tokens=0,
        duration_s=2.5,
        max_attempts=20_000,
        tasks=2,
        hold_s=0,
        denied_pause_s=0.002,
    )
    admitted = sum(r["admitted"] for r in results)
    for r in results:
        assert set(r["denied"]) <= {"requests_per_min"}
    # Elapsed by Redis's clock, up to the last grant.
    last_grant_at = float(await client.hget(requests_key, "updated_at") or "nan")
    allowed = 600 + 10.0 * (last_grant_at - started_at)
    assert admitted > 600  # the refill was exercised, not just the burst
    assert admitted <= allowed + 1e-6  # never more than the limit, though 6 tasks race
    assert admitted >= 0.98 * allowed  # and the limit is what was admitted


@pytest.mark.slow
async def test_concurrency_limit_holds_across_processes(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    results, _ = await run_workers(
        redis_server,
        client,
        3,
        prefix="concurrency:",
        tenant="acme",
        limits={"max_concurrent": 5},
        prompt_tokens=0,
        duration_s=1.5,
        max_attempts=2_000,
        tasks=4,
        hold_s=0.01,
        denied_pause_s=0.002,
    )
    max_in_flight = max(r["max_in_flight"] for r in results)
    assert max_in_flight == 5  # reached, never exceeded, with 12 tasks competing
    assert sum(r["denied"].get("max_concurrent", 0) for r in results) > 0
    assert sum(r["admitted"] for r in results) > 10
    assert int(await client.get("in_flight") or 0) == 0


# ------------------------------------------------------------------- Redis goes away


async def _load(
    backend: RedisLimits,
    tenant: str,
    limits: TenantLimits,
    results: list[tuple[str, Lease | Denied, bool]],
    phase: list[str],
    stop: asyncio.Event,
) -> None:
    for _ in range(4_000):  # bounded; the test sets `stop` long before
        if stop.is_set():
            return
        result = await backend.acquire(tenant, limits, 10, clock.monotonic())
        results.append((phase[0], result, backend.degraded))
        if isinstance(result, Lease):
            await backend.release(result, 10, clock.monotonic())
        await asyncio.sleep(0.005)


async def _until(condition: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = clock.monotonic() + timeout_s
    while not condition():
        if clock.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_redis_outage_fails_open_or_closed_and_recovers(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="seawall.state.limits_redis")
    limits = TenantLimits(requests_per_min=20)
    fail_open = RedisLimits(
        redis_server.url, "open", "outage:", socket_timeout_s=0.1, reconnect_interval_s=0.3
    )
    fail_closed = RedisLimits(
        redis_server.url, "closed", "outage:", socket_timeout_s=0.1, reconnect_interval_s=0.3
    )
    opened: list[tuple[str, Lease | Denied, bool]] = []
    closed: list[tuple[str, Lease | Denied, bool]] = []
    phase = ["up"]
    stop = asyncio.Event()
    tasks = [
        asyncio.create_task(_load(fail_open, "open-tenant", limits, opened, phase, stop)),
        asyncio.create_task(_load(fail_closed, "closed-tenant", limits, closed, phase, stop)),
    ]
    try:
        await _until(lambda: len(opened) >= 30 and len(closed) >= 30, "load while up")
        phase[0] = "stopping"
        # Redis's last decisions were made by now: the per-process bucket continues from
        # them, so what it may admit while down is what refilled since this moment
        # (stopping Redis took seconds on a loaded machine).
        stopping_at = clock.monotonic()
        await asyncio.to_thread(redis_server.stop)
        await _until(lambda: fail_open.degraded and fail_closed.degraded, "degraded")
        phase[0] = "down"
        mark = len(opened)
        await _until(lambda: len(opened) >= mark + 40, "load while down")
        since_last_shared_s = clock.monotonic() - stopping_at
        # Not "down" from here: a request may reach the new Redis (a fresh full bucket)
        # before `start` has seen it answer a ping.
        phase[0] = "starting"
        await asyncio.to_thread(redis_server.start)
        phase[0] = "restarted"
        await _until(lambda: not fail_open.degraded and not fail_closed.degraded, "recovery")
        phase[0] = "recovered"
        # Fail-open: for an interval after it is back, its spent share decides as well
        # (the other instances' debts may not be in Redis yet); then Redis's fresh bucket.
        await _until(
            lambda: all(
                any(p == "recovered" and isinstance(r, Lease) for p, r, _ in results)
                for results in (opened, closed)
            ),
            "a grant after recovery",
        )
    finally:
        stop.set()
        await asyncio.gather(*tasks)
        await fail_open.close()
        await fail_closed.close()

    def in_phase(results: list[tuple[str, Lease | Denied, bool]], name: str) -> list[Any]:
        return [r for p, r, _ in results if p == name]

    # While up: shared limits (a burst of 20, then denials), nothing degraded.
    for results in (opened, closed):
        up = in_phase(results, "up")
        assert sum(isinstance(r, Lease) for r in up) >= 20
        assert all(not d for p, _, d in results if p == "up")

    # Down, fail-open: decided by a per-process bucket that continues the shared one
    # from the level Redis last reported (spent here), not a fresh full one: at most
    # what the limit refilled meanwhile, and no request refused for the backend.
    down_open = in_phase(opened, "down")
    admitted_down = sum(isinstance(r, Lease) for r in down_open)
    assert admitted_down <= 20 / 60 * (since_last_shared_s + 1.0) + 1
    assert all(d for p, _, d in opened if p == "down")
    assert all(isinstance(r, Lease) or r.reason == "requests_per_min" for r in down_open)
    # Down, fail-closed: every request is refused as backend_unavailable.
    down_closed = in_phase(closed, "down")
    assert down_closed
    assert all(isinstance(r, Denied) and r.reason == "backend_unavailable" for r in down_closed)
    assert all(r.retry_after_s >= 1.0 for r in down_closed)

    # Recovered: both decide through Redis again (a fresh bucket after the restart).
    for results in (opened, closed):
        after = in_phase(results, "recovered")
        assert any(isinstance(r, Lease) for r in after)
        assert not any(isinstance(r, Denied) and r.reason == "backend_unavailable" for r in after)

    # One log line per transition per backend, not one per request.
    messages = [r.getMessage() for r in caplog.records]
    assert sum("unreachable" in m for m in messages) == 2
    assert sum("reachable again" in m for m in messages) == 2


async def test_an_unresponsive_redis_is_probed_once_per_interval_not_per_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A Redis that accepts connections but never answers (a hung host): requests are
    refused fast without touching it, and it is tried again once per interval."""
    connections: list[asyncio.StreamWriter] = []

    async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(writer)
        await reader.read()  # never answers; returns when the client hangs up

    server = await asyncio.start_server(swallow, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backend = RedisLimits(
        f"redis://127.0.0.1:{port}/0",
        "closed",
        "hung:",
        socket_timeout_s=0.05,
        reconnect_interval_s=1.0,
    )
    caplog.set_level(logging.INFO, logger="seawall.state.limits_redis")
    try:
        results = [
            await backend.acquire("acme", TenantLimits(requests_per_min=10), 0, now=i * 0.01)
            for i in range(300)  # 3 s of caller time, 100 requests per second
        ]
    finally:
        await backend.close()
        for writer in connections:
            writer.close()
        server.close()
        await server.wait_closed()
    assert backend.degraded
    assert all(isinstance(r, Denied) and r.reason == "backend_unavailable" for r in results)
    # The first `failures_to_degrade` requests each try (one failure is not an outage),
    # then one probe at 1 s and one at 2 s of caller time.
    assert len(connections) == backend.failures_to_degrade + 2
    assert sum("unreachable" in r.getMessage() for r in caplog.records) == 1


# ------------------------------------------- issue 11, item 7: Redis pauses, no orphans


async def _zcard(client: aioredis.Redis, key: str) -> int:
    return int(await client.zcard(key))


@pytest.mark.parametrize("fail_mode", ["open", "closed"])
async def test_an_acquire_that_timed_out_during_a_redis_pause_leaves_no_lease(
    redis_server: RedisServer, client: aioredis.Redis, fail_mode: str
) -> None:
    """Redis stops answering (SIGSTOP: a long fork, a swap storm, a paused VM) while an
    acquire is on the wire. The gateway times out and decides without Redis; when Redis
    resumes it runs the acquire anyway. Before: that lease held a concurrency slot for
    its whole TTL (`total_s + 60`), so a tenant with max_concurrent 1 was refused for
    ~11 minutes. The timed-out acquire must be cancelled once Redis answers again."""
    limits = TenantLimits(requests_per_min=600, max_concurrent=1)
    backend = RedisLimits(
        redis_server.url,
        fail_mode,  # type: ignore[arg-type]
        f"pause-{fail_mode}:",
        lease_ttl_s=660.0,
        socket_timeout_s=0.1,
        reconnect_interval_s=0.2,
    )
    leases_key = backend.keys("acme")[2]
    assert redis_server.proc is not None
    try:
        warm = await backend.acquire("acme", limits, 0, clock.monotonic())
        assert isinstance(warm, Lease)  # the pooled connection exists, so the next
        await backend.release(warm, None, clock.monotonic())  # acquire is sent at once
        redis_server.proc.signal(signal.SIGSTOP)
        try:
            during = await backend.acquire("acme", limits, 0, clock.monotonic())
        finally:
            redis_server.proc.signal(signal.SIGCONT)
        # Decided without Redis (one timeout: not yet an outage).
        if fail_mode == "closed":
            assert isinstance(during, Denied) and during.reason == "backend_unavailable"
        if isinstance(during, Lease):  # fail-open: a per-process lease, released as usual
            await backend.release(during, None, clock.monotonic())
        # The acquire Redis ran late must not keep the slot: within a few reconnect
        # intervals the tenant runs one request through Redis again.
        deadline = clock.monotonic() + 5.0
        granted: Lease | Denied | None = None
        while clock.monotonic() < deadline:
            granted = await backend.acquire("acme", limits, 0, clock.monotonic())
            if isinstance(granted, Lease) and not backend.degraded:
                break
            if isinstance(granted, Lease):
                await backend.release(granted, None, clock.monotonic())
            await asyncio.sleep(0.05)
        assert isinstance(granted, Lease) and not backend.degraded, granted
        assert await _zcard(client, leases_key) == 1  # only the one just granted
        await backend.release(granted, None, clock.monotonic())
        assert await _zcard(client, leases_key) == 0
    finally:
        await backend.close()


async def test_a_release_during_a_redis_pause_is_delivered_when_it_resumes(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    """A release that cannot reach Redis (before: dropped, the lease left to expire)
    is retried until Redis takes it."""
    limits = TenantLimits(max_concurrent=1)
    backend = RedisLimits(
        redis_server.url,
        "closed",
        "pause-release:",
        lease_ttl_s=660.0,
        socket_timeout_s=0.1,
        reconnect_interval_s=0.2,
    )
    leases_key = backend.keys("acme")[2]
    assert redis_server.proc is not None
    try:
        lease = await backend.acquire("acme", limits, 0, clock.monotonic())
        assert isinstance(lease, Lease)
        redis_server.proc.signal(signal.SIGSTOP)
        try:
            await backend.release(lease, None, clock.monotonic())
        finally:
            redis_server.proc.signal(signal.SIGCONT)
        await _until_async(
            lambda: _zcard(client, leases_key), 0, "the lease released in Redis", 5.0
        )
        again = await backend.acquire("acme", limits, 0, clock.monotonic())
        assert isinstance(again, Lease)
        await backend.release(again, None, clock.monotonic())
    finally:
        await backend.close()


async def test_acquire_by_lease_id_is_idempotent_and_cancel_wins_either_order(
    redis_server: RedisServer, client: aioredis.Redis
) -> None:
    backend = RedisLimits(redis_server.url, "closed", "idem:", clock="caller")
    limits = TenantLimits(requests_per_min=3, max_concurrent=2)
    requests_key, _, leases_key = backend.keys("acme")
    try:
        first = await backend.acquire("acme", limits, 0, 10.0, lease_id="L1")
        retried = await backend.acquire("acme", limits, 0, 10.0, lease_id="L1")
        assert isinstance(first, Lease) and isinstance(retried, Lease)
        assert await _zcard(client, leases_key) == 1
        assert float(await client.hget(requests_key, "tokens") or 0) == 2.0  # charged once
        await backend.cancel("acme", "L1", 10.0)
        assert await _zcard(client, leases_key) == 0
        assert float(await client.hget(requests_key, "tokens") or 0) == 3.0  # given back
        await backend.cancel("acme", "L2", 10.0)  # before its acquire arrives
        late = await backend.acquire("acme", limits, 0, 10.0, lease_id="L2")
        assert isinstance(late, Denied) and await _zcard(client, leases_key) == 0
        assert float(await client.hget(requests_key, "tokens") or 0) == 3.0
    finally:
        await backend.close()


async def _until_async(
    read: Callable[[], Any], expected: object, what: str, timeout_s: float
) -> None:
    deadline = clock.monotonic() + timeout_s
    while (value := await read()) != expected:
        if clock.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what} (last: {value!r})")
        await asyncio.sleep(0.02)


# ------------------------------- instances that count each other (no cluster to say)


async def test_instances_count_each_other_and_an_idle_one_comes_back_after_an_outage(
    redis_server: RedisServer,
) -> None:
    """Two instances without a cluster count each other through Redis (a fail-open
    fallback holds 1/N). One goes through an outage and then takes no request: it still
    comes back once Redis does (its beat is its probe), and both count two again in the
    restarted Redis, which lost the count. Before, an instance whose kept cancels expired
    during the outage took that for Redis coming back (`degraded` 0, "shared limits
    restored" logged, Redis still down), and one that took no request after an outage
    was out of the count. Fail-closed here: a fail-open one's debts are kept a minute."""
    a, b = (
        RedisLimits(
            redis_server.url, "closed", "idle-back:", lease_ttl_s=0.3, reconnect_interval_s=0.2
        )
        for _ in range(2)
    )
    try:
        await a.start()
        await b.start()
        await _until(lambda: a.sharers() == b.sharers() == 2, "both counting two", 5)
        redis_server.stop()
        for _ in range(a.failures_to_degrade):
            await a.acquire("acme", TenantLimits(requests_per_min=60), 0, clock.monotonic())
        assert a.degraded
        await _until(lambda: a.undelivered == 0, "its cancels expired and dropped", 5)
        await asyncio.sleep(0.5)  # probes meanwhile (each 0.2 s) find Redis still down
        assert a.degraded, "came back while Redis was still down"
        redis_server.start()
        await _until(lambda: not a.degraded, "the idle instance back once Redis is", 5)
        await _until(lambda: a.sharers() == b.sharers() == 2, "both counting two again", 5)
    finally:
        await a.close()
        await b.close()
    async with aioredis.Redis.from_url(redis_server.url) as c:
        assert await c.zcard("idle-back:instances") == 0  # both left the count at close
