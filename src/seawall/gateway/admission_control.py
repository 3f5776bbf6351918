"""The shell around the adaptive KV admission controller (`policy.adaptive_admission`).

Owns the controller instances (one per replica), this gateway's reservation sums per
replica, and the learned output lengths. It is fed from three places, each a one-line
hook so the request path's shape can change around it:

- `TenancyGuard.admit` calls `attach` once the prompt is counted and `max_tokens` decided:
  the request's `Demand` (prompt, ceiling, learned estimate, tier priority) rides on
  `ctx.reserve_tokens` (a `ReserveTokens`, an int worth today's worst-case tokens, so every
  caller that passes an int still works) and `ctx.admission` (a `Ticket`);
- `TenancyGuard` subscribes `observe` to the fleet monitor's snapshots, so every new scrape
  reaches the replica's controller even when no request arrives; `TenancyGuard.saturation`
  calls `saturation` per replica and candidate request for the decision (feeding the scrape
  too, if the listener has not yet), and `_fleet_admission` asks `retry_after_s` for the
  Retry-After of a 429 when every replica holds;
- the proxy calls `Ticket.bind` where it reserves KV on a replica for an attempt, and
  `Ticket.release` where it releases it, with the completion's usage when there is one.

Must not: block, read the clock (the caller passes `now`), or decide anything itself: the
rules are the policy module's. With several gateways (issue 15) the `Reservations` kept
here become a shared count; nothing else here changes.
"""

from __future__ import annotations

import math
import re
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
)

if TYPE_CHECKING:
    from seawall.gateway.metrics import Metrics
    from seawall.gateway.proxy import RequestCtx
    from seawall.gateway.upstream import Opened

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')


class ReserveTokens(int):
    """Today's worst-case reservation in tokens (prompt + max_tokens), as an int, carrying
    the request's `Demand` to the controller through code that passes only an int."""

    demand: Demand

    def __new__(cls, worst_tokens: int, demand: Demand) -> ReserveTokens:
        obj = super().__new__(cls, worst_tokens)
        obj.demand = demand
        return obj


@dataclass(slots=True)
class _Replica:
    controller: ReplicaAdmission
    reserved: Reservations = field(default_factory=Reservations)
    load: EngineLoad | None = None
    block_size: int = 16


class Ticket:
    """One request's handle: where it is bound, so its reservation is released exactly once
    per replica, and its key for learning its length."""

    __slots__ = ("bound", "control", "demand", "key")

    def __init__(self, control: AdmissionControl, demand: Demand, key: tuple[str, str, str]):
        self.control = control
        self.demand = demand
        self.key = key
        self.bound: dict[str, int] = {}  # replica id -> block size used when bound

    def bind(self, replica_id: str) -> None:
        self.control._bind(self, replica_id)

    def release(self, replica_id: str, ctx: RequestCtx, opened: Opened | None, now: float) -> None:
        """The attempt on `replica_id` is over. A completed one (status 200, no error, not
        migrated) teaches its length."""
        tokens = None
        if opened is not None and ctx.status == 200 and not ctx.error and not ctx.migrations:
            tokens = completion_tokens(ctx, opened)
        self.control._release(self, replica_id, tokens, now)


def completion_tokens(ctx: RequestCtx, opened: Opened) -> int | None:
    """The completion's length: the engine's usage when the gateway has it, else the body's
    usage (non-streaming), else the token events relayed (one per engine step; speculative
    decoding would put several in one, so it is a lower bound there)."""
    usage = ctx.usage
    if usage and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    if opened.body is not None:
        m = _COMPLETION_TOKENS.search(opened.body)
        return int(m.group(1)) if m else None
    from seawall.protocol.sse import Kind

    head = sum(1 for e in opened.head if e.kind is Kind.TOKEN)
    # The relayed events after the head, less the closing [DONE].
    return max(0, head + max(ctx.stream_events - 1, 0))


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
        demand = Demand.of(prompt_tokens, ceiling, estimate, priority)
        ctx.reserve_tokens = ReserveTokens(worst_tokens, demand)
        ctx.admission = Ticket(self, demand, key)

    def saturation(
        self, replica_id: str, load: EngineLoad, now: float, need_tokens: int
    ) -> str | None:
        """None when the replica may take the request, else why not. A plain int (no
        demand attached: the admin view, a probe) is judged as a request of that many
        tokens with no estimate."""
        r = self._replica(replica_id)
        self._observe(replica_id, r, load, now)
        decision = r.controller.decide(_demand_of(need_tokens), r.reserved, load, now)
        if isinstance(decision, Admit):
            return None
        return decision.reason

    def hold(self, replica_id: str, need_tokens: int, now: float) -> Hold | None:
        """The decision for a request on one replica, with its Retry-After (or None when it
        would be admitted or the replica has not been seen)."""
        r = self._replicas.get(replica_id)
        if r is None or r.load is None:
            return None
        decision = r.controller.decide(_demand_of(need_tokens), r.reserved, r.load, now)
        return decision if isinstance(decision, Hold) else None

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
        """A new snapshot's load for the replica (the fleet monitor's listener calls this on
        every publish, so the controller follows the engine with no request arriving)."""
        self._observe(replica_id, self._replica(replica_id), load, now)

    def _observe(self, replica_id: str, r: _Replica, load: EngineLoad, now: float) -> None:
        if r.load is not None and load.scraped_at <= r.load.scraped_at:
            return
        r.load = load
        if load.kv_block_size:
            r.block_size = load.kv_block_size
        r.controller.observe(load, r.reserved, now)
        if self.metrics is not None:
            cause = r.controller.cause.value
            old = self._labels.get(replica_id)
            if old is not None and old != cause:
                self.metrics.admission_reserve_level.remove(replica_id, old)
            self._labels[replica_id] = cause
            level = r.controller.effective_level(load, now)
            self.metrics.admission_reserve_level.labels(replica_id, cause).set(level)

    def _bind(self, ticket: Ticket, replica_id: str) -> None:
        if replica_id in ticket.bound:
            return
        r = self._replica(replica_id)
        ticket.bound[replica_id] = r.block_size
        r.reserved = r.reserved.add(ticket.demand, r.block_size)

    def _release(self, ticket: Ticket, replica_id: str, tokens: int | None, now: float) -> None:
        block = ticket.bound.pop(replica_id, None)
        if block is None:
            return
        r = self._replica(replica_id)
        r.reserved = r.reserved.remove(ticket.demand, block)
        r.controller.completed(now)
        if tokens is not None:
            self.lengths.observe(ticket.key, ticket.demand.max_tokens, tokens)

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
            "preemptions_per_s": round(s.preemption_rate_per_s, 3),
            "completions_per_s": round(s.completions_per_s, 3),
            "metrics_age_s": None if s.metrics_age_s is None else round(s.metrics_age_s, 2),
        }


def _demand_of(need_tokens: int) -> Demand:
    if isinstance(need_tokens, ReserveTokens):
        return need_tokens.demand
    return Demand(0, int(need_tokens), float(need_tokens), 0.0)
