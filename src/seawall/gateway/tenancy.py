"""The admission layers: auth, tier limits, tenant rates and concurrency, fleet saturation.

Runs before a replica is chosen, in the order `stack.py` explains. Each refusal is cheap
and clear: 401 for a missing or unknown key, 400 naming the limit and the count, 429 with
a Retry-After computed from a bucket's refill or the fleet's drain rate, 503 when the
shared limits backend is down in fail-closed mode.

Owns the configuration of tenants, tiers, rate limiting and admission (validated here,
with field names prefixed so an error still names its place in the file). Must not
block on the fleet: replica load comes from the published snapshot.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
from collections import deque
from typing import TYPE_CHECKING, Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from seawall import clock
from seawall.auth import KeyStore, is_key_hash
from seawall.config import ConfigError, GatewayConfig, TimeoutOverrides, format_validation_error
from seawall.errors import ApiError, rate_limited
from seawall.fleet.view import EngineLoad, ReplicaView
from seawall.gateway.proxy import RequestCtx
from seawall.gateway.replicas import Replica, blocks_for
from seawall.policy.admission import (
    AdmissionThresholds,
    Queue,
    kv_reservation_full,
    on_fleet_saturated,
    replica_saturated,
)
from seawall.policy.limits import Reject, TierLimits, check_request
from seawall.protocol.tokens import (
    EstimateCounter,
    HFTokenizerCounter,
    TokenCounter,
    count_request,
)
from seawall.state.limits import (
    Denied,
    Lease,
    LimitsBackend,
    MemoryLimits,
    TenantLimits,
    denied_error,
)

if TYPE_CHECKING:
    from seawall.gateway.app import Gateway

log = logging.getLogger("seawall.gateway")

DEFAULT = "default"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TierConfig(_Strict):
    priority: Annotated[int, Field(ge=0)] = 0  # 0 is the most important; larger sheds first
    max_prompt_tokens: Annotated[int, Field(ge=1)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None  # ceiling on max_tokens
    max_tokens_default: Annotated[int, Field(ge=1)] = 1024  # when the request has none
    max_tokens_mode: Literal["reject", "clamp"] = "reject"
    max_concurrent: Annotated[int, Field(ge=1)] | None = None
    prompt_tokens_per_min: Annotated[int, Field(ge=1)] | None = None
    requests_per_min: Annotated[int, Field(ge=1)] | None = None
    timeouts: TimeoutOverrides | None = None
    migrate: bool = False  # continue a stream on another replica when its replica dies

    def limits(self) -> TierLimits:
        default = self.max_tokens_default
        if self.max_tokens is not None:
            default = min(default, self.max_tokens)
        return TierLimits(
            max_prompt_tokens=self.max_prompt_tokens,
            max_tokens_max=self.max_tokens,
            max_tokens_default=default,
            max_tokens_mode=self.max_tokens_mode,
            max_concurrent=self.max_concurrent,
            prompt_tokens_per_min=self.prompt_tokens_per_min,
            requests_per_min=self.requests_per_min,
            priority=self.priority,
        )


class TenantConfig(_Strict):
    tier: str = DEFAULT
    api_key_hashes: list[str] = Field(default_factory=list)  # from `seawall keys new`

    @field_validator("api_key_hashes")
    @classmethod
    def _hashes_only(cls, keys: list[str]) -> list[str]:
        for k in keys:
            if not is_key_hash(k):
                raise ValueError(
                    "keys must be hashes ('sha256:<64 hex>', printed by `seawall keys new`); "
                    "never put a raw API key in the configuration"
                )
        return keys


class RateLimitConfig(_Strict):
    backend: Literal["memory", "redis"] = "memory"
    redis_url: str = "redis://127.0.0.1:6379/0"
    fail_mode: Literal["open", "closed"] = "open"  # when Redis is unreachable
    key_prefix: str = "seawall:limits:"


class AdmissionConfig(_Strict):
    enabled: bool = True
    kv_usage_max: Annotated[float, Field(gt=0, le=1)] = 0.9
    waiting_max: Annotated[float, Field(ge=0)] = 5
    preemption_rate_max_per_s: Annotated[float, Field(gt=0)] = 2.0
    metrics_max_age_s: Annotated[float, Field(gt=0)] = 5.0
    inflight_max: Annotated[int, Field(ge=1)] | None = None  # per replica, gateway's own count
    # In-flight prompt + max_tokens may reserve this fraction of a replica's KV cache (read
    # from vLLM's cache_config_info); 1.0 = no preemption even if all run to max_tokens,
    # more overcommits on requests stopping early; null disables. See policy/admission.py.
    kv_reserve_max: Annotated[float, Field(gt=0)] | None = 1.0
    queue_max: Annotated[int, Field(ge=0)] = 64
    queue_timeout_s: Annotated[float, Field(gt=0)] = 5.0
    lowest_priority_to_queue: Annotated[int, Field(ge=0)] = 0
    tokenizers: dict[str, str] = Field(default_factory=dict)  # model -> tokenizer.json

    def thresholds(self) -> AdmissionThresholds:
        return AdmissionThresholds(
            kv_usage_max=self.kv_usage_max,
            waiting_max=self.waiting_max,
            preemption_rate_max_per_s=self.preemption_rate_max_per_s,
            metrics_max_age_s=self.metrics_max_age_s,
            inflight_max=self.inflight_max,
        )


def _section(model: type[BaseModel], data: Any, where: str) -> Any:
    try:
        return model.model_validate(data or {})
    except ValidationError as e:
        raise ConfigError(
            format_validation_error(e, where).replace("\n  ", f"\n  {where}.")
        ) from None


def load_tenancy(
    config: GatewayConfig,
) -> tuple[dict[str, TierConfig], dict[str, TenantConfig], RateLimitConfig, AdmissionConfig]:
    tiers = {name: _section(TierConfig, t, f"tiers.{name}") for name, t in config.tiers.items()}
    tiers.setdefault(DEFAULT, TierConfig())
    tenants = {
        name: _section(TenantConfig, t, f"tenants.{name}") for name, t in config.tenants.items()
    }
    for name, t in tenants.items():
        if t.tier not in tiers:
            raise ConfigError(
                f"tenants.{name}.tier: unknown tier {t.tier!r}; defined tiers: {sorted(tiers)}"
            )
    rate = _section(RateLimitConfig, config.ratelimit, "ratelimit")
    admission = _section(AdmissionConfig, config.admission, "admission")
    return tiers, tenants, rate, admission


class TenancyGuard:
    def __init__(self, gw: Gateway, backend: LimitsBackend | None = None) -> None:
        self.gw = gw
        self.tiers, self.tenants, self.rate, self.admission = load_tenancy(gw.config)
        self.keys: KeyStore | None = (
            KeyStore.from_tenants({n: t.api_key_hashes for n, t in self.tenants.items()})
            if self.tenants
            else None
        )
        self.limits = {name: tier.limits() for name, tier in self.tiers.items()}
        self.backend: LimitsBackend = backend or MemoryLimits()
        self.thresholds = self.admission.thresholds()
        self.thresholds_reserving = dataclasses.replace(self.thresholds, kv_usage_max=1.0)
        self.counters: dict[str, TokenCounter] = {
            model: HFTokenizerCounter(path) for model, path in self.admission.tokenizers.items()
        }
        self.estimate = EstimateCounter()
        self.queued: dict[str, int] = {}
        self._completions: deque[float] = deque(maxlen=512)
        self._orphans: set[asyncio.Future[None]] = set()
        self._trends: dict[str, _Trend] = {}  # per replica, updated once per new scrape
        if self.admission.enabled:
            gw.replicas.saturation = self.saturation

    # -- request path -------------------------------------------------------------------

    async def admit(self, request: web.Request, ctx: RequestCtx) -> None:
        gw = self.gw
        req = ctx.req
        assert req is not None
        # 1. auth
        if self.keys is not None:
            who = self.keys.authenticate_headers(request.headers)
            if isinstance(who, ApiError):
                raise who
            ctx.tenant = who
            ctx.tier = self.tenants[who].tier
        tier = self.tiers[ctx.tier]
        limits = self.limits[ctx.tier]
        if tier.timeouts is not None:
            ctx.timeouts = tier.timeouts.apply(ctx.timeouts)
        ctx.migrate = ctx.track_text = tier.migrate and req.stream
        # 2. tier limits: count only when a limit needs the count.
        reserve = self.admission.enabled and self.admission.kv_reserve_max is not None
        needs_count = (
            reserve or limits.max_prompt_tokens is not None or limits.prompt_tokens_per_min
        )
        prompt_tokens = self.count_prompt(ctx) if needs_count else 0
        requested = req.requested_max_tokens()
        decision = check_request(
            prompt_tokens, requested, limits, "messages" if req.route == "chat" else "prompt"
        )
        if isinstance(decision, Reject):
            self._shed(ctx, "tier_limit")
            raise ApiError(decision.status, decision.message, decision.param, decision.code)
        if decision.max_tokens != requested:
            req.set(req.max_tokens_field(), decision.max_tokens)
        if reserve:
            # vLLM clamps prompt + max_tokens to max_model_len, so no request grows past it.
            card = self.gw.model_cards.get(req.model) or {}
            cap = card.get("max_model_len")
            need = prompt_tokens + decision.max_tokens
            ctx.reserve_tokens = min(need, cap) if isinstance(cap, int) and cap > 0 else need
        # 3. tenant rates and concurrency
        if limits.requests_per_min or limits.prompt_tokens_per_min or limits.max_concurrent:
            # Shielded: if the client leaves while a shared backend runs the acquire, the
            # acquire still completes and its lease is released, instead of leaking a slot.
            acquiring = asyncio.ensure_future(
                self.backend.acquire(
                    ctx.tenant,
                    TenantLimits(
                        limits.requests_per_min,
                        limits.prompt_tokens_per_min,
                        limits.max_concurrent,
                    ),
                    prompt_tokens,
                    clock.monotonic(),
                )
            )
            try:
                got = await asyncio.shield(acquiring)
            except asyncio.CancelledError:
                acquiring.add_done_callback(self._release_orphan)
                raise
            gw.metrics.ratelimit_backend_degraded.set(1 if self.backend.degraded else 0)
            if isinstance(got, Denied):
                self._shed(ctx, got.reason)
                raise denied_error(got)
            ctx.lease = got
            ctx.reconcile = bool(limits.prompt_tokens_per_min)
            if req.stream and limits.prompt_tokens_per_min and not req.include_usage:
                # Reconciliation needs the engine's usage; ask for it and strip it again.
                opts = req.obj.get("stream_options")
                req.set(
                    "stream_options",
                    {**(opts if isinstance(opts, dict) else {}), "include_usage": True},
                )
                ctx.strip_usage = True
        # 4. fleet saturation
        if self.admission.enabled:
            await self._fleet_admission(ctx, tier)

    def count_prompt(self, ctx: RequestCtx) -> int:
        req = ctx.req
        assert req is not None
        counter = self.counters.get(req.model, self.estimate)
        # Every field that reaches the prompt, every prompt of a batch (issue 11, item 6).
        # `count_request(...).sequences` is what limits and reservations must multiply.
        return count_request(req, counter).prompt_tokens

    def _shed(self, ctx: RequestCtx, reason: str) -> None:
        m = self.gw.metrics
        m.shed.labels(ctx.tenant, ctx.tier, reason).inc()
        m.shed_latency.observe(clock.monotonic() - ctx.started)

    async def _fleet_admission(self, ctx: RequestCtx, tier: TierConfig) -> None:
        gw = self.gw
        model = ctx.model
        now = clock.monotonic()
        free, saturated = gw.replicas.candidates(model, now, need_tokens=ctx.reserve_tokens)
        if free or not saturated:
            return  # room somewhere, or nothing usable at all (the proxy answers 503)
        queue_len = self.queued.get(model, 0)
        decision = on_fleet_saturated(
            tier.priority,
            queue_len,
            self.admission.queue_max,
            self.admission.lowest_priority_to_queue,
            self.completions_per_s(now),
        )
        if not isinstance(decision, Queue):
            self._shed(ctx, "fleet_saturated")
            raise rate_limited(
                f"Every replica serving `{model}` is saturated; "
                + (decision.reason or "retry after the indicated time."),
                decision.retry_after_s,
                code="fleet_saturated",
            )
        self.queued[model] = queue_len + 1
        gw.metrics.queue_depth.labels(model).set(queue_len + 1)
        deadline = now + min(self.admission.queue_timeout_s, ctx.deadline - now)
        try:
            while True:
                await asyncio.sleep(0.01)
                now = clock.monotonic()
                free, _ = gw.replicas.candidates(model, now, need_tokens=ctx.reserve_tokens)
                if free:
                    return
                if now >= deadline:
                    self._shed(ctx, "queue_timeout")
                    raise rate_limited(
                        f"Every replica serving `{model}` stayed saturated for "
                        f"{self.admission.queue_timeout_s:g}s (queue timeout).",
                        max(1.0, self.admission.queue_timeout_s),
                        code="queue_timeout",
                    )
        finally:
            self.queued[model] -= 1
            gw.metrics.queue_depth.labels(model).set(self.queued[model])

    async def release(self, ctx: RequestCtx) -> None:
        now = clock.monotonic()
        if ctx.status == 200:
            self._completions.append(now)
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
        assert isinstance(lease, Lease)
        await self.backend.release(lease, actual, now)

    def _release_orphan(self, fut: asyncio.Future[Lease | Denied]) -> None:
        if not fut.cancelled() and isinstance(fut.result(), Lease):
            lease = fut.result()
            assert isinstance(lease, Lease)
            task = asyncio.ensure_future(self.backend.release(lease, 0, clock.monotonic()))
            self._orphans.add(task)
            task.add_done_callback(self._orphans.discard)

    async def close(self) -> None:
        await self.backend.close()

    def completions_per_s(self, now: float, window_s: float = 10.0) -> float:
        recent = sum(1 for t in self._completions if now - t <= window_s)
        return recent / window_s

    # -- saturation, read by routing ----------------------------------------------------

    def saturation(
        self, replica: Replica, view: ReplicaView, now: float, need_tokens: int = 0
    ) -> str | None:
        """Why `replica` should not take a request that may grow to `need_tokens`, or None."""
        load = view.load
        if load is None:
            # Never scraped (an engine without /metrics): only the gateway's own count applies.
            load = EngineLoad(scraped_at=now)
        load = self._trend(replica.id, load)
        trend = self._trends.get(replica.id)
        rate = trend.preemption_rate_per_s if trend is not None else None
        reserving = self.admission.kv_reserve_max is not None and bool(load.kv_capacity_tokens)
        # With exact reservations the KV gauge adds nothing but lag: a slot freed a moment
        # ago still shows as used until the next scrape, and would shed for no reason.
        thresholds = self.thresholds_reserving if reserving else self.thresholds
        reason = replica_saturated(load, replica.inflight, rate, now, thresholds)
        if reason or not reserving or load.kv_capacity_tokens is None:
            return reason
        if load.kv_block_size:
            replica.kv_block_size = load.kv_block_size
        if replica.reserved_blocks == 0:
            return None  # alone on the replica, a request fits or the engine says why not
        block = replica.kv_block_size
        return kv_reservation_full(
            replica.reserved_blocks + blocks_for(need_tokens, block),
            load.kv_capacity_tokens / block,
            self.admission.kv_reserve_max,
        )

    def _trend(self, replica_id: str, load: EngineLoad) -> EngineLoad:
        """The load admission judges: the waiting queue as the smaller of the last two
        scrapes, and the preemption rate between them.

        A raw waiting gauge spikes at step boundaries as a burst of new requests lands
        (5% of 100 ms samples read over 5, up to 20, on an idle emulator fleet), and the
        engine admits such a burst within a step or two. A queue seen in two scrapes in a
        row has lasted at least a scrape interval: that one is real.
        """
        prev = self._trends.get(replica_id)
        if prev is not None and load.scraped_at <= prev.scraped_at:
            return prev.smoothed
        waiting = load.waiting
        rate: float | None = None
        if prev is not None:
            if waiting is not None and prev.raw.waiting is not None:
                waiting = min(waiting, prev.raw.waiting)
            total, before = load.preemptions_total, prev.raw.preemptions_total
            if total is not None and before is not None:
                rate = max(0.0, total - before) / (load.scraped_at - prev.scraped_at)
        smoothed = dataclasses.replace(load, waiting=waiting)
        self._trends[replica_id] = _Trend(load.scraped_at, load, smoothed, rate)
        return smoothed


@dataclasses.dataclass(frozen=True, slots=True)
class _Trend:
    scraped_at: float
    raw: EngineLoad
    smoothed: EngineLoad
    preemption_rate_per_s: float | None


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
