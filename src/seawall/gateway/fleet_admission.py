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

Several gateway instances (`use_grants`): this instance's reservations on a replica are
judged against its own grant from the fleet leader (`gateway/fleet_quota.py`), not the
whole cache, and its in-flight count against its share of `inflight_max`; before it has
a grant on a replica it admits nothing there ("no grant yet": it queues or sheds, as for
a saturated replica). With the store or the leader gone it keeps its last grant. The
engine's own gauges (waiting queue, KV usage, preemptions), which see every instance's
requests, are judged as before. `demand` is what this instance reports to the leader:
what it holds on each replica and what waits in its queue or was refused lately.

Must not: block on the fleet monitor (load comes from the published snapshot) or count
anything the ledger counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections import Counter, deque
from collections.abc import Mapping

from seawall import clock
from seawall.cluster.report import KV_HELD, KV_WANTED, SEQS_HELD, SEQS_WANTED
from seawall.config import AdmissionConfig
from seawall.errors import rate_limited
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.gateway.admission_control import AdmissionControl, combined
from seawall.gateway.context import RequestCtx
from seawall.gateway.fleet_quota import Grants, ReplicaGrant, capacity_of
from seawall.gateway.pools import PoolRouter, one_pool_reach
from seawall.gateway.queue import AdmissionQueue, Displaced
from seawall.gateway.replicas import Replica, ReplicaSet, blocks_for
from seawall.metrics import Metrics
from seawall.policy.adaptive_admission import OutputLengths
from seawall.policy.admission import (
    NOT_SCRAPED,
    Queue,
    Refusals,
    Turns,
    estimated_drain_s,
    kv_reservation_full,
    on_fleet_saturated,
    replica_saturated,
    retry_after_s,
)

NO_GRANT = (
    "no share of this replica granted to this gateway instance yet "
    "(the fleet leader grants one within a second or two)"
)
# Requests refused for want of room count as demand this long (what the leader divides
# by): without it, an instance that sheds instead of queueing would never ask for more.
REFUSED_DEMAND_S = 2.0


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
        self._seen_views: Mapping[str, ReplicaView] = {}  # the last snapshot's (on_snapshot)
        # Adaptive admission (issue 17; gateway/admission_control.py): it judges KV and
        # preemptions itself; the queue, in-flight and staleness thresholds apply before it.
        a = config.adaptive
        self.control = (
            AdmissionControl(
                a.control(config.metrics_max_age_s),
                metrics,
                OutputLengths(
                    a.length_alpha, a.length_min_samples, prior_samples=a.length_prior_samples
                ),
            )
            if config.enabled and config.mode == "adaptive"
            else None
        )
        self.thresholds_adaptive = dataclasses.replace(
            self.thresholds, kv_usage_max=1.0, preemption_rate_max_per_s=math.inf
        )
        # Several instances: the leader's grants (None: alone, the whole of each replica).
        self.grants: Grants | None = None
        self._queued: dict[str, Counter[int]] = {}  # model -> reserve tokens -> waiting
        self._refused: deque[tuple[float, str, int]] = deque(maxlen=4096)
        # Requests refused lately, by tenant and body: taking turns (policy/admission.py),
        # held for them (`turns: hold`) or in the queue (`turns: queue`).
        self._refusals = Refusals(config.queue_after_refusals)
        self._turns: Turns | None = (
            Turns() if config.turns == "hold" and config.queue_after_refusals > 0 else None
        )
        if config.enabled:
            replicas.saturation = self.saturation

    def divided(self) -> tuple[float | None, int | None]:
        """What the leader divides of each replica: (the KV ratio admission counts
        against, `inflight_max`); see `fleet_quota.capacity_of`."""
        adm = self.config
        ratio = adm.adaptive.kv_target if adm.mode == "adaptive" else adm.kv_reserve_max
        return ratio, adm.inflight_max

    def use_grants(self, grants: Grants) -> None:
        """Admit within the fleet leader's grants from now on (several instances)."""
        self.grants = grants
        # `inflight_max` becomes this instance's share of it (checked in `saturation`).
        self.thresholds = dataclasses.replace(self.thresholds, inflight_max=None)
        self.thresholds_reserving = dataclasses.replace(
            self.thresholds_reserving, inflight_max=None
        )
        self.thresholds_adaptive = dataclasses.replace(self.thresholds_adaptive, inflight_max=None)
        if self.control is not None:
            control = self.control

            def quota_of(replica_id: str) -> float:
                g = grants.get(replica_id)
                if g is None or g.empty:
                    return grants.fallback_share() or 0.0
                return 0.0 if g.kv_blocks is None else g.kv_share

            control.quota_of = quota_of

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
        cfg = self.config
        refusals = self._refusals
        turns = self._turns
        # Room now, unless a better tier waits, or (for a tier that is shed rather than
        # queued) a request of its own tier that was refused before waits its turn, in
        # the queue or (`turns: hold`) away until its Retry-After.
        ahead = queue.better_waiting(model, ctx.priority) or (
            ctx.priority > cfg.lowest_priority_to_queue
            and queue.waiting_at_or_above(model, ctx.priority)
        )
        key: bytes | None = None
        mine = False
        if turns is not None and len(turns):
            key = self._key(ctx)
            mine = turns.holds(key, now)
            # A turn owed for longer than anything may wait in the gateway goes first.
            first = turns.first_overdue(model, ctx.priority, now, cfg.queue_timeout_s)
            ahead = ahead or (first is not None and first != key)
            if free and not ahead and not mine:
                owed = turns.owed_needs(model, ctx.priority, now)
                if owed:
                    # The room held for the requests owed a turn is what they need, not
                    # all of it: a fresh request is admitted where it fits beside them.
                    beside, _ = self._reach(ctx, now, combined([need, *owed]))
                    ahead = not beside
        if free and not ahead:
            if len(refusals):
                refusals.served(key or self._key(ctx))
            if mine and turns is not None and key is not None:
                turns.take(key)
            return
        depth = queue.depth(model)
        decision = on_fleet_saturated(
            ctx.priority,
            depth,
            cfg.queue_max,
            cfg.lowest_priority_to_queue,
            self.completions_per_s(now),
        )
        if (
            turns is None
            and not isinstance(decision, Queue)
            and depth < cfg.queue_max
            and len(refusals)
            and refusals.patient(self._key(ctx), now)
        ):
            # Refused often enough already: it waits its turn (policy.admission.Refusals).
            decision = Queue(expected_wait_s=estimated_drain_s(depth, self.completions_per_s(now)))
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
            self._refused.append((now, model, int(need)))
            key = key or self._key(ctx)
            refused = refusals.refused(key, now)
            retry_after = decision.retry_after_s
            if self.control is not None:  # the replicas' own drain, when it can tell
                ids = [r.id for r in saturated]
                retry_after = self.control.retry_after_s(ids, need, now) or retry_after
            if turns is not None and refused >= refusals.patience:
                # Owed a turn: the room that frees is held for it until it comes back.
                # At most `queue_timeout_s` (and the grace): the longest anything waits for
                # room in the gateway, and a client that gave up holds no room longer.
                hold = min(retry_after, cfg.queue_timeout_s) + cfg.turn_grace_s
                turns.grant(key, model, ctx.priority, now + hold, now, need)
            if free:  # there was room, held for requests refused before this one
                raise rate_limited(
                    f"The room on the replicas serving `{model}` is held for requests "
                    "refused before this one (they take turns); retry after the indicated "
                    "time.",
                    retry_after,
                    code="fleet_saturated",
                )
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
        waiting = self._queued.setdefault(model, Counter())
        waiting[int(need)] += 1
        try:
            admitted = await queue.wait(model, ctx.priority, room, deadline)
            ctx.queued_s = clock.monotonic() - now
        except Displaced:
            self.shed(ctx, "fleet_saturated")
            self._refused.append((clock.monotonic(), model, int(need)))
            refusals.refused(self._key(ctx), clock.monotonic())
            raise rate_limited(
                f"Every replica serving `{model}` is saturated and a higher-priority request "
                "took this one's place in the queue.",
                self._retry_after_s(),
                code="fleet_saturated",
            ) from None
        finally:
            waiting[int(need)] -= 1
            if waiting[int(need)] <= 0:
                del waiting[int(need)]
        if admitted:
            if len(refusals):
                refusals.served(self._key(ctx))
        else:
            self.shed(ctx, "queue_timeout")
            refusals.refused(self._key(ctx), clock.monotonic())
            raise rate_limited(
                f"Every replica serving `{model}` stayed saturated for "
                f"{cfg.queue_timeout_s:g}s (queue timeout).",
                max(1.0, cfg.queue_timeout_s),
                code="queue_timeout",
            )

    @staticmethod
    def _key(ctx: RequestCtx) -> bytes:
        """The same request sent again: its tenant and its body (a digest, so a refused
        request's body is not kept)."""
        h = hashlib.blake2b(ctx.tenant.encode(), digest_size=16)
        h.update(b"\0" + ctx.route.encode() + b"\0")
        if ctx.req is not None:
            h.update(ctx.req.raw)
        return h.digest()

    def _reach(
        self, ctx: RequestCtx, now: float, need: int | None = None
    ) -> tuple[list[Replica], list[Replica]]:
        """The replicas this request may use: its pools, as its tier allows (pools.py).
        Kept on `ctx.reach` for the dispatcher's first choice, which follows without a
        pause when the request is admitted. `need`: the room to find, when more than the
        request's own (`combined`)."""
        if need is None:
            need = ctx.reserve_tokens
        if self.pools is None:
            reach = one_pool_reach(self.replicas, ctx.model, now, need_tokens=need)
        else:
            reach = self.pools.reach(ctx.model, ctx.pools, now, need_tokens=need)
        ctx.reach = reach
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
        seen, self._seen_views = self._seen_views, snap.replicas
        for rid, view in snap.changed_since(seen):  # an unchanged view's load is observed
            if view.load is not None and view.load.kv_capacity_tokens:
                self.control.observe(rid, self._trend(rid, view.load), now)

    def demand(self, replica: Replica, now: float) -> dict[str, float]:
        """What this instance holds on `replica` and would like of it (its heartbeat
        report's `demand`, which the fleet leader divides the replica by): KV blocks at
        the level it admits at, and requests; queued and lately refused requests of the
        replica's model count in `wanted` on each replica that serves it."""
        model = replica.public or ""
        block = replica.kv_block_size
        queued_blocks = queued = 0
        for tokens, n in self._queued.get(model, Counter()).items():
            queued_blocks += blocks_for(tokens, block) * n
            queued += n
        refused = self._refused
        while refused and now - refused[0][0] > REFUSED_DEMAND_S:
            refused.popleft()
        refused_blocks = refused_n = 0
        for _, m, tokens in refused:
            if m == model:
                refused_blocks += blocks_for(tokens, block)
                refused_n += 1
        counts = replica.counts
        if self.control is not None:
            held_kv = self.control.reserved_blocks(replica.id, now)
        else:
            held_kv = float(counts.kv_blocks)
        return {
            KV_HELD: held_kv,
            KV_WANTED: held_kv + queued_blocks + refused_blocks,
            SEQS_HELD: float(counts.sequences),
            SEQS_WANTED: float(counts.sequences + queued + refused_n),
        }

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
            if not view.no_metrics:
                return NOT_SCRAPED  # its size is a scrape away: admitting blind overfills it
            # An engine without /metrics: only the gateway's own count applies.
            load = EngineLoad(scraped_at=now)
        load = self._trend(replica.id, load)
        counts = replica.counts
        # Several instances: this one's grant here (None with no leader's grant yet).
        grant: ReplicaGrant | None = _WHOLE
        if self.grants is not None:
            grant = self.grants.get(replica.id)
            if grant is None or grant.empty:
                # Cut off from the store before the leader granted it anything: an even
                # share (None while the store answers: the grant is on its way).
                grant = self.grants.fallback(capacity_of(load, *self.divided())) or grant
            seq_reason = self._seqs_over(grant, counts.sequences)
            if seq_reason:
                return seq_reason
        if self.control is not None and load.kv_capacity_tokens:
            reason = replica_saturated(load, counts.sequences, None, now, self.thresholds_adaptive)
            if reason:
                return reason
            if grant is None or (self.grants is not None and grant.kv_blocks is None):
                return NO_GRANT
            return self.control.saturation(
                replica.id, load, now, need_tokens, counts.requests, grant.kv_share
            )
        trend = self._trends.get(replica.id)
        rate = trend.preemption_rate_per_s if trend is not None else None
        reserving = self.config.kv_reserve_max is not None and bool(load.kv_capacity_tokens)
        # With exact reservations the KV gauge adds nothing but lag: a slot freed a moment
        # ago still shows as used until the next scrape, and would shed for no reason.
        thresholds = self.thresholds_reserving if reserving else self.thresholds
        reason = replica_saturated(load, counts.sequences, rate, now, thresholds)
        if reason or not reserving or load.kv_capacity_tokens is None:
            return reason
        if load.kv_block_size:
            replica.kv_block_size = load.kv_block_size
        reserved = counts.kv_blocks
        block = replica.kv_block_size
        if grant is None or (self.grants is not None and grant.kv_blocks is None):
            return NO_GRANT
        if grant.kv_shared and grant.kv_blocks is not None:
            # A share of the replica: the others may fill the rest, so even alone here
            # this instance admits only what fits its grant.
            wanted = reserved + blocks_for(need_tokens, block)
            if wanted > grant.kv_blocks:
                return (
                    f"{wanted} KV blocks would be reserved by this gateway instance, over "
                    f"its grant of {grant.kv_blocks} of the replica's {grant.kv_of} "
                    "(the fleet leader's quota)"
                )
            return None
        if reserved == 0:
            return None  # alone on the replica, a request fits or the engine says why not
        return kv_reservation_full(
            reserved + blocks_for(need_tokens, block),
            load.kv_capacity_tokens / block,
            self.config.kv_reserve_max,
        )

    def _seqs_over(self, grant: ReplicaGrant | None, in_flight: int) -> str | None:
        """This instance's share of `inflight_max`, when that is set (None: within it)."""
        if self.config.inflight_max is None:
            return None
        if grant is None or grant.seqs is None:
            return NO_GRANT
        if in_flight >= grant.seqs:
            return (
                f"{in_flight} sequences in flight through this gateway instance, at its "
                f"share of {grant.seqs} of the replica's {grant.seqs_of} (inflight_max)"
            )
        return None

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


# Alone (no cluster): the whole of every replica, no quota.
_WHOLE = ReplicaGrant()
