"""The in-memory limits backend: what a tenant at its limits observes (admission, the
denial reason, Retry-After), with time passed in."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seawall.state.backends import open_limits_backend
from seawall.state.limits import (
    Denied,
    Lease,
    MemoryLimits,
    TenantLimits,
    denied_error,
)


def about(seconds: float) -> object:
    """A Retry-After equal to `seconds` up to the 10 microseconds of safety margin."""
    return pytest.approx(seconds, abs=1e-4)


async def take(
    backend: MemoryLimits, limits: TenantLimits, tokens: int, now: float, tenant: str = "acme"
) -> Lease | Denied:
    return await backend.acquire(tenant, limits, tokens, now)


async def test_requests_per_min_bursts_a_minute_then_retry_after_is_the_refill() -> None:
    backend, limits = MemoryLimits(), TenantLimits(requests_per_min=60)
    for _ in range(60):
        assert isinstance(await take(backend, limits, 0, now=0.0), Lease)
    denied = await take(backend, limits, 0, now=0.0)
    assert isinstance(denied, Denied)
    assert denied.reason == "requests_per_min"
    assert denied.retry_after_s == about(1.0)  # one request refills in 1 s
    assert "60 requests per minute" in denied.message
    assert isinstance(await take(backend, limits, 0, now=0.25), Denied)
    assert isinstance(await take(backend, limits, 0, now=1.0), Lease)


async def test_prompt_token_retry_after_is_time_until_this_prompt_fits() -> None:
    backend, limits = MemoryLimits(), TenantLimits(prompt_tokens_per_min=6000)  # 100/s
    assert isinstance(await take(backend, limits, 5000, now=0.0), Lease)
    denied = await take(backend, limits, 3000, now=0.0)
    assert isinstance(denied, Denied) and denied.reason == "prompt_tokens_per_min"
    assert denied.retry_after_s == about(20.0)  # needs 2000 more at 100/s
    assert isinstance(await take(backend, limits, 1000, now=0.0), Lease)  # smaller fits


async def test_denied_takes_nothing_from_any_limit() -> None:
    backend = MemoryLimits()
    limits = TenantLimits(requests_per_min=2, prompt_tokens_per_min=100, max_concurrent=1)
    first = await take(backend, limits, 90, now=0.0)
    assert isinstance(first, Lease)
    # Denied by tokens: the request slot must not be spent.
    assert isinstance(await take(backend, limits, 50, now=0.0), Denied)
    # Denied by concurrency: neither bucket may be spent.
    concurrency = await take(backend, limits, 5, now=0.0)
    assert isinstance(concurrency, Denied) and concurrency.reason == "max_concurrent"
    await backend.release(first, None, now=0.0)
    # One request and 10 tokens are exactly what is left.
    assert isinstance(await take(backend, limits, 10, now=0.0), Lease)
    assert isinstance(await take(backend, limits, 0, now=0.0), Denied)


async def test_both_rates_exhausted_reports_the_longer_wait() -> None:
    backend = MemoryLimits()
    limits = TenantLimits(requests_per_min=1, prompt_tokens_per_min=60)  # 1/min, 1 token/s
    assert isinstance(await take(backend, limits, 60, now=0.0), Lease)
    denied = await take(backend, limits, 30, now=0.0)
    assert isinstance(denied, Denied)
    assert (denied.reason, denied.retry_after_s) == ("requests_per_min", about(60.0))
    denied = await take(backend, limits, 30, now=50.0)  # request back in 10 s, tokens in 0
    assert isinstance(denied, Denied) and denied.retry_after_s == about(10.0)


async def test_prompt_larger_than_the_minute_budget_can_never_be_admitted() -> None:
    backend, limits = MemoryLimits(), TenantLimits(prompt_tokens_per_min=1000)
    denied = await take(backend, limits, 1001, now=0.0)
    assert isinstance(denied, Denied) and denied.never
    assert denied.reason == "prompt_tokens_per_min" and math.isinf(denied.retry_after_s)
    assert "can never be admitted" in denied.message
    assert isinstance(await take(backend, limits, 1000, now=0.0), Lease)


async def test_release_refunds_an_over_estimate_and_charges_an_under_estimate() -> None:
    backend, limits = MemoryLimits(), TenantLimits(prompt_tokens_per_min=1000)
    over = await take(backend, limits, 1000, now=0.0)
    assert isinstance(over, Lease) and over.charged_prompt_tokens == 1000
    await backend.release(over, actual_prompt_tokens=100, now=0.0)  # 900 back
    assert isinstance(await take(backend, limits, 900, now=0.0), Lease)
    denied = await take(backend, limits, 1, now=0.0)
    assert isinstance(denied, Denied)
    assert denied.retry_after_s == about(0.06)  # 1 token at 1000/60 per s

    backend = MemoryLimits()
    under = await take(backend, limits, 100, now=0.0)
    assert isinstance(under, Lease)
    await backend.release(under, actual_prompt_tokens=1500, now=0.0)  # 1400 more: debt 500
    denied = await take(backend, limits, 0, now=0.0)
    assert isinstance(denied, Denied) and denied.retry_after_s == about(30.0)


async def test_a_second_release_changes_nothing() -> None:
    backend, limits = MemoryLimits(), TenantLimits(prompt_tokens_per_min=1000, max_concurrent=1)
    lease = await take(backend, limits, 1000, now=0.0)
    assert isinstance(lease, Lease)
    await backend.release(lease, actual_prompt_tokens=500, now=0.0)
    await backend.release(lease, actual_prompt_tokens=0, now=0.0)  # must not refund again
    assert isinstance(await take(backend, limits, 500, now=0.0), Lease)
    assert backend.in_flight("acme") == 1


async def test_concurrency_retry_after_is_the_median_recent_duration() -> None:
    backend, limits = MemoryLimits(), TenantLimits(max_concurrent=1)
    lease = await take(backend, limits, 0, now=0.0)
    assert isinstance(lease, Lease)
    denied = await take(backend, limits, 0, now=0.0)
    assert isinstance(denied, Denied) and denied.reason == "max_concurrent"
    assert denied.retry_after_s == 1.0  # no request has finished yet
    await backend.release(lease, None, now=2.0)
    now = 2.0
    for duration_s in (8.0, 3.0, 100.0):
        lease = await take(backend, limits, 0, now=now)
        assert isinstance(lease, Lease)
        now += duration_s
        await backend.release(lease, None, now=now)
    held = await take(backend, limits, 0, now=now)
    assert isinstance(held, Lease)
    denied = await take(backend, limits, 0, now=now)
    # Durations 2, 8, 3, 100: the median (5.5) ignores the one outlier.
    assert isinstance(denied, Denied) and denied.retry_after_s == about(5.5)


async def test_tenants_do_not_share_limits() -> None:
    backend, limits = MemoryLimits(), TenantLimits(requests_per_min=1)
    assert isinstance(await take(backend, limits, 0, 0.0, tenant="acme"), Lease)
    assert isinstance(await take(backend, limits, 0, 0.0, tenant="acme"), Denied)
    assert isinstance(await take(backend, limits, 0, 0.0, tenant="globex"), Lease)


async def test_lost_leases_expire_after_their_ttl() -> None:
    backend, limits = MemoryLimits(lease_ttl_s=60.0), TenantLimits(max_concurrent=1)
    assert isinstance(await take(backend, limits, 0, now=0.0), Lease)
    assert isinstance(await take(backend, limits, 0, now=59.0), Denied)
    assert isinstance(await take(backend, limits, 0, now=60.0), Lease)


async def test_a_limits_change_keeps_the_debt_and_grants_no_fresh_burst() -> None:
    backend = MemoryLimits()
    assert isinstance(await take(backend, TenantLimits(requests_per_min=10), 0, 0.0), Lease)
    for _ in range(9):
        await take(backend, TenantLimits(requests_per_min=10), 0, 0.0)
    raised = TenantLimits(requests_per_min=120)  # 2/s now, but the bucket stays empty
    denied = await take(backend, raised, 0, now=0.0)
    assert isinstance(denied, Denied) and denied.retry_after_s == about(0.5)
    assert isinstance(await take(backend, raised, 0, now=0.5), Lease)


@settings(max_examples=60, deadline=None)
@given(
    rpm=st.integers(min_value=1, max_value=120),
    steps_s=st.lists(st.floats(min_value=0.0, max_value=3.0), min_size=1, max_size=300),
)
async def test_admitted_never_exceeds_burst_plus_refill(rpm: int, steps_s: list[float]) -> None:
    backend, limits = MemoryLimits(), TenantLimits(requests_per_min=rpm)
    now, admitted = 0.0, 0
    for step_s in steps_s:
        now += step_s
        result = await take(backend, limits, 0, now)
        if isinstance(result, Lease):
            admitted += 1
            await backend.release(result, None, now)
        else:
            # Denied means the wait is real: nothing is admitted earlier than promised.
            assert result.retry_after_s > 0
            assert isinstance(await take(backend, limits, 0, now + result.retry_after_s), Lease)
            admitted += 1
            now += result.retry_after_s
        assert admitted <= rpm + rpm / 60.0 * now + 1e-6


async def test_denials_become_the_errors_a_client_can_act_on() -> None:
    backend = MemoryLimits()
    limits = TenantLimits(requests_per_min=60, prompt_tokens_per_min=600, max_concurrent=1)
    held = await take(backend, limits, 600, now=0.0)
    assert isinstance(held, Lease)

    rate = await take(backend, limits, 30, now=0.0)  # 30 tokens at 10/s: back in 3 s
    assert isinstance(rate, Denied)
    error = denied_error(rate)
    assert error.status == 429 and error.headers["Retry-After"] == "4"  # 3.00001 s, rounded up
    assert error.body()["error"]["type"] == "RateLimitError"
    assert error.body()["error"]["code"] == "rate_limit_exceeded"

    concurrency = await take(backend, limits, 0, now=0.0)
    assert isinstance(concurrency, Denied)
    error = denied_error(concurrency)
    assert (error.status, error.headers["Retry-After"]) == (429, "1")

    too_large = await take(backend, limits, 601, now=0.0)
    assert isinstance(too_large, Denied)
    never = denied_error(too_large)
    assert never.status == 400 and "Retry-After" not in never.headers

    down = denied_error(Denied("backend_unavailable", 2.5, "down"))
    assert (down.status, down.headers["Retry-After"]) == (503, "3")


def test_without_a_redis_url_the_backend_is_in_memory() -> None:
    assert isinstance(open_limits_backend(None), MemoryLimits)


# ------------------------------------------- issue 11, item 7: leases and Retry-After


async def test_concurrency_retry_after_does_not_promise_one_second_for_a_lease_held_long() -> None:
    """A lease that has outlived every request the tenant finished (a lost one, of a
    gateway that crashed or of an acquire whose answer never arrived) frees at its
    expiry at the latest; telling the client `Retry-After: 1` for ten minutes was a lie."""
    backend, limits = MemoryLimits(lease_ttl_s=660.0), TenantLimits(max_concurrent=1)
    assert isinstance(await take(backend, limits, 0, now=0.0), Lease)  # never released
    denied = await take(backend, limits, 0, now=300.0)
    assert isinstance(denied, Denied) and denied.reason == "max_concurrent"
    # Held 300 s with nothing known about its end: expected about as long again, and
    # never beyond its expiry at 660 s.
    assert denied.retry_after_s == about(300.0)
    late = await take(backend, limits, 0, now=500.0)
    assert isinstance(late, Denied) and late.retry_after_s == about(160.0)  # its expiry
    assert isinstance(await take(backend, limits, 0, now=660.0), Lease)


async def test_concurrency_retry_after_counts_what_a_young_lease_has_already_run() -> None:
    backend, limits = MemoryLimits(lease_ttl_s=660.0), TenantLimits(max_concurrent=1)
    for start in (0.0, 10.0, 20.0):  # three requests of 4 s each
        lease = await take(backend, limits, 0, now=start)
        assert isinstance(lease, Lease)
        await backend.release(lease, None, now=start + 4.0)
    assert isinstance(await take(backend, limits, 0, now=30.0), Lease)
    denied = await take(backend, limits, 0, now=31.0)
    assert isinstance(denied, Denied) and denied.retry_after_s == about(3.0)


async def test_an_acquire_is_idempotent_by_lease_id_and_can_be_cancelled() -> None:
    backend, limits = MemoryLimits(), TenantLimits(requests_per_min=10, max_concurrent=1)
    first = await backend.acquire("acme", limits, 0, 0.0, lease_id="lease-1")
    again = await backend.acquire("acme", limits, 0, 0.0, lease_id="lease-1")
    assert isinstance(first, Lease) and again == first  # the same grant, charged once
    assert backend.in_flight("acme") == 1
    await backend.cancel("acme", "lease-1", now=0.0)
    assert backend.in_flight("acme") == 0
    # Cancelled first, acquired after (the acquire's message was late): never granted.
    await backend.cancel("acme", "lease-2", now=0.0)
    late = await backend.acquire("acme", limits, 0, 0.0, lease_id="lease-2")
    assert isinstance(late, Denied) and backend.in_flight("acme") == 0
    # The cancelled grant gave its request back: the whole minute's 10 still fit.
    granted = 0
    for i in range(12):
        lease = await backend.acquire("acme", limits, 0, 0.0, lease_id=f"n{i}")
        if isinstance(lease, Lease):
            granted += 1
            await backend.release(lease, None, 0.0)
    assert granted == 10


# ------------------------------------- a fallback for a shared backend (limits_redis.py)


async def test_a_second_seed_continues_what_the_first_left_refilled_since() -> None:
    """A fallback seeded again soon after the first continues it: the level Redis showed
    may not hold what the other instances' fallbacks granted meanwhile."""
    share = TenantLimits(requests_per_min=60)  # 60, then 1 a second
    fallback = MemoryLimits()
    fallback.seed("acme", share, 10, None, now=0.0)
    granted = [await fallback.acquire("acme", share, 0, now=0.0) for _ in range(12)]
    assert sum(isinstance(g, Lease) for g in granted) == 10
    fallback.seed("acme", share, 50, None, now=5.0)  # 5 s later: 5 refilled, not 50
    again = [await fallback.acquire("acme", share, 0, now=5.0) for _ in range(8)]
    assert sum(isinstance(g, Lease) for g in again) == 5
    fallback.seed("acme", share, 50, None, now=125.0)  # long after: the seed decides
    later = [await fallback.acquire("acme", share, 0, now=125.0) for _ in range(60)]
    assert sum(isinstance(g, Lease) for g in later) == 50


async def test_take_rates_is_all_or_nothing_and_holds_no_lease() -> None:
    share = TenantLimits(requests_per_min=60, prompt_tokens_per_min=100, max_concurrent=1)
    fallback = MemoryLimits()
    assert fallback.take_rates("acme", share, 80, now=0.0) is None
    refused = fallback.take_rates("acme", share, 30, now=0.0)  # 20 tokens left
    assert isinstance(refused, Denied) and refused.reason == "prompt_tokens_per_min"
    assert fallback.in_flight("acme") == 0  # the concurrency is the shared backend's
    fallback.refund_rates("acme", 80, now=0.0)
    assert fallback.take_rates("acme", share, 100, now=0.0) is None  # refunded whole
