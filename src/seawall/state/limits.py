"""Per-tenant limits state: the interface the gateway calls on every request, and the
embedded in-memory backend.

Owns: the `LimitsBackend` seam (`acquire` before forwarding, `release` when the request
ends), the decision values (`Lease`, `Denied`), and `MemoryLimits`, the default backend,
which holds one requests-per-minute bucket, one prompt-tokens-per-minute bucket and one
set of in-flight leases per tenant, in this process only. `state/limits_redis.py` shares
them across gateway processes and must decide exactly as this module does (a test runs
the same operations through both).

Must not: read the clock (`now` is an argument), log per request, or do I/O. The bucket
arithmetic is `seawall.policy.token_bucket`; this module only composes buckets into an
all-or-nothing admission. `denied_error` turns a denial into the client's OpenAI-shaped
error so that every gateway layer reports limits the same way.

Shapes, for both backends:
- A per-minute limit L is a bucket of capacity L refilling at L/60 per second: a tenant
  may burst its whole minute at once, then continues at the steady rate.
- `acquire` is all-or-nothing: when it is denied, no bucket and no slot is touched.
- The prompt-token bucket is charged the up-front estimate; `release` charges or refunds
  the difference with the engine's real `usage.prompt_tokens`, so estimates never drift.
- Retry-After for a rate limit is exact: the time until this request's amount will have
  refilled. A concurrency slot has no refill to compute from, so its Retry-After is the
  soonest any held lease is expected to end (`concurrency_retry_after_s`): a lease
  younger than the tenant's median recent duration when it reaches that age, an older
  one (it has outlived what we know) after as long again as it has run, and none later
  than its expiry. Before, a slot held by a lost lease was advertised as freeing in 1 s
  for the ten minutes until it expired.
- `acquire` takes the caller's `lease_id` and is idempotent on it; `cancel` gives back
  an acquire whose answer the caller never got (a timeout, a client that left): a
  granted lease is freed and its charges refunded, and an acquire that arrives after its
  cancel is never granted. A shared backend can then recover every slot it may have
  granted behind the caller's back.
"""

from __future__ import annotations

import math
import statistics
import uuid
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from seawall.errors import ApiError, rate_limited, unavailable
from seawall.policy.token_bucket import TokenBucket

DenyReason = Literal[
    "requests_per_min", "prompt_tokens_per_min", "max_concurrent", "backend_unavailable"
]

# Retry-After for a full concurrency limit before any request of the tenant has finished.
DEFAULT_CONCURRENCY_RETRY_S = 1.0
# Added to every computed wait: coming back after exactly `retry_after_s` must succeed,
# and without a margin float rounding can leave the bucket a hair short of `amount`.
WAIT_MARGIN_S = 1e-5
# How many finished requests per tenant the concurrency Retry-After estimate looks at.
RECENT_DURATIONS = 64
# How many held leases (the longest held) the concurrency Retry-After looks at; bounds
# the Redis script's reply for tenants with a large concurrency limit.
RETRY_AFTER_LEASES = 256


def new_lease_id() -> str:
    """A lease id for `acquire`: the caller keeps it to cancel an unanswered acquire."""
    return "r" + uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's limits; None means unlimited."""

    requests_per_min: float | None = None
    prompt_tokens_per_min: float | None = None
    max_concurrent: int | None = None


@dataclass(frozen=True, slots=True)
class Lease:
    """Granted: hold it for the request's lifetime and pass it to `release` exactly once
    (a second release is ignored)."""

    tenant: str
    lease_id: str
    charged_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Denied:
    """Refused; nothing was taken. `retry_after_s` is `math.inf` when the request can never
    be admitted (a prompt larger than the tenant's whole per-minute token budget): that is
    a client error to report without a Retry-After, not a 429."""

    reason: DenyReason
    retry_after_s: float
    message: str

    @property
    def never(self) -> bool:
        return math.isinf(self.retry_after_s)


class LimitsBackend(Protocol):
    # True while a shared backend is unreachable and decisions are per-process or denied.
    degraded: bool

    async def acquire(
        self,
        tenant: str,
        limits: TenantLimits,
        prompt_tokens: int,
        now: float,
        lease_id: str | None = None,
    ) -> Lease | Denied:
        """All-or-nothing admission. With `lease_id` (from `new_lease_id`), repeating
        the call returns the same grant without charging again."""
        ...

    async def cancel(self, tenant: str, lease_id: str, now: float) -> None:
        """Undo an acquire whose answer never reached the caller: free its slot and
        refund its charges if it was granted, and never grant it if it arrives later."""
        ...

    async def release(self, lease: Lease, actual_prompt_tokens: int | None, now: float) -> None:
        """Free the lease's slot; with `actual_prompt_tokens` (the engine's usage), charge or
        refund the difference from the estimate. Pass 0 for a request the engine never
        saw, None when the real usage is unknown (the estimate then stands)."""
        ...

    def sharers(self) -> int:
        """Gateway instances sharing these limits, this one included."""
        ...

    async def start(self) -> None:
        """Begin any background work (called once the event loop runs)."""
        ...

    async def close(self) -> None: ...


def bucket_shape(per_min: float) -> tuple[float, float]:
    """(capacity, refill_per_s) of a per-minute limit."""
    return per_min, per_min / 60.0


def wait_s(level: float, amount: float, capacity: float, refill_per_s: float) -> float:
    """Seconds until `amount` is available in a bucket at `level`: 0.0 if it is now,
    `math.inf` if never. The same rule as `TokenBucket.try_take`, without taking, plus
    `WAIT_MARGIN_S`."""
    if amount > capacity:
        return math.inf
    if level >= amount:
        return 0.0
    if refill_per_s <= 0:
        return math.inf
    return (amount - level) / refill_per_s + WAIT_MARGIN_S


def denial(reason: DenyReason, retry_after_s: float, limits: TenantLimits, amount: int) -> Denied:
    """The `Denied` for a reason, with a message a client can act on."""
    if reason == "requests_per_min":
        message = f"Rate limit reached: {limits.requests_per_min:g} requests per minute."
    elif reason == "prompt_tokens_per_min":
        if math.isinf(retry_after_s):
            message = (
                f"This request has {amount} prompt tokens, more than the limit of "
                f"{limits.prompt_tokens_per_min:g} prompt tokens per minute; it can never "
                "be admitted. Shorten the prompt."
            )
        else:
            message = (
                f"Rate limit reached: {limits.prompt_tokens_per_min:g} prompt tokens per minute."
            )
    elif reason == "max_concurrent":
        message = f"Too many concurrent requests: the limit is {limits.max_concurrent}."
    else:
        message = "The rate-limit backend is unavailable; try again shortly."
    return Denied(reason, retry_after_s, message)


def rate_decision(requests_wait_s: float, tokens_wait_s: float) -> tuple[DenyReason, float] | None:
    """The binding rate limit, if any: both must be satisfied, so the longer wait decides
    (requests per minute on a tie)."""
    if requests_wait_s <= 0 and tokens_wait_s <= 0:
        return None
    if tokens_wait_s > requests_wait_s:
        return "prompt_tokens_per_min", tokens_wait_s
    return "requests_per_min", requests_wait_s


def denied_error(denied: Denied) -> ApiError:
    """The client's error for a denial: 429 with Retry-After for a limit, 503 with
    Retry-After while the shared backend is down (fail-closed), and a 400 without
    Retry-After for a prompt that can never fit (a 429 would make SDKs retry in vain)."""
    if denied.reason == "backend_unavailable":
        return unavailable(denied.message, denied.retry_after_s, code="limits_unavailable")
    if denied.never:
        return ApiError(400, denied.message, code="prompt_exceeds_token_rate_limit")
    if denied.reason == "max_concurrent":
        return rate_limited(denied.message, denied.retry_after_s, code="concurrency_limit_exceeded")
    # OpenAI's code for both of its per-minute limits.
    return rate_limited(denied.message, denied.retry_after_s, code="rate_limit_exceeded")


class RecentDurations:
    """The last few request durations of one tenant, for the concurrency Retry-After."""

    def __init__(self, size: int = RECENT_DURATIONS) -> None:
        self._durations_s: deque[float] = deque(maxlen=size)

    def add(self, duration_s: float) -> None:
        self._durations_s.append(max(0.0, duration_s))

    def typical_s(self) -> float | None:
        """The median recent duration; None before any request has finished."""
        return statistics.median(self._durations_s) if self._durations_s else None

    def retry_after_s(self) -> float:
        typical = self.typical_s()
        return DEFAULT_CONCURRENCY_RETRY_S if typical is None else typical


def concurrency_retry_after_s(
    held: Sequence[tuple[float, float]], typical_s: float | None, now: float
) -> float:
    """Seconds until a concurrency slot is expected to free, from the held leases'
    `(acquired_at, expires_at)` and the tenant's typical request duration (None if
    unknown). Pure; both backends call it with the same numbers.

    Per lease: younger than typical -> it ends when it reaches that age; otherwise it
    has outlived the estimate, and a request that has run `age` seconds is, with nothing
    better known, expected to run about as long again (at least 1 s), so repeated
    refusals back off geometrically instead of promising 1 s for ever; never later than
    its expiry, when even a lost lease frees. The slot frees at the soonest of these.
    """
    if not held:
        return DEFAULT_CONCURRENCY_RETRY_S
    soonest = math.inf
    for acquired_at, expires_at in held:
        age_s = max(0.0, now - acquired_at)
        if typical_s is not None and age_s < typical_s:
            expected_s = typical_s - age_s
        else:
            expected_s = max(age_s, DEFAULT_CONCURRENCY_RETRY_S)
        soonest = min(soonest, expected_s, max(0.0, expires_at - now))
    return soonest


def _resized(bucket: TokenBucket | None, per_min: float | None, now: float) -> TokenBucket | None:
    """The tenant's bucket after a limits change: keeps its level (clamped to the new
    capacity) so a config reload neither forgives debt nor grants a fresh burst. The Redis
    script applies the same rule to its stored level."""
    if per_min is None:
        return None
    capacity, refill_per_s = bucket_shape(per_min)
    if bucket is None:
        return TokenBucket.full(capacity, refill_per_s, now)
    bucket.capacity, bucket.refill_per_s = capacity, refill_per_s
    bucket.tokens = min(bucket.tokens, capacity)
    return bucket


@dataclass(slots=True)
class _TenantState:
    limits: TenantLimits
    requests: TokenBucket | None
    tokens: TokenBucket | None
    leases: dict[str, float] = field(default_factory=dict)  # lease id -> acquired at
    granted: dict[str, Lease] = field(default_factory=dict)  # lease id -> its grant
    cancelled: dict[str, float] = field(default_factory=dict)  # lease id -> cancelled at
    durations: RecentDurations = field(default_factory=RecentDurations)


def _rate_denial(
    state: _TenantState, limits: TenantLimits, prompt_tokens: int, now: float
) -> Denied | None:
    """The denial when the tenant's request or token bucket cannot take the request now."""
    requests, tokens = state.requests, state.tokens
    requests_wait = (
        0.0
        if requests is None
        else wait_s(requests.level(now), 1, requests.capacity, requests.refill_per_s)
    )
    tokens_wait = (
        0.0
        if tokens is None
        else wait_s(tokens.level(now), prompt_tokens, tokens.capacity, tokens.refill_per_s)
    )
    binding = rate_decision(requests_wait, tokens_wait)
    if binding is None:
        return None
    return denial(binding[0], binding[1], limits, prompt_tokens)


class MemoryLimits:
    """Per-process limits: exact within one gateway process, no coordination across them.

    The methods are `async` for the interface but never await, so each call is atomic on
    the event loop without a lock.
    """

    def __init__(self, lease_ttl_s: float | None = None) -> None:
        # A lease older than this no longer holds a slot: a safety net for a caller that
        # lost a lease; the gateway releases every lease it takes.
        self._lease_ttl_s = lease_ttl_s
        self._tenants: dict[str, _TenantState] = {}
        self.degraded = False

    def _state(self, tenant: str, limits: TenantLimits, now: float) -> _TenantState:
        state = self._tenants.get(tenant)
        if state is None:
            state = _TenantState(
                limits,
                _resized(None, limits.requests_per_min, now),
                _resized(None, limits.prompt_tokens_per_min, now),
            )
            self._tenants[tenant] = state
        elif state.limits != limits:
            state.requests = _resized(state.requests, limits.requests_per_min, now)
            state.tokens = _resized(state.tokens, limits.prompt_tokens_per_min, now)
            state.limits = limits
        return state

    def seed(
        self,
        tenant: str,
        limits: TenantLimits,
        requests_level: float | None,
        tokens_level: float | None,
        now: float,
    ) -> None:
        """Start the tenant's buckets at the given levels (None: full), under `limits`,
        but never above where its buckets already are (refilled since). A fallback for a
        shared backend starts where the shared buckets were, not full (`limits_redis.py`),
        and a second fallback soon after the first continues what the first left: the
        level the shared backend reported may not yet hold what the fallbacks granted.
        The tenant's leases and recent durations are kept."""
        known = tenant in self._tenants
        state = self._state(tenant, limits, now)
        for bucket, level in ((state.requests, requests_level), (state.tokens, tokens_level)):
            if bucket is not None:
                start = bucket.capacity if level is None else min(level, bucket.capacity)
                if known:
                    start = min(start, bucket.level(now))
                bucket.tokens = start
                bucket.updated_at = now

    def _expire_leases(self, state: _TenantState, now: float) -> None:
        if self._lease_ttl_s is None:
            return
        ttl_s = self._lease_ttl_s
        for lease_id in [k for k, at in state.leases.items() if at + ttl_s <= now]:
            del state.leases[lease_id]
            state.granted.pop(lease_id, None)

    def holds(self, lease: Lease) -> bool:
        """True if this backend granted `lease` and it has not been released."""
        state = self._tenants.get(lease.tenant)
        return state is not None and lease.lease_id in state.leases

    def in_flight(self, tenant: str) -> int:
        state = self._tenants.get(tenant)
        return 0 if state is None else len(state.leases)

    def _held(self, state: _TenantState) -> list[tuple[float, float]]:
        """(acquired_at, expires_at) of the longest-held leases, as the Redis script
        reads them (expiry = acquired + ttl, and back), so both compute alike."""
        ttl_s = self._lease_ttl_s
        oldest = sorted(state.leases.values())[:RETRY_AFTER_LEASES]
        if ttl_s is None:
            return [(at, math.inf) for at in oldest]
        return [((at + ttl_s) - ttl_s, at + ttl_s) for at in oldest]

    async def acquire(
        self,
        tenant: str,
        limits: TenantLimits,
        prompt_tokens: int,
        now: float,
        lease_id: str | None = None,
    ) -> Lease | Denied:
        if prompt_tokens < 0:
            raise ValueError("prompt_tokens must be >= 0")
        state = self._state(tenant, limits, now)
        if lease_id is not None:
            self._forget_cancelled(state, now)
            if lease_id in state.cancelled:
                return Denied("backend_unavailable", 0.0, "This request was cancelled.")
            earlier = state.granted.get(lease_id)
            if earlier is not None and lease_id in state.leases:
                return earlier  # a retried acquire: the same grant, charged once
        refused = _rate_denial(state, limits, prompt_tokens, now)
        if refused is not None:
            return refused
        requests, tokens = state.requests, state.tokens
        if limits.max_concurrent is not None:
            if len(state.leases) >= limits.max_concurrent:
                self._expire_leases(state, now)
            if len(state.leases) >= limits.max_concurrent:
                retry_after_s = concurrency_retry_after_s(
                    self._held(state), state.durations.typical_s(), now
                )
                return denial("max_concurrent", retry_after_s, limits, 0)
        # Every check passed at this same `now`, so these takes cannot fail.
        if requests is not None:
            requests.try_take(1, now)
        if tokens is not None:
            tokens.try_take(prompt_tokens, now)
        lease_id = lease_id or uuid.uuid4().hex
        state.leases[lease_id] = now
        lease = Lease(tenant, lease_id, prompt_tokens if tokens is not None else 0)
        state.granted[lease_id] = lease
        return lease

    def take_rates(
        self, tenant: str, limits: TenantLimits, prompt_tokens: int, now: float
    ) -> Denied | None:
        """Take one request and `prompt_tokens` from the tenant's rate buckets, both or
        neither, and hold no lease (a shared backend holds the concurrency): None when
        taken, else the denial."""
        state = self._state(tenant, limits, now)
        refused = _rate_denial(state, limits, prompt_tokens, now)
        if refused is not None:
            return refused
        if state.requests is not None:
            state.requests.try_take(1, now)
        if state.tokens is not None:
            state.tokens.try_take(prompt_tokens, now)
        return None

    def refund_rates(self, tenant: str, prompt_tokens: int, now: float) -> None:
        """Give back what `take_rates` took."""
        state = self._tenants.get(tenant)
        if state is None:
            return
        if state.requests is not None:
            state.requests.refund(1, now)
        if state.tokens is not None and prompt_tokens:
            state.tokens.refund(prompt_tokens, now)

    def _forget_cancelled(self, state: _TenantState, now: float) -> None:
        # A cancel only has to outlive the acquire it races; a lease's TTL is plenty.
        keep_s = self._lease_ttl_s if self._lease_ttl_s is not None else 3600.0
        for lease_id in [k for k, at in state.cancelled.items() if at + keep_s <= now]:
            del state.cancelled[lease_id]

    async def cancel(self, tenant: str, lease_id: str, now: float) -> None:
        state = self._tenants.get(tenant)
        if state is None:
            return
        self._forget_cancelled(state, now)
        state.cancelled[lease_id] = now
        lease = state.granted.pop(lease_id, None)
        if state.leases.pop(lease_id, None) is None or lease is None:
            return
        # Granted behind the caller's back: give back what it took.
        if state.requests is not None:
            state.requests.refund(1, now)
        if state.tokens is not None and lease.charged_prompt_tokens:
            state.tokens.refund(lease.charged_prompt_tokens, now)

    async def release(self, lease: Lease, actual_prompt_tokens: int | None, now: float) -> None:
        state = self._tenants.get(lease.tenant)
        if state is None:
            return
        state.granted.pop(lease.lease_id, None)
        acquired_at = state.leases.pop(lease.lease_id, None)
        if acquired_at is None:
            return  # released twice, or expired: never reconcile twice
        if self._lease_ttl_s is not None and acquired_at + self._lease_ttl_s <= now:
            return  # expired: its slot was already free, and the Redis backend agrees
        state.durations.add(now - acquired_at)
        if actual_prompt_tokens is None or state.tokens is None:
            return
        difference = actual_prompt_tokens - lease.charged_prompt_tokens
        if difference > 0:
            state.tokens.charge(difference, now)
        elif difference < 0:
            state.tokens.refund(-difference, now)

    def retry_after_for_concurrency(self, tenant: str) -> float:
        state = self._tenants.get(tenant)
        return DEFAULT_CONCURRENCY_RETRY_S if state is None else state.durations.retry_after_s()

    def sharers(self) -> int:
        return 1  # per process: nothing is shared

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        self._tenants.clear()
