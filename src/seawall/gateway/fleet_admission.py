"""Fleet admission: which replicas may take new work, and what a request does when none
will (queue, most important tier first, or shed with an honest Retry-After).

Per replica, `saturation` is read by routing for every request (`ReplicaSet.saturation`):
the engine's scraped load judged by `policy.admission.replica_saturated` (the waiting
queue over two scrapes, the preemption rate between them), and the KV reservations of
the requests this gateway has in flight there (the in-flight ledger's `kv_blocks`)
judged by `kv_reservation_full`. At the fleet level, `admit` is the last admission
step: when every usable replica is saturated it queues or sheds
(`policy.admission.on_fleet_saturated`); the queue (`queue.py`) is woken when a slot is
released or the fleet view changes.

Must not: block on the fleet monitor (load comes from the published snapshot) or count
anything the ledger counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

from seawall import clock
from seawall.config import AdmissionConfig
from seawall.errors import rate_limited
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.gateway.admission_control import AdmissionControl
from seawall.gateway.context import RequestCtx
from seawall.gateway.pools import PoolRouter
from seawall.gateway.queue import AdmissionQueue, Displaced
from seawall.gateway.replicas import Replica, ReplicaSet, blocks_for
from seawall.metrics import Metrics
from seawall.policy.adaptive_admission import OutputLengths
from seawall.policy.admission import (
    Queue,
    kv_reservation_full,
    on_fleet_saturated,
    replica_saturated,
    retry_after_s,
)


class FleetAdmission:
    def __init__(
        self,
        config: AdmissionConfig,
        replicas: ReplicaSet,
        metrics: Metrics,
        pools: PoolRouter | None = None,
    ) -> None:
        self.config = config
        self.replicas = replicas
        self.metrics = metrics
        self.pools = pools  # None: one pool
        self.thresholds = config.thresholds()
        self.thresholds_reserving = dataclasses.replace(self.thresholds, kv_usage_max=1.0)
        self.queue = AdmissionQueue(
            on_depth=lambda model, depth: metrics.queue_depth.labels(model).set(depth)
        )
        self._completions: deque[float] = deque(maxlen=512)
        self._trends: dict[str, _Trend] = {}  # per replica, updated once per new scrape
        # Adaptive admission (issue 17; gateway/admission_control.py): it judges KV and
        # preemptions itself; the queue, in-flight and staleness thresholds apply before it.
        a = config.adaptive
        self.control = (
            AdmissionControl(
                a.control(config.metrics_max_age_s),
                metrics,
                OutputLengths(a.length_alpha, a.length_min_samples),
            )
            if config.enabled and config.mode == "adaptive"
            else None
        )
        self.thresholds_adaptive = dataclasses.replace(
            self.thresholds, kv_usage_max=1.0, preemption_rate_max_per_s=math.inf
        )
        if config.enabled:
            replicas.saturation = self.saturation

    # -- the admission step ---------------------------------------------------------------

    async def admit(self, ctx: RequestCtx) -> None:
        """Return when the request may go on to a replica; raise a 429 to shed it."""
        if not self.config.enabled:
            return
        model = ctx.model
        if self.control is not None and ctx.reserve_tokens and ctx.req is not None:
            top = ctx.req.requested_max_tokens() or 0
            self.control.attach(ctx, ctx.prompt_tokens, top, ctx.reserve_tokens, ctx.priority)
        need = ctx.reserve_tokens
        queue = self.queue
        now = clock.monotonic()
        free, saturated = self._reach(ctx, now)
        if not free and not saturated:
            return  # nothing usable at all: the dispatcher answers 503
        if free and not queue.better_waiting(model, ctx.priority):
            return
        cfg = self.config
        depth = queue.depth(model)
        decision = on_fleet_saturated(
            ctx.priority,
            depth,
            cfg.queue_max,
            cfg.lowest_priority_to_queue,
            self.completions_per_s(now),
        )
        if (
            not isinstance(decision, Queue)
            and depth >= cfg.queue_max
            and ctx.priority <= cfg.lowest_priority_to_queue
            and queue.displace_worse(model, ctx.priority)
        ):
            # A full queue made room for a better tier by shedding its worst waiter.
            decision = Queue(expected_wait_s=0.0)
        if not isinstance(decision, Queue):
            self.shed(ctx, "fleet_saturated")
            retry_after = decision.retry_after_s
            if self.control is not None:  # the replicas' own drain, when it can tell
                ids = [r.id for r in saturated]
                retry_after = self.control.retry_after_s(ids, need, now) or retry_after
            raise rate_limited(
                f"Every replica serving `{model}` is saturated; "
                + (decision.reason or "retry after the indicated time."),
                retry_after,
                code="fleet_saturated",
            )
        deadline = now + min(cfg.queue_timeout_s, ctx.deadline - now)

        def room() -> bool:
            free, _ = self._reach(ctx, clock.monotonic())
            return bool(free)

        ctx.stage = "queued"
        try:
            admitted = await queue.wait(model, ctx.priority, room, deadline)
            ctx.queued_s = clock.monotonic() - now
        except Displaced:
            self.shed(ctx, "fleet_saturated")
            raise rate_limited(
                f"Every replica serving `{model}` is saturated and a higher-priority request "
                "took this one's place in the queue.",
                self._retry_after_s(),
                code="fleet_saturated",
            ) from None
        if not admitted:
            self.shed(ctx, "queue_timeout")
            raise rate_limited(
                f"Every replica serving `{model}` stayed saturated for "
                f"{cfg.queue_timeout_s:g}s (queue timeout).",
                max(1.0, cfg.queue_timeout_s),
                code="queue_timeout",
            )

    def _reach(self, ctx: RequestCtx, now: float) -> tuple[list[Replica], list[Replica]]:
        """The replicas this request may use: its pools, as its tier allows (pools.py)."""
        if self.pools is None:
            return self.replicas.candidates(ctx.model, now, need_tokens=ctx.reserve_tokens)
        reach = self.pools.reach(ctx.model, ctx.pools, now, need_tokens=ctx.reserve_tokens)
        return reach.free, reach.saturated

    def shed(self, ctx: RequestCtx, reason: str) -> None:
        self.metrics.record_shed(ctx.tenant, ctx.tier, reason, clock.monotonic() - ctx.started)

    def _retry_after_s(self) -> float:
        return retry_after_s(0, self.completions_per_s(clock.monotonic()))

    def completed(self, ctx: RequestCtx) -> None:
        """A request ended (the completion rate sets Retry-After and the queue's wait)."""
        if ctx.status == 200:
            self._completions.append(clock.monotonic())
        if self.control is not None:
            self.control.finish(ctx, clock.monotonic())

    def on_snapshot(self, snap: FleetSnapshot) -> None:
        """Every fleet snapshot (the monitor's listener): the adaptive controllers follow
        each new scrape even when no request arrives to ask."""
        if self.control is None:
            return
        now = clock.monotonic()
        for rid, view in snap.replicas.items():
            if view.load is not None and view.load.kv_capacity_tokens:
                self.control.observe(rid, self._trend(rid, view.load), now)

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
        if self.control is not None and load.kv_capacity_tokens:
            counts = replica.counts
            reason = replica_saturated(load, counts.requests, None, now, self.thresholds_adaptive)
            return reason or self.control.saturation(
                replica.id, load, now, need_tokens, counts.requests
            )
        trend = self._trends.get(replica.id)
        rate = trend.preemption_rate_per_s if trend is not None else None
        reserving = self.config.kv_reserve_max is not None and bool(load.kv_capacity_tokens)
        # With exact reservations the KV gauge adds nothing but lag: a slot freed a moment
        # ago still shows as used until the next scrape, and would shed for no reason.
        thresholds = self.thresholds_reserving if reserving else self.thresholds
        reason = replica_saturated(load, replica.counts.requests, rate, now, thresholds)
        if reason or not reserving or load.kv_capacity_tokens is None:
            return reason
        if load.kv_block_size:
            replica.kv_block_size = load.kv_block_size
        reserved = replica.counts.kv_blocks
        if reserved == 0:
            return None  # alone on the replica, a request fits or the engine says why not
        block = replica.kv_block_size
        return kv_reservation_full(
            reserved + blocks_for(need_tokens, block),
            load.kv_capacity_tokens / block,
            self.config.kv_reserve_max,
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
