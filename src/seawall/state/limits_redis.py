"""Per-tenant limits shared by every gateway process through Redis.

Owns: `RedisLimits`, a `LimitsBackend` whose whole acquire (both buckets and the
concurrency slot, all-or-nothing) is one Lua script and whose release (free the slot,
reconcile the token charge) is another: one round trip each, atomic on the server, so
gateway processes never race each other. Also owns what happens when Redis is
unreachable (`fail_mode`).

Must not: block a call longer than `socket_timeout_s` (twice that, after a stall of
this process's own loop: `StoreTimeout`), or log per request. It never
retries an acquire (the caller has already decided without it); the calls it does
repeat, cancels and releases, are idempotent on the lease id.

Decisions match `MemoryLimits` exactly: the scripts reimplement `policy.token_bucket`'s
arithmetic in Lua over doubles, operation for operation, and a test runs one sequence of
operations through both backends and compares every decision.

Time: the scripts read Redis's own clock (`TIME`), so gateway hosts with skewed clocks
share one timeline. (`clock="caller"` makes them use the caller's `now` instead: only for
tests that step time exactly.)

Concurrency: each tenant's in-flight leases are a sorted set of lease ids scored by
expiry (acquire time + `lease_ttl_s`). A gateway that crashes holding leases loses them
when they expire; set `lease_ttl_s` to the longest a request may take (the total request
timeout) plus a margin. Expired leases are never reconciled.

Hiccups (issue 11, item 7): when Redis pauses (a fork, swap, a paused VM), an acquire
already on the wire times out here, and the gateway decides without Redis; but Redis
runs the script when it resumes, and that lease held a slot for its whole TTL (after two
hiccups a tenant with a small concurrency limit was refused for ~655 s). So every acquire
carries a lease id, and one that failed is *cancelled*: the cancel script frees the lease
and refunds its charges if the acquire ran, and leaves a tombstone so that an acquire
arriving after its cancel is refused. A release that cannot reach Redis is kept too.
Both are delivered, in the background every `reconnect_interval_s` and before the next
acquire of the same tenant, until Redis takes them or the lease has expired anyway.

Unreachable Redis (refused, reset, timed out, or any other error from the client: one
escaping would be a 500). A call that fails is decided without Redis: `fail_mode="open"`
by a per-process fallback (`MemoryLimits`), `fail_mode="closed"` by a denial with
`backend_unavailable` (the gateway's 503 with Retry-After). One failure is not an
outage: only `failures_to_degrade` in a row set `degraded`, and then Redis is tried
again at most once per `reconnect_interval_s` (by the first request after the
interval); the transitions are logged once each, not per request.

The fallback must not multiply the limit (issue 15: with three gateways, a 0.3 s pause
once let 242-344% of the allowance through, each fallback starting as a fresh, full
bucket for 2 s). So it holds this instance's share of each limit (limit / N, N the live
gateway instances; `max_concurrent // N`, at least 1), and it starts from
the level Redis last reported for the tenant (every acquire's reply carries the
buckets' levels), refilled since, divided by N: the instances' fallbacks together
continue the shared bucket instead of each starting a new one. What a fallback grants
is owed to the shared buckets: once Redis answers, the debt is charged there (never
below empty: after a long outage the grants were paid by refills that Redis capped), so
that the allowance is not granted once by the fallbacks and again by Redis. Each
episode of fallback starts from the newest level seen, but never above what this
instance's fallback had left from an episode before, refilled since (the level seen
may not yet hold the other instances' debts). And for a while after an instance is back
(`reconnect_interval_s` and two timeouts: the others' debts arrive with their next
probes), a fail-open instance admits a request only if its share admits it as well as
Redis: the first instance back would otherwise grant again what the others' debts, not
yet delivered, are about to take (and a late debt is never charged below empty).

N comes from `instances` when a cluster counts the gateways (`cluster:`); without one the
instances count each other here, through Redis itself: each beats every `MEMBER_BEAT_S`
into one sorted set (`<key_prefix>instances`, scored by expiry on Redis's clock, an
instance gone after `MEMBER_TTL_S` without a beat, and at once when it closes), and
keeps the count the last beat returned. A lost beat leaves the count as it was, so an
outage is shared by the count from just before it; while degraded, a beat is one of the
probes (at most one per `reconnect_interval_s`), so an instance that takes no request
still comes back, and is counted. (Before, a gateway without a cluster counted itself
alone, and N fallbacks granted N times what was left.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from seawall import clock as seawall_clock
from seawall.state.limits import (
    RETRY_AFTER_LEASES,
    WAIT_MARGIN_S,
    Denied,
    Lease,
    MemoryLimits,
    RecentDurations,
    TenantLimits,
    bucket_shape,
    concurrency_retry_after_s,
    denial,
    new_lease_id,
)
from seawall.state.store_timeout import StoreTimeout, client_backstop_s

log = logging.getLogger(__name__)

# Shared by both scripts: the clock, and TokenBucket's arithmetic. Every expression mirrors
# `seawall.policy.token_bucket` in the same order, so that the doubles come out identical.
_LUA_COMMON = r"""
local function clock(override)
  if override ~= '' then return tonumber(override) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- A missing bucket is full: buckets expire only once they would have refilled.
local function load(key, capacity, now)
  local v = redis.call('HMGET', key, 'tokens', 'updated_at')
  if not v[1] then return capacity, now end
  -- Limits may have shrunk since the level was stored (MemoryLimits does the same).
  return math.min(tonumber(v[1]), capacity), tonumber(v[2])
end

local function refilled(tokens, updated_at, capacity, refill, now)
  local elapsed = math.max(0.0, now - updated_at)
  if tokens >= capacity then return tokens end
  return math.min(capacity, tokens + elapsed * refill)
end

local function store(key, tokens, updated_at, capacity, refill)
  redis.call('HSET', key, 'tokens', string.format('%.17g', tokens),
    'updated_at', string.format('%.17g', updated_at))
  if refill > 0 then
    -- Once full it is indistinguishable from a missing key; 60 s of margin for skew.
    local to_full_s = math.max(0, capacity - tokens) / refill
    redis.call('PEXPIRE', key, math.ceil((to_full_s + 60) * 1000))
  end
end
"""

# KEYS: requests bucket, tokens bucket, leases zset, cancelled-lease tombstones zset.
# ARGV: now override ('' = server TIME), requests capacity ('' = unlimited), requests
# refill/s, tokens capacity ('' = unlimited), tokens refill/s, prompt tokens,
# max concurrent ('' = unlimited), lease id, lease ttl s, limits.WAIT_MARGIN_S, how many
# held leases to report.
# Returns {1, requests level, tokens level} when granted ({1} if already granted under
# this lease id), {0, 'cancelled'} if the lease id was cancelled first, {0,
# 'max_concurrent', now, levels..., expiry...} with the held leases' expiries (soonest
# first) for the caller's Retry-After, else {0, reason, retry_after_s, levels...}. Numbers
# are strings ('%.17g'; '' for an unlimited bucket's level).
_ACQUIRE_LUA = (
    _LUA_COMMON
    + r"""
local now = clock(ARGV[1])
local amount = tonumber(ARGV[6])
local WAIT_MARGIN_S = tonumber(ARGV[10])

-- Idempotent on the lease id; and a cancel that overtook its acquire wins.
if redis.call('ZSCORE', KEYS[3], ARGV[8]) then return {1} end
if redis.call('ZSCORE', KEYS[4], ARGV[8]) then return {0, 'cancelled'} end

local function wait_s(level, need, capacity, refill)
  if need > capacity then return 1/0 end
  if level >= need then return 0.0 end
  if refill <= 0 then return 1/0 end
  return (need - level) / refill + WAIT_MARGIN_S
end

local buckets = {}
local waits = {0.0, 0.0}
local needs = {1, amount}
for i = 1, 2 do
  local cap_arg = ARGV[2 * i]
  if cap_arg ~= '' then
    local capacity, refill = tonumber(cap_arg), tonumber(ARGV[2 * i + 1])
    local tokens, updated_at = load(KEYS[i], capacity, now)
    local level = refilled(tokens, updated_at, capacity, refill, now)
    buckets[i] = {capacity, refill, level, math.max(updated_at, now)}
    waits[i] = wait_s(level, needs[i], capacity, refill)
  end
end

-- The buckets' levels (after this decision) ride on every reply: a fallback starts there.
local function level(i, taken)
  local b = buckets[i]
  if not b then return '' end
  return string.format('%.17g', b[3] - taken)
end

if waits[1] > 0 or waits[2] > 0 then
  if waits[2] > waits[1] then
    return {0, 'prompt_tokens_per_min', string.format('%.17g', waits[2]), level(1, 0), level(2, 0)}
  end
  return {0, 'requests_per_min', string.format('%.17g', waits[1]), level(1, 0), level(2, 0)}
end

local ttl_s = tonumber(ARGV[9])
-- Pruned even without a concurrency limit, so a crashed gateway's leases never pile up.
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
if ARGV[7] ~= '' then
  if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[7]) then
    local held = redis.call('ZRANGE', KEYS[3], 0, tonumber(ARGV[11]) - 1, 'WITHSCORES')
    local reply = {0, 'max_concurrent', string.format('%.17g', now), level(1, 0), level(2, 0)}
    for i = 2, #held, 2 do reply[#reply + 1] = held[i] end
    return reply
  end
end

for i = 1, 2 do
  local b = buckets[i]
  if b then store(KEYS[i], b[3] - needs[i], b[4], b[1], b[2]) end
end
-- Every lease is recorded, limited or not, so that a second release is recognised.
redis.call('ZADD', KEYS[3], now + ttl_s, ARGV[8])
redis.call('PEXPIRE', KEYS[3], math.ceil((ttl_s + 60) * 1000))
return {1, level(1, needs[1]), level(2, needs[2])}
"""
)

# KEYS: tokens bucket, leases zset.
# ARGV: now override, lease id, tokens to charge (> 0) or refund (< 0) ('' = none),
# tokens capacity, tokens refill/s.
# Returns 1 if the lease was held (and reconciled), 0 if it was unknown or had expired.
_RELEASE_LUA = (
    _LUA_COMMON
    + r"""
local now = clock(ARGV[1])
local expires_at = redis.call('ZSCORE', KEYS[2], ARGV[2])
if not expires_at then return 0 end
redis.call('ZREM', KEYS[2], ARGV[2])
-- Expired but not yet pruned: the same as pruned (MemoryLimits agrees).
if tonumber(expires_at) <= now then return 0 end
if ARGV[3] == '' or ARGV[4] == '' then return 1 end
local difference = tonumber(ARGV[3])
local capacity, refill = tonumber(ARGV[4]), tonumber(ARGV[5])
local tokens, updated_at = load(KEYS[1], capacity, now)
tokens = refilled(tokens, updated_at, capacity, refill, now)
updated_at = math.max(updated_at, now)
if difference > 0 then
  tokens = tokens - difference
else
  tokens = math.min(capacity, tokens + (-difference))
end
store(KEYS[1], tokens, updated_at, capacity, refill)
return 1
"""
)


# KEYS: requests bucket, tokens bucket, leases zset, cancelled-lease tombstones zset.
# ARGV: now override, lease id, requests capacity ('' = unlimited), requests refill/s,
# tokens capacity ('' = unlimited), tokens refill/s, tokens to refund, tombstone ttl s.
# Returns 1 if the acquire had been granted (now freed and refunded), else 0.
_CANCEL_LUA = (
    _LUA_COMMON
    + r"""
local now = clock(ARGV[1])
local ttl_s = tonumber(ARGV[8])
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
redis.call('ZADD', KEYS[4], now + ttl_s, ARGV[2])
redis.call('PEXPIRE', KEYS[4], math.ceil((ttl_s + 60) * 1000))
if not redis.call('ZSCORE', KEYS[3], ARGV[2]) then return 0 end
redis.call('ZREM', KEYS[3], ARGV[2])
local refunds = {1, tonumber(ARGV[7])}
for i = 1, 2 do
  local cap_arg = ARGV[2 * i + 1]
  if cap_arg ~= '' and refunds[i] > 0 then
    local capacity, refill = tonumber(cap_arg), tonumber(ARGV[2 * i + 2])
    local tokens, updated_at = load(KEYS[i], capacity, now)
    tokens = refilled(tokens, updated_at, capacity, refill, now)
    store(KEYS[i], math.min(capacity, tokens + refunds[i]), math.max(updated_at, now),
      capacity, refill)
  end
end
return 1
"""
)


# KEYS: requests bucket, tokens bucket.
# ARGV: now override, requests capacity ('' = unlimited), requests refill/s, tokens
# capacity ('' = unlimited), tokens refill/s, requests to charge, tokens to charge.
# What a fail-open fallback granted, owed to the shared buckets: charged, but never below
# empty (nor lower than a debt already there).
_CHARGE_LUA = (
    _LUA_COMMON
    + r"""
local now = clock(ARGV[1])
for i = 1, 2 do
  local cap_arg = ARGV[2 * i]
  local amount = tonumber(ARGV[5 + i])
  if cap_arg ~= '' and amount > 0 then
    local capacity, refill = tonumber(cap_arg), tonumber(ARGV[2 * i + 1])
    local tokens, updated_at = load(KEYS[i], capacity, now)
    tokens = refilled(tokens, updated_at, capacity, refill, now)
    local floor = math.min(tokens, 0)
    store(KEYS[i], math.max(tokens - amount, floor), math.max(updated_at, now), capacity,
      refill)
  end
end
return 1
"""
)


# KEYS: the instances' sorted set. ARGV: this instance's id, the member TTL in ms.
# Scored by expiry on Redis's clock; the expired are dropped; returns the live count.
_MEMBER_LUA = r"""
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], ttl)
return redis.call('ZCARD', KEYS[1])
"""

MEMBER_BEAT_S = 1.0  # how often an instance without a cluster says it is alive
MEMBER_TTL_S = 3.0  # ... and how long after its last beat it still counts


@dataclass(slots=True)
class _Undelivered:
    """A cancel, a release or a fallback's debt that has not reached Redis yet."""

    kind: Literal["cancel", "release", "charge"]
    tenant: str
    lease_id: str
    limits: TenantLimits
    prompt_tokens: int  # cancel: the charge to refund if the acquire ran
    actual_prompt_tokens: int | None  # release: the engine's usage
    charged_prompt_tokens: int  # release: what the acquire charged
    duration_s: float  # release: for the concurrency Retry-After, once delivered
    give_up_at: float  # monotonic: the lease has expired by then, so the call is moot
    charge_requests: float = 0.0  # charge: what the fallback granted
    charge_tokens: float = 0.0


def _num(value: float | None) -> str:
    # repr() is the shortest string that parses back to the same double, in Lua too.
    return "" if value is None else repr(float(value))


def _hash_tag(tenant: str) -> str:
    # All of a tenant's keys share one `{...}` hash tag so a Redis Cluster puts them in one
    # slot, as a multi-key script requires; braces in the name would end the tag early.
    return tenant.replace("%", "%25").replace("{", "%7B").replace("}", "%7D")


class RedisLimits:
    """Limits shared through one Redis; falls back or denies when Redis is unreachable."""

    def __init__(
        self,
        url: str,
        fail_mode: Literal["open", "closed"] = "open",
        key_prefix: str = "seawall:limits:",
        *,
        lease_ttl_s: float = 660.0,
        socket_timeout_s: float = 0.1,
        reconnect_interval_s: float = 2.0,
        clock: Literal["server", "caller"] = "server",
        instances: Callable[[], int] | None = None,
        failures_to_degrade: int = 3,
    ) -> None:
        if fail_mode not in ("open", "closed"):
            raise ValueError(f"fail_mode must be 'open' or 'closed', not {fail_mode!r}")
        self.fail_mode = fail_mode
        # Gateway instances sharing the limits: the cluster's count, or (None) counted
        # here through Redis (the module docstring).
        self.instances = instances
        self._members = 1  # the count the last beat returned (this instance included)
        self._member_id = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(4)}"
        self._members_key = f"{key_prefix}instances"
        self._beater: asyncio.Task[None] | None = None
        self.key_prefix = key_prefix
        self.lease_ttl_s = lease_ttl_s
        self.reconnect_interval_s = reconnect_interval_s
        self._caller_clock = clock == "caller"
        self.socket_timeout_s = socket_timeout_s
        self._redis = aioredis.Redis.from_url(
            url,
            # Each call, connecting included, is bounded by a `StoreTimeout` instead: a
            # stall of this process's loop is not Redis being slow. The client's own
            # connect timeout is only a backstop, longer.
            socket_timeout=None,
            socket_connect_timeout=client_backstop_s(socket_timeout_s),
            # No retries: a script whose reply was lost may have run, and running an
            # acquire twice would charge twice. The caller falls back instead.
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
            decode_responses=True,
        )
        # redis-py loads a script with SCRIPT LOAD on the first NOSCRIPT reply (after a
        # Redis restart) and retries the EVALSHA once; otherwise one round trip per call.
        self._acquire_script = self._redis.register_script(_ACQUIRE_LUA)
        self._release_script = self._redis.register_script(_RELEASE_LUA)
        self._cancel_script = self._redis.register_script(_CANCEL_LUA)
        self._charge_script = self._redis.register_script(_CHARGE_LUA)
        self._member_script = self._redis.register_script(_MEMBER_LUA)
        # Cancels and releases not yet delivered (see the module docstring), by lease id.
        self._undelivered: dict[str, _Undelivered] = {}
        self._flusher: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._last_now = 0.0  # the newest caller `now`, for deliveries in caller-clock mode
        self._asked: dict[str, int] = {}  # lease id -> prompt tokens, until released
        self.fallback = MemoryLimits(lease_ttl_s=lease_ttl_s)
        self.degraded = False
        self.failures_to_degrade = max(1, failures_to_degrade)
        self._streak = 0  # failed calls in a row
        # Per tenant: the buckets' levels in Redis's last reply, and the caller's `now` then.
        self._seen: dict[str, tuple[float | None, float | None, float]] = {}
        self._seeded: set[str] = set()  # tenants whose fallback this episode has started
        # Until then (the caller's clock), just back from an outage: see `acquire`.
        self._settle_until = float("-inf")
        self._next_attempt_at = 0.0  # while degraded: when Redis may be tried again
        # Last limits seen per tenant: release needs the token bucket's shape.
        self._limits: dict[str, TenantLimits] = {}
        # Per-process view for the concurrency Retry-After (see limits.py).
        self._acquired_at: dict[str, float] = {}
        self._durations: dict[str, RecentDurations] = {}

    def keys(self, tenant: str) -> tuple[str, str, str]:
        """(requests bucket, prompt-tokens bucket, leases) keys of a tenant."""
        base = f"{self.key_prefix}{{{_hash_tag(tenant)}}}"
        return f"{base}:requests", f"{base}:prompt_tokens", f"{base}:leases"

    def sharers(self) -> int:
        """Gateway instances sharing the limits, this one included (a fail-open
        fallback holds 1/N of each limit)."""
        if self.instances is not None:
            return max(1, int(self.instances()))
        return self._members

    async def start(self) -> None:
        """Without a cluster's count, start counting the instances through Redis (its
        first beat at once; a Redis that is down is not waited for)."""
        if self.instances is None and self._beater is None:
            self._beater = asyncio.get_running_loop().create_task(self._beat_loop())

    async def _beat_loop(self) -> None:
        ttl_ms = str(int(MEMBER_TTL_S * 1000))
        while True:
            # While degraded a beat is Redis's one probe per interval, like a request's,
            # so an instance that takes no request still comes back (and is counted).
            now = self._now()
            if self._use_redis(now):
                try:
                    async with StoreTimeout(self.socket_timeout_s):
                        n = await self._member_script(
                            keys=[self._members_key], args=[self._member_id, ttl_ms]
                        )
                except Exception:  # a lost beat: the count stands; outages are the requests' to say
                    pass
                else:
                    self._members = max(1, int(n))
                    if self.degraded:
                        self._came_back(now)
            await asyncio.sleep(MEMBER_BEAT_S)

    def _script_keys(self, tenant: str) -> list[str]:
        """The three above and the tombstones of cancelled lease ids (one hash slot)."""
        requests, tokens, leases = self.keys(tenant)
        return [requests, tokens, leases, leases.removesuffix(":leases") + ":cancelled"]

    @property
    def undelivered(self) -> int:
        """Cancels and releases waiting for Redis to come back."""
        return len(self._undelivered)

    def _use_redis(self, now: float) -> bool:
        if not self.degraded:
            return True
        if now < self._next_attempt_at:
            return False
        # This request probes; the others keep the fallback until it has answered.
        self._next_attempt_at = now + self.reconnect_interval_s
        return True

    async def _failed(self, now: float, error: BaseException) -> None:
        """A call to Redis failed: decided without it; a streak of them is an outage."""
        self._streak += 1
        if self.degraded or self._streak >= self.failures_to_degrade:
            await self._went_down(now, error)

    async def _went_down(self, now: float, error: BaseException) -> None:
        self._next_attempt_at = now + self.reconnect_interval_s
        if self.degraded:
            return
        self.degraded = True
        action = (
            "per-process limits until it recovers"
            if self.fail_mode == "open"
            else "denying requests until it recovers"
        )
        log.warning("limits backend unreachable (%s: %s); %s", type(error).__name__, error, action)
        # Drop every pooled connection: after a Redis restart they are all dead, and the
        # next probe must open a fresh one rather than fail on a stale one.
        # Bounded as a call is: closing waits for unsent bytes, which an unreachable
        # Redis never takes.
        with contextlib.suppress(Exception):  # the pool is being dropped: nothing to keep
            async with StoreTimeout(self.socket_timeout_s):
                await self._redis.connection_pool.disconnect()

    def _now(self) -> float:
        """Now, for a call no request made: the caller's clock, or the monotonic one."""
        return self._last_now if self._caller_clock else seawall_clock.monotonic()

    def _came_back(self, now: float) -> None:
        self._streak = 0
        if self.degraded:
            self.degraded = False
            if self.fail_mode == "open":
                # The other instances' debts reach Redis with their next probe (at most an
                # interval away) and its round trip: until then this one's share holds too.
                self._settle_until = now + self.reconnect_interval_s + 2 * self.socket_timeout_s
            log.info("limits backend reachable again; shared limits restored")
        elif now >= self._settle_until:
            self._seeded.clear()  # a later fallback starts again from the newest levels
        if self._undelivered:
            self._wake.set()

    async def _unavailable(
        self,
        tenant: str,
        limits: TenantLimits,
        prompt_tokens: int,
        now: float,
        lease_id: str | None = None,
    ) -> Lease | Denied:
        if self.fail_mode == "closed":
            retry_after_s = max(1.0, self._next_attempt_at - now)
            return denial("backend_unavailable", retry_after_s, limits, prompt_tokens)
        share = self._share_of(tenant, limits, now)
        result = self._not_never(
            await self.fallback.acquire(tenant, share, prompt_tokens, now, lease_id),
            limits,
            prompt_tokens,
        )
        if isinstance(result, Lease):
            self._owe(tenant, limits, prompt_tokens if limits.prompt_tokens_per_min else 0)
        return result

    def _share_of(self, tenant: str, limits: TenantLimits, now: float) -> TenantLimits:
        """This instance's share of the tenant's limits, its fallback buckets seeded at
        the first use in an episode (see the module docstring)."""
        n = self.sharers()
        share = _share(limits, n)
        if tenant not in self._seeded:
            self._seeded.add(tenant)
            self.fallback.seed(tenant, share, *self._start_levels(tenant, limits, n, now), now)
        return share

    def _not_never(
        self, result: Lease | Denied, limits: TenantLimits, prompt_tokens: int
    ) -> Lease | Denied:
        if isinstance(result, Denied) and result.never:
            # Over this instance's share of the token budget, not over the tenant's: not
            # a client error, only a wait until Redis decides again.
            return denial("prompt_tokens_per_min", self.reconnect_interval_s, limits, prompt_tokens)
        return result

    def _start_levels(
        self, tenant: str, limits: TenantLimits, n: int, now: float
    ) -> tuple[float | None, float | None]:
        """Where this instance's fallback buckets start: its share of the levels Redis
        last reported, refilled since (None, full, when none was seen)."""
        seen = self._seen.get(tenant)
        if seen is None:
            return None, None
        req_level, tok_level, at = seen
        elapsed = max(0.0, now - at)
        out: list[float | None] = []
        for per_min, level in (
            (limits.requests_per_min, req_level),
            (limits.prompt_tokens_per_min, tok_level),
        ):
            if per_min is None or level is None:
                out.append(None)
                continue
            capacity, refill = bucket_shape(per_min)
            out.append(min(capacity, level + refill * elapsed) / n)
        return out[0], out[1]

    def _owe(self, tenant: str, limits: TenantLimits, tokens: int) -> None:
        """A fallback grant, charged to the shared buckets once Redis answers."""
        key = f"charge\0{tenant}"
        u = self._undelivered.get(key)
        if u is None:
            u = _Undelivered(
                "charge",
                tenant,
                key,
                limits,
                0,
                None,
                0,
                0.0,
                # A bucket refills in a minute: an older debt no longer changes it.
                seawall_clock.monotonic() + 60.0,
            )
        u.limits = limits
        u.charge_requests += 1 if limits.requests_per_min is not None else 0
        u.charge_tokens += tokens
        self._keep(u)

    def _buckets(
        self, limits: TenantLimits
    ) -> tuple[float | None, float | None, float | None, float | None]:
        requests_capacity = requests_refill = tokens_capacity = tokens_refill = None
        if limits.requests_per_min is not None:
            requests_capacity, requests_refill = bucket_shape(limits.requests_per_min)
        if limits.prompt_tokens_per_min is not None:
            tokens_capacity, tokens_refill = bucket_shape(limits.prompt_tokens_per_min)
        return requests_capacity, requests_refill, tokens_capacity, tokens_refill

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
        self._limits[tenant] = limits
        self._last_now = max(self._last_now, now)
        lease_id = lease_id or new_lease_id()
        self._asked[lease_id] = prompt_tokens
        if not self._use_redis(now):
            return await self._unavailable(tenant, limits, prompt_tokens, now, lease_id)
        # This tenant's undelivered cancels first, so that a slot taken behind our back
        # during a hiccup is free before this request is judged against it.
        mine = any(u.tenant == tenant for u in self._undelivered.values())
        if mine and not await self._deliver(tenant):
            return await self._unavailable(tenant, limits, prompt_tokens, now, lease_id)
        # Just after an outage the other instances' debts may not have reached Redis yet,
        # and its level would grant them again: this instance's share decides as well.
        settling = now < self._settle_until
        if settling:
            share = self._share_of(tenant, limits, now)
            refused = self.fallback.take_rates(tenant, share, prompt_tokens, now)
            if refused is not None:
                self._asked.pop(lease_id, None)
                return self._not_never(refused, limits, prompt_tokens)
        requests_capacity, requests_refill, tokens_capacity, tokens_refill = self._buckets(limits)
        args = [
            _num(now) if self._caller_clock else "",
            _num(requests_capacity),
            _num(requests_refill),
            _num(tokens_capacity),
            _num(tokens_refill),
            str(prompt_tokens),
            "" if limits.max_concurrent is None else str(limits.max_concurrent),
            lease_id,
            _num(self.lease_ttl_s),
            _num(WAIT_MARGIN_S),
            str(RETRY_AFTER_LEASES),
        ]
        try:
            async with StoreTimeout(self.socket_timeout_s):
                reply: Any = await self._acquire_script(keys=self._script_keys(tenant), args=args)
            granted = int(reply[0]) == 1
        except Exception as error:  # any failure of the store (see above)
            # The script may have reached Redis and run, or may run when Redis resumes:
            # the caller decides without it, so it must be undone.
            self._asked.pop(lease_id, None)
            self._keep(
                _Undelivered(
                    "cancel",
                    tenant,
                    lease_id,
                    limits,
                    prompt_tokens,
                    None,
                    0,
                    0.0,
                    seawall_clock.monotonic() + self.lease_ttl_s,
                )
            )
            await self._failed(now, error)
            if settling:
                self.fallback.refund_rates(tenant, prompt_tokens, now)
            return await self._unavailable(tenant, limits, prompt_tokens, now, lease_id)
        self._came_back(now)
        if not granted:
            self._asked.pop(lease_id, None)
            if settling:
                self.fallback.refund_rates(tenant, prompt_tokens, now)
        if granted:
            self._acquired_at.setdefault(lease_id, now)
            self._saw(tenant, reply, 1, now)
            charged = prompt_tokens if limits.prompt_tokens_per_min is not None else 0
            return Lease(tenant, lease_id, charged)
        reason = str(reply[1])
        if reason == "cancelled":
            return Denied("backend_unavailable", 0.0, "This request was cancelled.")
        if reason == "max_concurrent":
            self._saw(tenant, reply, 3, now)
            redis_now = float(reply[2])
            ttl_s = self.lease_ttl_s
            held = [(float(e) - ttl_s, float(e)) for e in reply[5:]]
            durations = self._durations.get(tenant)
            typical_s = durations.typical_s() if durations else None
            retry_after_s = concurrency_retry_after_s(held, typical_s, redis_now)
            return denial("max_concurrent", retry_after_s, limits, prompt_tokens)
        self._saw(tenant, reply, 3, now)
        if reason == "prompt_tokens_per_min":
            return denial("prompt_tokens_per_min", float(reply[2]), limits, prompt_tokens)
        return denial("requests_per_min", float(reply[2]), limits, prompt_tokens)

    def _saw(self, tenant: str, reply: Any, at: int, now: float) -> None:
        """Keep the buckets' levels a reply carries at `reply[at]`, `reply[at + 1]`."""
        if len(reply) < at + 2:
            return  # a repeated acquire's reply carries none
        levels: list[float | None] = []
        for item in (reply[at], reply[at + 1]):
            try:
                levels.append(float(item) if item != "" else None)
            except (TypeError, ValueError):
                levels.append(None)
        self._seen[tenant] = (levels[0], levels[1], now)

    async def cancel(self, tenant: str, lease_id: str, now: float) -> None:
        self._last_now = max(self._last_now, now)
        self._acquired_at.pop(lease_id, None)
        await self.fallback.cancel(tenant, lease_id, now)
        limits = self._limits.get(tenant, TenantLimits())
        charge = self._asked.pop(lease_id, 0)
        self._keep(
            _Undelivered(
                "cancel",
                tenant,
                lease_id,
                limits,
                charge,
                None,
                0,
                0.0,
                seawall_clock.monotonic() + self.lease_ttl_s,
            )
        )
        if not self.degraded:
            await self._deliver(tenant)

    async def release(self, lease: Lease, actual_prompt_tokens: int | None, now: float) -> None:
        self._last_now = max(self._last_now, now)
        self._asked.pop(lease.lease_id, None)
        if self.fallback.holds(lease):
            await self.fallback.release(lease, actual_prompt_tokens, now)
            return
        acquired_at = self._acquired_at.pop(lease.lease_id, None)
        if acquired_at is None:
            return  # released twice
        undelivered = _Undelivered(
            "release",
            lease.tenant,
            lease.lease_id,
            self._limits.get(lease.tenant, TenantLimits()),
            0,
            actual_prompt_tokens,
            lease.charged_prompt_tokens,
            now - acquired_at,
            seawall_clock.monotonic() + self.lease_ttl_s,
        )
        if self.degraded:
            # Kept and delivered once Redis answers again: dropped, the lease would
            # hold its slot for its whole TTL.
            self._keep(undelivered)
            return
        try:
            await self._send(undelivered, now)
        except Exception as error:  # any failure of the store
            self._keep(undelivered)
            await self._failed(now, error)
            return
        self._came_back(now)

    # -- cancels and releases Redis has not taken yet ----------------------------------

    async def _send(self, u: _Undelivered, now: float) -> None:
        """Run one cancel, release or charge script (raises what redis-py raises, or
        TimeoutError)."""
        async with StoreTimeout(self.socket_timeout_s):
            await self._send_unbounded(u, now)

    async def _send_unbounded(self, u: _Undelivered, now: float) -> None:
        requests_capacity, requests_refill, tokens_capacity, tokens_refill = self._buckets(u.limits)
        now_arg = _num(now) if self._caller_clock else ""
        keys = self._script_keys(u.tenant)
        if u.kind == "charge":
            await self._charge_script(
                keys=[keys[0], keys[1]],
                args=[
                    now_arg,
                    _num(requests_capacity),
                    _num(requests_refill),
                    _num(tokens_capacity),
                    _num(tokens_refill),
                    _num(u.charge_requests),
                    _num(u.charge_tokens),
                ],
            )
            return
        if u.kind == "cancel":
            await self._cancel_script(
                keys=keys,
                args=[
                    now_arg,
                    u.lease_id,
                    _num(requests_capacity),
                    _num(requests_refill),
                    _num(tokens_capacity),
                    _num(tokens_refill),
                    str(u.prompt_tokens if tokens_capacity is not None else 0),
                    _num(self.lease_ttl_s),
                ],
            )
            return
        difference: int | None = None
        if u.actual_prompt_tokens is not None and tokens_capacity is not None:
            difference = u.actual_prompt_tokens - u.charged_prompt_tokens
        held: Any = await self._release_script(
            keys=[keys[1], keys[2]],
            args=[
                now_arg,
                u.lease_id,
                "" if not difference else str(difference),
                _num(tokens_capacity),
                _num(tokens_refill),
            ],
        )
        if int(held) == 1:  # finished within its lease (as MemoryLimits counts them)
            self._durations.setdefault(u.tenant, RecentDurations()).add(u.duration_s)

    def _keep(self, u: _Undelivered) -> None:
        self._undelivered[u.lease_id] = u
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.get_running_loop().create_task(self._deliver_loop())

    async def _deliver(self, tenant: str | None = None) -> bool:
        """Deliver what is kept (only `tenant`'s, if given); False if Redis failed.
        Redis is taken to be back only when one of them reached it: kept calls that
        expired meanwhile are dropped without a word to it, and prove nothing."""
        mono = seawall_clock.monotonic()
        answered = False
        for lease_id, u in list(self._undelivered.items()):
            if tenant is not None and u.tenant != tenant:
                continue
            if u.give_up_at <= mono:
                del self._undelivered[lease_id]  # the lease has expired in Redis anyway
                continue
            if u.kind == "charge":
                # Taken out while on the wire: a debt incurred meanwhile starts a new one.
                self._undelivered.pop(lease_id, None)
            try:
                await self._send(u, self._last_now)
            except Exception as error:  # any failure of the store
                if u.kind == "charge":
                    self._owe_again(u)
                await self._failed(self._last_now, error)
                return False
            answered = True
            if u.kind != "charge":
                self._undelivered.pop(lease_id, None)
        if answered:
            self._came_back(self._now())
        return True

    def _owe_again(self, u: _Undelivered) -> None:
        """A debt that could not be delivered, merged with any incurred since."""
        newer = self._undelivered.get(u.lease_id)
        if newer is not None:
            newer.charge_requests += u.charge_requests
            newer.charge_tokens += u.charge_tokens
        else:
            self._keep(u)

    async def _deliver_loop(self) -> None:
        """Every `reconnect_interval_s` (or at once when Redis is seen again), until
        nothing is kept. Bounded: each kept call is dropped when its lease would have
        expired."""
        while self._undelivered:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.reconnect_interval_s)
            self._wake.clear()
            # While degraded this is Redis's one probe per interval, like a request's.
            now = self._now()
            if self._use_redis(now):
                await self._deliver()

    async def close(self) -> None:
        if self._undelivered and not self.degraded:
            await self._deliver()  # last chance; the rest expire by their TTL
        for task in (self._flusher, self._beater):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._beater is not None and not self.degraded:
            # Leave the count at once rather than after MEMBER_TTL_S.
            with contextlib.suppress(Exception):
                async with StoreTimeout(self.socket_timeout_s):
                    await self._redis.zrem(self._members_key, self._member_id)
        await self._redis.aclose()
        await self.fallback.close()


def _share(limits: TenantLimits, n: int) -> TenantLimits:
    """One of `n` instances' share of a tenant's limits (for a fail-open fallback)."""
    if n <= 1:
        return limits
    return TenantLimits(
        None if limits.requests_per_min is None else limits.requests_per_min / n,
        None if limits.prompt_tokens_per_min is None else limits.prompt_tokens_per_min / n,
        None if limits.max_concurrent is None else max(1, limits.max_concurrent // n),
    )
