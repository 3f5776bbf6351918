"""The pool router: which pools a request may use, in which order, and the events when
a model's traffic moves between pools.

The decisions are pure (`policy/pools.py` for the serving pool and a request's order,
`policy/circuit.py` for a remote pool's breaker); this shell feeds them the fleet as the
request path sees it. `reach` is what the dispatcher and fleet admission ask per request:
it walks the tier's pool order and returns the candidate replicas of the first pool that
keeps the request, going on to the next pool only where the tier allows it (the pool is
saturated and the tier may overflow, or it has no routable replica and the tier may fail
over). `observe` runs on every fleet snapshot and on a short tick (hysteresis is about
time), steps each model's serving pool, and reports failovers and failbacks (log,
metrics, the restart ledger's pool events, the admin API).

With one pool (the default) `reach` is exactly the single-pool rule the gateway always
had: free replicas, else saturated ones.

Must not: choose a replica within a pool (the balancer does), or await anything on the
request path.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from seawall.config import DEFAULT_POOL, PoolConfig
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.policy import circuit
from seawall.policy.pools import (
    Change,
    PoolEvent,
    PoolHealth,
    PoolSpec,
    SelectorState,
    TierPools,
    may_enter,
    may_leave,
    route_order,
    step,
)
from seawall.values import frozen

log = logging.getLogger("seawall.pools")

HISTORY = 50  # pool events kept for the admin API


@frozen
class Reach:
    """Where a request may go now: the candidates of the pool that keeps it."""

    free: list[Replica]
    saturated: list[Replica]
    pool: str | None  # the pool they are in (None: no pool has a candidate)
    # Why nothing usable remains, when nothing does and a pool refused to pass the
    # request on: the client is told (503 with Retry-After), not a generic "no replica".
    refused_by: str | None = None


def one_pool_reach(
    replicas: ReplicaSet,
    model: str,
    now: float,
    exclude: Iterable[str] = (),
    need_tokens: int = 0,
) -> Reach:
    """A fleet of one pool: the replica set's own candidates (today's routing exactly)."""
    free, saturated = replicas.candidates(model, now, exclude, need_tokens)
    return Reach(free, saturated, DEFAULT_POOL if free or saturated else None)


@dataclass
class _Pool:
    spec: PoolSpec
    config: PoolConfig
    breaker: circuit.Breaker | None
    breaker_state: circuit.BreakerState = field(default_factory=circuit.BreakerState)


class PoolRouter:
    def __init__(
        self,
        pools: Mapping[str, PoolConfig],
        replicas: ReplicaSet,
        failover_after_s: float,
        failback_after_s: float,
        on_event: Callable[[PoolEvent], None] | None = None,
    ) -> None:
        self.replicas = replicas
        self.failover_after_s = failover_after_s
        self.failback_after_s = failback_after_s
        self._pools = {
            name: _Pool(
                PoolSpec(name, cfg.priority, cfg.mode == "passive"),
                cfg,
                circuit.Breaker(cfg.breaker.failures, cfg.breaker.open_s) if cfg.breaker else None,
            )
            for name, cfg in pools.items()
        }
        if DEFAULT_POOL not in self._pools:
            self._pools[DEFAULT_POOL] = _Pool(PoolSpec(DEFAULT_POOL), PoolConfig(), None)
        self._states: dict[str, SelectorState] = {}
        self._on_event = on_event
        self.history: deque[PoolEvent] = deque(maxlen=HISTORY)
        self.single = len(pools) <= 1  # the default: one pool, today's routing exactly

    # -- per request -------------------------------------------------------------------

    def serving(self, model: str) -> str | None:
        state = self._states.get(model)
        return state.serving if state is not None else None

    def reach(
        self,
        model: str,
        tier: TierPools,
        now: float,
        exclude: Iterable[str] = (),
        need_tokens: int = 0,
    ) -> Reach:
        if self.single:
            return one_pool_reach(self.replicas, model, now, exclude, need_tokens)
        specs = self._specs_serving(model)
        skip = set(exclude)
        # If no pool has room, the request waits (or is shed) in the first pool it could
        # have used, not in the last one it looked at.
        queue_in: Reach | None = None
        serving = self.serving(model)
        failing_over = False  # why the request moved on from the pool before this one
        for name in route_order(serving, specs, tier):
            pool = self._pools[name]
            # A passive pool, even first in a tier's own order, waits for a failover.
            if not may_enter(pool.spec, serving, failing_over):
                continue
            free: list[Replica] = []
            saturated: list[Replica] = []
            if pool.breaker is None or circuit.routable(pool.breaker, pool.breaker_state, now):
                free, saturated = self.replicas.candidates(model, now, skip, need_tokens, name)
            if free:
                return Reach(free, saturated, name)
            if saturated and queue_in is None:
                queue_in = Reach([], saturated, name)
            if not may_leave(tier, PoolHealth(len(saturated), saturated=bool(saturated))):
                if queue_in is not None:
                    return queue_in
                return Reach([], [], None, refused_by=name)
            failing_over = not saturated
        return queue_in or Reach([], [], None)

    def timeouts(self, pool: str) -> PoolConfig | None:
        p = self._pools.get(pool)
        return p.config if p is not None else None

    def allows(self, pool: str, now: float) -> bool:
        """Take the breaker's trial, if any: may one more attempt go to `pool` now?"""
        p = self._pools.get(pool)
        if p is None or p.breaker is None:
            return True
        ok, p.breaker_state = circuit.allows(p.breaker, p.breaker_state, now)
        return ok

    def record(self, pool: str, ok: bool, now: float) -> None:
        """An attempt's outcome, for the pool's breaker."""
        p = self._pools.get(pool)
        if p is not None and p.breaker is not None:
            before = p.breaker_state.circuit
            p.breaker_state = circuit.record(p.breaker, p.breaker_state, ok, now)
            after = p.breaker_state.circuit
            if after is not before:
                log.warning("pool %s: circuit %s -> %s", pool, before, after)

    # -- off the request path ------------------------------------------------------------

    def observe(self, now: float) -> None:
        """Step every model's serving pool (on each snapshot, and on a tick)."""
        if self.single:
            return
        for model in self.replicas.models():
            specs = self._specs_serving(model)
            if not specs:
                continue
            health = {}
            for s in specs:
                pool = self._pools[s.name]
                if pool.breaker is not None and not circuit.routable(
                    pool.breaker, pool.breaker_state, now
                ):
                    health[s.name] = PoolHealth(0)
                    continue
                free, saturated = self.replicas.candidates(model, now, pool=s.name)
                health[s.name] = PoolHealth(
                    len(free) + len(saturated), not free and bool(saturated)
                )
            before = self._states.get(model, SelectorState())
            after, events = step(
                before, model, specs, health, now, self.failover_after_s, self.failback_after_s
            )
            self._states[model] = after
            for e in events:
                self.history.append(e)
                if e.change is not Change.first:
                    log.warning(
                        "pool %s for %s: %s -> %s (%s)",
                        e.change.value,
                        model,
                        e.from_pool,
                        e.to_pool,
                        e.reason,
                    )
                if self._on_event is not None:
                    self._on_event(e)

    def describe(self, now: float) -> list[dict[str, object]]:
        """For the admin API and the status page."""
        out = []
        for name, p in sorted(self._pools.items(), key=lambda kv: (kv[1].spec.priority, kv[0])):
            serving = sorted(m for m, st in self._states.items() if st.serving == name)
            members = [r for r in self.replicas.all() if r.pool == name]
            if name == DEFAULT_POOL and not members and not serving:
                continue  # only the fallback for replicas that name no pool: none do
            routable = sum(
                1 for r in members if self.replicas.usable(r, now, self.replicas.snapshot())
            )
            out.append(
                {
                    "pool": name,
                    "priority": p.spec.priority,
                    "mode": "passive" if p.spec.passive else "active",
                    "replicas": len(members),
                    "routable": routable,
                    "serving": serving,
                    "circuit": p.breaker_state.circuit.value if p.breaker else None,
                }
            )
        return out

    def _specs_serving(self, model: str) -> list[PoolSpec]:
        present = self.replicas.pools_serving(model)
        return [p.spec for name, p in self._pools.items() if name in present]
