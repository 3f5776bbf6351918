"""The tenant layers of the admission stack: who is asking, what their tier allows, and
their rates and concurrency.

Each refusal is cheap and clear: 401 for a missing or unknown key, 400 naming the limit
and the count, 429 with a Retry-After computed from a bucket's refill, 503 when the
shared limits backend is down in fail-closed mode. The order in which these run, and
why, is written once in `stack.py`.

Must not: read the body before `authenticate` has passed, block on the fleet, or
decide limits itself (`policy.limits` decides; `state.limits` keeps the buckets).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from seawall import clock
from seawall.auth import KeyStore
from seawall.config import GatewayConfig, TenantConfig, TierConfig
from seawall.errors import ApiError
from seawall.gateway.context import RequestCtx
from seawall.metrics import Metrics
from seawall.policy.limits import Reject, TierLimits, check_request
from seawall.policy.pools import TierPools
from seawall.protocol.routes import ROUTES
from seawall.protocol.structured import check_constraints
from seawall.protocol.tokens import (
    EstimateCounter,
    HFTokenizerCounter,
    TokenCounter,
    count_request_async,
)
from seawall.state.limits import Denied, Lease, LimitsBackend, TenantLimits, denied_error

log = logging.getLogger("seawall.gateway")


@dataclass(frozen=True, slots=True)
class Policy:
    """Tenants, their keys and the tiers, as one value: a reload builds a new one and
    swaps it in with one assignment, and each request keeps the one it authenticated
    under (`RequestCtx.policy`), so no request sees a mix of two configurations."""

    tiers: Mapping[str, TierConfig]
    tenants: Mapping[str, TenantConfig]
    keys: KeyStore | None  # None: no tenants, the gateway is open
    limits: Mapping[str, TierLimits]
    pools: Mapping[str, TierPools]  # per tier: its pool order, overflow and failover
    body_bytes: Mapping[str, int | None]  # per tier: its JSON bodies' byte bound

    @classmethod
    def of(cls, config: GatewayConfig) -> Policy:
        """Raises ValueError for a key hash listed under two tenants."""
        tenants = config.tenants
        keys = (
            KeyStore.from_tenants({n: t.api_key_hashes for n, t in tenants.items()})
            if tenants
            else None
        )
        limits = {name: tier.limits() for name, tier in config.tiers.items()}
        pools = {name: tier.pools.policy() for name, tier in config.tiers.items()}
        body_bytes = {name: tier.prompt_bytes_limit() for name, tier in config.tiers.items()}
        return cls(config.tiers, tenants, keys, limits, pools, body_bytes)


class Tenancy:
    def __init__(
        self,
        config: GatewayConfig,
        backend: LimitsBackend,
        metrics: Metrics,
        max_model_len: Callable[[str], int | None],
    ) -> None:
        self.policy = Policy.of(config)
        self.admission = config.admission
        self.ratelimit = config.ratelimit
        self.backend = backend
        self.metrics = metrics
        self.max_model_len = max_model_len
        self.counters: dict[str, TokenCounter] = {
            model: HFTokenizerCounter(path) for model, path in self.admission.tokenizers.items()
        }
        self.estimate = EstimateCounter()
        self._orphans: set[asyncio.Future[None]] = set()
        metrics.ratelimit_instances.set_function(backend.sharers)

    def reload(self, config: GatewayConfig) -> None:
        """New tenants, keys and tiers for the requests that authenticate from now on;
        requests already past `authenticate` finish under the policy they started with.
        Raises ValueError (and keeps the old policy) for a key under two tenants."""
        self.policy = Policy.of(config)

    @property
    def tiers(self) -> Mapping[str, TierConfig]:
        return self.policy.tiers

    @property
    def tenants(self) -> Mapping[str, TenantConfig]:
        return self.policy.tenants

    @property
    def keys(self) -> KeyStore | None:
        return self.policy.keys

    # -- 1. who is asking (headers only) ------------------------------------------------

    def authenticate(self, headers: Mapping[str, str], ctx: RequestCtx) -> None:
        policy = ctx.policy = self.policy  # this request's, to its end
        if policy.keys is not None:
            who = policy.keys.authenticate_headers(headers)
            if isinstance(who, ApiError):
                raise who
            ctx.tenant = who
            ctx.tier = policy.tenants[who].tier
        tier = policy.tiers[ctx.tier]
        ctx.priority = tier.priority
        ctx.pools = policy.pools[ctx.tier]
        if tier.timeouts is not None:
            ctx.timeouts = tier.timeouts.apply(ctx.timeouts)

    # -- 2. what the tier allows --------------------------------------------------------

    def body_bound(self, ctx: RequestCtx) -> int | None:
        """The most bytes this caller's JSON body may have (None: only limits.max_body_bytes).
        Known from the key, before the body is read: a body over the tier's byte bound
        cannot hold a prompt the tier allows, so it is refused unread (issue 11, item 5).
        An upload's bytes are not prompt text: limits.max_body_bytes bounds those."""
        if ROUTES[ctx.route].body != "json":
            return None
        return _pinned(ctx).body_bytes[ctx.tier]

    async def tier_limits(self, ctx: RequestCtx) -> None:
        req = ctx.req
        assert req is not None
        spec = req.spec  # the route's rules: count, output bound, KV, migration
        policy = _pinned(ctx)
        tier = policy.tiers[ctx.tier]
        limits = policy.limits[ctx.tier]
        ctx.stream.migrate = ctx.stream.track_text = (
            tier.migrate and spec.migratable and req.stream and req.n == 1
        )
        # The body's bytes were bounded as it was read (`body_bound`); a schema's size
        # and depth are bounded before anything is counted.
        if req.constraints:
            too_big = check_constraints(
                req.constraints, tier.max_schema_nodes, tier.max_schema_depth
            )
            if too_big is not None:
                await self.refused(ctx)
                raise too_big
        # Count only when a limit needs the count; large bodies off the event loop.
        reserve = self.admission.reserves_kv and spec.reserves_kv
        needs_count = (
            reserve or limits.max_prompt_tokens is not None or limits.prompt_tokens_per_min
        )
        counter = self.counters.get(req.model, self.estimate)
        count = await count_request_async(req, counter) if needs_count else None
        requested = req.requested_max_tokens() if spec.generates else None
        if requested == 0:
            requested = 1  # completions' `echo` with `max_tokens: 0`: the engine runs one step
        # Limits, rates and reservations count every prompt of a batch (and reservations
        # every choice): a batch is as much work as its prompts sent one by one.
        decision = check_request(
            count.prompt_tokens if count else 0, requested, limits, spec.prompt_param
        )
        if isinstance(decision, Reject):
            await self.refused(ctx)
            raise ApiError(decision.status, decision.message, decision.param, decision.code)
        ctx.prompt_tokens = count.prompt_tokens if count else 0
        ctx.sequences = count.sequences if count else req.n  # uncounted: one prompt
        if not spec.generates:
            return  # no output to bound, no KV held past the forward pass
        if decision.max_tokens != requested:
            req.set(req.max_tokens_field(), decision.max_tokens)  # a default, or clamped
        if reserve and count is not None:
            # vLLM clamps prompt + max_tokens to max_model_len, so no sequence grows past it.
            ctx.reserve_tokens = count.kv_tokens(decision.max_tokens, self.max_model_len(req.model))

    async def refused(self, ctx: RequestCtx) -> None:
        """A request refused for its size still counts against the tenant's request rate:
        otherwise a flood of oversized requests costs its sender nothing (issue 11, item 5).
        Only the request rate is charged; nothing is held."""
        self.shed(ctx, "tier_limit")
        rpm = _pinned(ctx).limits[ctx.tier].requests_per_min
        if rpm is None:
            return
        now = clock.monotonic()
        got = await self.backend.acquire(ctx.tenant, TenantLimits(rpm, None, None), 0, now)
        if isinstance(got, Lease):
            await self.backend.release(got, None, now)

    # -- 3. rates and concurrency -------------------------------------------------------

    async def rates(self, ctx: RequestCtx) -> None:
        limits = _pinned(ctx).limits[ctx.tier]
        if not (limits.requests_per_min or limits.prompt_tokens_per_min or limits.max_concurrent):
            return
        req = ctx.req
        assert req is not None
        # Shielded: if the client leaves while a shared backend runs the acquire, the
        # acquire still completes and its lease is released, instead of leaking a slot.
        acquiring = asyncio.ensure_future(
            self.backend.acquire(
                ctx.tenant,
                TenantLimits(
                    limits.requests_per_min, limits.prompt_tokens_per_min, limits.max_concurrent
                ),
                ctx.prompt_tokens,
                clock.monotonic(),
            )
        )
        try:
            got = await asyncio.shield(acquiring)
        except asyncio.CancelledError:
            acquiring.add_done_callback(self._release_orphan)
            raise
        self.metrics.ratelimit_backend_degraded.set(1 if self.backend.degraded else 0)
        if isinstance(got, Denied):
            self.shed(ctx, got.reason)
            raise denied_error(got)
        ctx.lease = got
        ctx.reconcile = bool(limits.prompt_tokens_per_min)
        if (
            req.stream
            and limits.prompt_tokens_per_min
            and req.spec.stream_options
            and not req.include_usage
        ):
            # Reconciliation needs the engine's usage; ask for it and strip it again.
            opts = req.obj.get("stream_options")
            req.set(
                "stream_options",
                {**(opts if isinstance(opts, dict) else {}), "include_usage": True},
            )
            ctx.stream.strip_usage = True

    async def release(self, ctx: RequestCtx) -> None:
        """The request ended: free its concurrency slot and settle its token charge."""
        lease = ctx.lease
        if lease is None:
            return
        ctx.lease = None
        if ctx.attempts == 0:
            actual: int | None = 0  # the engine never saw it: refund the whole estimate
        elif ctx.usage and isinstance(ctx.usage.get("prompt_tokens"), int):
            actual = int(ctx.usage["prompt_tokens"])
        else:
            actual = None
        await self.backend.release(lease, actual, clock.monotonic())

    def _release_orphan(self, fut: asyncio.Future[Lease | Denied]) -> None:
        if not fut.cancelled() and isinstance(fut.result(), Lease):
            lease = fut.result()
            assert isinstance(lease, Lease)
            task = asyncio.ensure_future(self.backend.release(lease, 0, clock.monotonic()))
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)

    def shed(self, ctx: RequestCtx, reason: str) -> None:
        self.metrics.record_shed(ctx.tenant, ctx.tier, reason, clock.monotonic() - ctx.started)

    def tier(self, name: str) -> TierConfig:
        return self.policy.tiers[name]

    def summary(self) -> dict[str, object]:
        """For the admin API."""
        policy = self.policy
        return {
            "backend": self.ratelimit.backend,
            "fail_mode": self.ratelimit.fail_mode,
            "degraded": self.backend.degraded,
            "instances": self.backend.sharers(),  # a fail-open fallback holds 1/N
            "tenants": len(policy.tenants),
            "open": policy.keys is None,
            "admission": self.admission.enabled,
        }

    async def start(self) -> None:
        await self.backend.start()

    async def close(self) -> None:
        await self.backend.close()


def _pinned(ctx: RequestCtx) -> Policy:
    policy = ctx.policy
    assert isinstance(policy, Policy), "authenticate() runs first"
    return policy


def warn_if_open(config: GatewayConfig) -> None:
    """An open gateway (no tenants) on a non-loopback address serves anyone who can reach it."""
    if config.tenants:
        return
    host = config.listen.host
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        log.warning(
            "no tenants are configured, so the gateway runs open (no API keys) and listens "
            "on %s, beyond loopback: anyone who can reach it can use it. Add tenants with "
            "`seawall keys new --tenant NAME`.",
            host,
        )
