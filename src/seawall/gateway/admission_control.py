"""The shell around the adaptive KV admission controller (`policy.adaptive_admission`).

Owns the controller instances (one per replica), this gateway's reservation sums per
replica, and the learned output lengths. It is fed from a few one-line hooks, so the
request path's shape can change around it:

- `FleetAdmission.admit` calls `attach` once the prompt is counted and `max_tokens`
  decided: the request's `Demand` (prompt, ceiling, learned estimate, tier priority) rides
  on `ctx.reserve_tokens` (a `ReserveTokens`, an int worth today's worst-case tokens, so
  every caller that passes an int still works) and `ctx.admission` (an `AdmissionTicket`);
- the composition root subscribes `observe` to the fleet monitor's snapshots, so every new
  scrape reaches the replica's controller even when no request arrives;
  `FleetAdmission.saturation` calls `saturation` per replica and candidate request for the
  decision, and `admit` asks `retry_after_s` for a 429's Retry-After;
- the dispatcher calls `AdmissionTicket.bind` with the in-flight ledger's hold where it
  claims a replica for an attempt; a released hold gives its reservation back at the next
  decision on that replica (`saturation` sees the ledger's count drop), and
  `FleetAdmission.completed` calls `finish` at the request's end (every hold released by
  then), which also learns the completion's length from the engine's usage or the relayed
  events.

With several gateways (issue 15) each admits within its share of the replica, the
leader's grant (`gateway/fleet_quota.py`): `saturation` takes it as `quota`, and
`quota_of` (set by fleet admission) gives it to the Retry-After estimate;
`reserved_blocks` is what this gateway reports as holding there.

Must not: block, read the clock (the caller passes `now`), or decide anything itself: the
rules are the policy module's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from seawall.fleet.view import EngineLoad
from seawall.policy.adaptive_admission import (
    Admit,
    ControlConfig,
    ControlState,
    Demand,
    Hold,
    OutputLengths,
    ReplicaAdmission,
    Reservations,
    length_class,
)
from seawall.protocol.sse import Kind

if TYPE_CHECKING:
    from seawall.gateway.context import RequestCtx
    from seawall.gateway.inflight import Hold as LedgerHold
    from seawall.metrics import Metrics


class ReserveTokens(int):
    """Today's worst-case reservation in tokens (prompt + max_tokens), as an int, carrying
    the request's `Demand` (its ticket's, which a cold start may re-estimate) to the
    controller through code that passes only an int."""

    ticket: AdmissionTicket

    def __new__(cls, worst_tokens: int, ticket: AdmissionTicket) -> ReserveTokens:
        obj = super().__new__(cls, worst_tokens)
        obj.ticket = ticket
        return obj

    @property
    def demand(self) -> Demand:
        return self.ticket.demand


@dataclass(slots=True)
class _Replica:
    controller: ReplicaAdmission
    reserved: Reservations = field(default_factory=Reservations)
    load: EngineLoad | None = None
    block_size: int = 16
    bound: set[AdmissionTicket] = field(default_factory=set)  # tickets reserving here


class AdmissionTicket:
    """One request's handle: the replicas it reserves on (with the ledger hold of the
    attempt, whose release gives the reservation back), and its key for learning."""

    __slots__ = ("bound", "control", "demand", "key")

    def __init__(self, control: AdmissionControl, demand: Demand, key: tuple[str, str, str]):
        self.control = control
        self.demand = demand
        self.key = key
        self.bound: dict[str, tuple[LedgerHold, int]] = {}  # replica -> (hold, block size)

    def bind(self, replica_id: str, hold: LedgerHold) -> None:
        """An attempt claimed `replica_id` (its ledger hold): reserve there until released."""
        self.control._bind(self, replica_id, hold)


def completion_tokens(ctx: RequestCtx) -> int | None:
    """The completion's length: the engine's usage when the gateway read it (non-streaming
    answers, streams with include_usage), else the token events relayed (one per engine
    step; speculative decoding would put several in one, so a lower bound there)."""
    usage = ctx.usage
    if usage and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    opened = ctx.stream.opened
    if opened is None:
        return None
    head = sum(1 for e in opened.head if e.kind is Kind.TOKEN)
    # The relayed events after the head, less the closing [DONE].
    return max(0, head + max(ctx.stream.events - 1, 0))


class AdmissionControl:
    def __init__(
        self,
        config: ControlConfig,
        metrics: Metrics | None = None,
        lengths: OutputLengths | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        self.lengths = lengths or OutputLengths()
        self._replicas: dict[str, _Replica] = {}
        self._labels: dict[str, str] = {}  # replica -> cause label last exported
        # Requests attached before their key had an estimate (a cold start, a new tenant),
        # by (model, length class): the completions that can give them one. They reserve
        # the worst case until one arrives, then what it says (`_rebase`).
        self._cold: dict[tuple[str, str], set[AdmissionTicket]] = {}
        # This gateway's share of a replica (1.0 alone; the fleet leader's grant otherwise).
        self.quota_of: Callable[[str], float] = lambda replica_id: 1.0

    def _replica(self, replica_id: str) -> _Replica:
        r = self._replicas.get(replica_id)
        if r is None:
            r = self._replicas[replica_id] = _Replica(ReplicaAdmission(self.config))
        return r

    # -- request path ----------------------------------------------------------------

    def attach(
        self,
        ctx: RequestCtx,
        prompt_tokens: int,
        max_tokens: int,
        worst_tokens: int,
        priority: int,
    ) -> None:
        """Give the request its demand. `max_tokens` is the output ceiling and
        `worst_tokens` what today's rule reserves (prompt + max_tokens, clamped to the
        model's context); the output ceiling is clamped the same way."""
        key = (ctx.model, ctx.tier, ctx.tenant)
        ceiling = max(0, min(max_tokens, worst_tokens - prompt_tokens))
        estimate = self.lengths.estimate(key, ceiling)
        ticket = AdmissionTicket(self, Demand.of(prompt_tokens, ceiling, estimate, priority), key)
        ctx.reserve_tokens = ReserveTokens(worst_tokens, ticket)
        ctx.admission = ticket
        if estimate is None:
            self._cold.setdefault(_cold_group(ticket), set()).add(ticket)

    def saturation(
        self,
        replica_id: str,
        load: EngineLoad,
        now: float,
        need_tokens: int,
        in_flight: int,
        quota: float = 1.0,
    ) -> str | None:
        """None when the replica may take the request, else why not. A plain int (no
        demand attached: the admin view, a probe) is judged as a request of that many
        tokens with no estimate. `in_flight`: the ledger's count of attempts open there
        (fewer than this gateway has bound means some were released). `quota`: this
        gateway's share of the replica."""
        r = self._replica(replica_id)
        if len(r.bound) > in_flight:
            self._purge(replica_id, r, now)
        self._observe(replica_id, r, load, now)
        decision = r.controller.decide(_demand_of(need_tokens), r.reserved, load, now, quota)
        if isinstance(decision, Admit):
            return None
        return decision.reason

    def hold(self, replica_id: str, need_tokens: int, now: float) -> Hold | None:
        """The decision for a request on one replica, with its Retry-After (or None when it
        would be admitted or the replica has not been seen)."""
        r = self._replicas.get(replica_id)
        if r is None or r.load is None:
            return None
        decision = r.controller.decide(
            _demand_of(need_tokens), r.reserved, r.load, now, self.quota_of(replica_id)
        )
        return decision if isinstance(decision, Hold) else None

    def reserved_blocks(self, replica_id: str, now: float) -> float:
        """What this gateway holds on the replica, in blocks at the level it admits at
        (what it reports to the fleet leader as its demand's `held`)."""
        r = self._replicas.get(replica_id)
        if r is None or not r.reserved.requests:
            return 0.0
        level = r.controller.effective_level(r.load, now) if r.load is not None else 1.0
        return r.reserved.total_at(level, self.config.spread_z)

    def retry_after_s(self, replica_ids: list[str], need_tokens: int, now: float) -> float | None:
        """When the request could next be admitted somewhere: the soonest over the
        replicas that hold it; None when no replica can estimate it yet."""
        best = math.inf
        for rid in replica_ids:
            h = self.hold(rid, need_tokens, now)
            if h is not None and h.retry_after_s is not None:
                best = min(best, h.retry_after_s)
        return None if math.isinf(best) else best

    def observe(self, replica_id: str, load: EngineLoad, now: float) -> None:
        """A new snapshot's load for the replica (the fleet monitor's listener calls this
        for each replica whose view a publish changed, so the controller follows the engine
        with no request arriving; a load already seen is passed over)."""
        self._observe(replica_id, self._replica(replica_id), load, now)

    def _observe(self, replica_id: str, r: _Replica, load: EngineLoad, now: float) -> None:
        if r.load is not None and load.scraped_at <= r.load.scraped_at:
            return
        r.load = load
        if load.kv_block_size:
            r.block_size = load.kv_block_size
        r.controller.observe(load, r.reserved, now, self.quota_of(replica_id))
        if self.metrics is not None:
            cause = r.controller.cause.value
            old = self._labels.get(replica_id)
            if old is not None and old != cause:
                self.metrics.admission_reserve_level.remove(replica_id, old)
            self._labels[replica_id] = cause
            level = r.controller.effective_level(load, now)
            self.metrics.admission_reserve_level.labels(replica_id, cause).set(level)

    def _bind(self, ticket: AdmissionTicket, replica_id: str, hold: LedgerHold) -> None:
        r = self._replica(replica_id)
        held = ticket.bound.get(replica_id)
        if held is not None:  # the same replica again (a migration back): keep one reservation
            ticket.bound[replica_id] = (hold, held[1])
            return
        ticket.bound[replica_id] = (hold, r.block_size)
        r.bound.add(ticket)
        r.reserved = r.reserved.add(ticket.demand, r.block_size)

    def _unbind(self, ticket: AdmissionTicket, replica_id: str, now: float) -> None:
        held = ticket.bound.pop(replica_id, None)
        r = self._replicas.get(replica_id)
        if held is None or r is None:
            return
        r.bound.discard(ticket)
        r.reserved = r.reserved.remove(ticket.demand, held[1])
        r.controller.completed(now)

    def _purge(self, replica_id: str, r: _Replica, now: float) -> None:
        for ticket in [t for t in r.bound if t.bound[replica_id][0].released]:
            self._unbind(ticket, replica_id, now)

    def finish(self, ctx: RequestCtx, now: float) -> None:
        """The request ended (every hold of it released): give back what it still reserves,
        and learn its length if it completed (status 200, no error, not migrated)."""
        ticket = ctx.admission
        if not isinstance(ticket, AdmissionTicket):
            return
        ctx.admission = None  # once
        if self._cold:
            self._forget_cold(ticket)
        for replica_id in list(ticket.bound):
            self._unbind(ticket, replica_id, now)
        if ctx.status == 200 and not ctx.error and not ctx.stream.migrations:
            tokens = completion_tokens(ctx)
            if tokens is not None:
                self.lengths.observe(ticket.key, ticket.demand.max_tokens, tokens)
                if self._cold:
                    self._rebase(_cold_group(ticket))

    def _forget_cold(self, ticket: AdmissionTicket) -> None:
        group = _cold_group(ticket)
        tickets = self._cold.get(group)
        if tickets is not None:
            tickets.discard(ticket)
            if not tickets:
                del self._cold[group]

    def _rebase(self, group: tuple[str, str]) -> None:
        """Give the requests that arrived before any estimate (in flight, or waiting in the
        queue) the one that now exists: without it, a fresh gateway's first requests hold
        the worst case for their whole run (an EOS-sampled one up to `max_tokens` steps),
        and the requests behind them wait for room the engine has. The estimate is shrunk
        toward `max_tokens` while it rests on few completions (`OutputLengths.estimate`),
        and the engine's own gauges still tighten the level if it is wrong. Only the
        completion's own group can have learned anything (estimates fall back within a
        model and length class), so only its tickets are looked at."""
        cold = self._cold.get(group)
        if not cold:
            return
        for ticket in list(cold):
            old = ticket.demand
            estimate = self.lengths.estimate(ticket.key, old.max_tokens)
            if estimate is None:
                continue  # `min_samples` not reached yet for this key
            self._forget_cold(ticket)
            new = Demand.of(old.prompt_tokens, old.max_tokens, estimate, old.priority)
            ticket.demand = new
            for replica_id, (_, block_size) in ticket.bound.items():
                r = self._replicas.get(replica_id)
                if r is not None:
                    r.reserved = r.reserved.remove(old, block_size).add(new, block_size)

    def forget(self, replica_id: str) -> None:
        """The replica left the fleet."""
        self._replicas.pop(replica_id, None)
        old = self._labels.pop(replica_id, None)
        if old is not None and self.metrics is not None:
            self.metrics.admission_reserve_level.remove(replica_id, old)

    # -- views -----------------------------------------------------------------------

    def state(self, replica_id: str, now: float) -> ControlState | None:
        r = self._replicas.get(replica_id)
        if r is None:
            return None
        return r.controller.state(r.reserved, r.load, now)

    def lengths_view(self) -> dict[str, dict[str, float]]:
        """The learned output lengths, for the admin API."""
        return {
            k: {
                "expected_tokens": round(e.expected_tokens, 1),
                "spread_tokens": round(e.spread_tokens, 1),
                "samples": e.samples,
            }
            for k, e in self.lengths.known().items()
        }

    def describe(self, replica_id: str, now: float) -> dict[str, Any] | None:
        """The admin API's view of one replica's controller."""
        s = self.state(replica_id, now)
        if s is None:
            return None
        r = self._replicas[replica_id]
        return {
            "mode": "adaptive",
            "reserve_level": round(s.reserve_level, 3),
            "learned_level": round(s.learned_level, 3),
            "cause": s.cause.value,
            "why": s.why,
            "limit_kv_blocks": None if s.limit_blocks is None else round(s.limit_blocks, 1),
            "reserved_kv_blocks": round(s.reserved_blocks, 1),
            "requests": r.reserved.requests,
            "expected_kv_blocks": r.reserved.expected_blocks,
            "worst_kv_blocks": r.reserved.worst_blocks,
            "kv_usage": None if s.kv_usage is None else round(s.kv_usage, 4),
            "kv_trend_per_s": round(s.kv_trend_per_s, 4),
            "preemptions_per_s": round(s.preemption_rate_per_s, 3),
            "completions_per_s": round(s.completions_per_s, 3),
            "metrics_age_s": None if s.metrics_age_s is None else round(s.metrics_age_s, 2),
        }


def _cold_group(ticket: AdmissionTicket) -> tuple[str, str]:
    return ticket.key[0], length_class(ticket.demand.max_tokens)


class Combined(int):
    """Several requests' worst-case tokens as one int, carrying their summed `Demand`."""

    demand: Demand

    def __new__(cls, worst_tokens: int, demand: Demand) -> Combined:
        obj = super().__new__(cls, worst_tokens)
        obj.demand = demand
        return obj


def combined(needs: list[int]) -> int:
    """Several requests' needs as one, for either admission mode (a turn's room, held beside
    a fresh request's): worst-case tokens add (what the reserve rule reads as an int), and
    for the adaptive controller tokens and expected lengths add and spreads add as
    variances, with the first one's priority. Whole blocks are taken of the sum, so it may
    come out a block or so under the requests' blocks apart."""
    demands = [_demand_of(n) for n in needs]
    return Combined(
        sum(int(n) for n in needs),
        Demand(
            sum(d.prompt_tokens for d in demands),
            sum(d.max_tokens for d in demands),
            sum(d.expected_tokens for d in demands),
            math.sqrt(sum(d.spread_tokens**2 for d in demands)),
            demands[0].priority,
        ),
    )


def _demand_of(need_tokens: int) -> Demand:
    if isinstance(need_tokens, (ReserveTokens, Combined)):
        return need_tokens.demand
    return Demand(0, int(need_tokens), float(need_tokens), 0.0)
