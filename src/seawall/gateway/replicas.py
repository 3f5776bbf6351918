"""The gateway's own, request-path view of each replica, and the choice of one.

Owns what only the request path knows: chunks relayed and the quality the gateway sees
(TTFT, ITL, errors), short passive ejections (a replica that refuses connections is
skipped at once, before any monitor notices), and engine back-off (an upstream 429/503
marks the replica saturated for its Retry-After). In-flight counts belong to the ledger
(`inflight.py`); each replica holds a reference to its own `Counts` there. What the
fleet monitor knows (readiness, operator holds, health score, scraped load) arrives as
an immutable `FleetSnapshot` that is read, never waited on.

On a follower instance (several gateways, one fleet leader: `seawall.cluster`) the
snapshot is the leader's published view, and this instance adds passive outlier
detection from the requests it relays (`policy.outlier`: consecutive replica faults
eject a replica from this instance's routing for a while), enabled by setting
`ReplicaSet.outlier_rule`. The leader probes, so it runs without.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from seawall import clock
from seawall.cluster.report import ReplicaReport
from seawall.fleet.signals import Observed
from seawall.fleet.view import FleetSnapshot, ReplicaView
from seawall.gateway.h1 import Endpoint
from seawall.gateway.inflight import Counts, InFlight
from seawall.policy import outlier
from seawall.policy.balance import pick, replica_cost

log = logging.getLogger("seawall.gateway")

# Weight of the newest sample in the gateway's moving averages: about the last 20 requests.
_EWMA_ALPHA = 0.05


@dataclass(slots=True)
class Replica:
    id: str
    url: str
    model: str | None
    node: str | None  # None: its own failure domain (see seawall.config.ReplicaConfig)
    api_key: str | None = None
    engine: str = "auto"
    model_name: str | None = None  # the public name, when it is not `model` (aliases.py)
    pool: str = "default"  # the group it fails with (gateway/pools.py routes by it)
    kv_block_size: int = 16  # learned from the engine's cache config; vLLM's default
    chunks_relayed: int = 0
    ejected_until: float = 0.0
    backoff_until: float = 0.0
    # Gateway-observed quality, fed to the health score.
    ttft_ewma_s: float | None = None
    itl_ewma_s: float | None = None
    error_ewma: float = 0.0
    # Passive outlier detection (followers): the rule's state, and how long it is out.
    outlier_state: outlier.OutlierState = field(default_factory=outlier.OutlierState)
    outlier_until: float = 0.0
    on_outcome: Callable[[Replica, bool], None] | None = None
    endpoint: Endpoint = field(init=False)
    # This replica's live counts in the in-flight ledger (set by `ReplicaSet.add`).
    counts: Counts = field(init=False, default_factory=Counts)

    def __post_init__(self) -> None:
        self.endpoint = Endpoint.parse(self.url)

    @property
    def public(self) -> str | None:
        """The name clients ask for: its alias, else the served model (None: not known yet)."""
        return self.model_name or self.model

    def observe_ttft(self, seconds: float) -> None:
        prev = self.ttft_ewma_s
        self.ttft_ewma_s = seconds if prev is None else prev + _EWMA_ALPHA * (seconds - prev)

    def observe_itl(self, seconds: float) -> None:
        prev = self.itl_ewma_s
        self.itl_ewma_s = seconds if prev is None else prev + _EWMA_ALPHA * (seconds - prev)

    def observe_outcome(self, ok: bool) -> None:
        """One request's outcome; `ok=False` only for a fault of the replica's."""
        self.error_ewma += _EWMA_ALPHA * ((0.0 if ok else 1.0) - self.error_ewma)
        if self.on_outcome is not None:
            self.on_outcome(self, ok)


_ALWAYS_ROUTABLE = ReplicaView("", "", "", "")


class ReplicaSet:
    def __init__(self, ledger: InFlight, rng: random.Random | None = None) -> None:
        self._replicas: dict[str, Replica] = {}
        self._ledger = ledger
        self._rng = rng or random.Random()
        self.snapshot: Callable[[], FleetSnapshot] = lambda: FleetSnapshot()
        # Admission's verdict per replica (None = may take work); default: the snapshot's.
        self.saturation: Callable[[Replica, ReplicaView, float, int], str | None] = (
            lambda r, v, now, need: v.saturation_reason or ("saturated" if v.saturated else None)
        )
        self._outlier_rule: outlier.OutlierRule | None = None

    @property
    def outlier_rule(self) -> outlier.OutlierRule | None:
        return self._outlier_rule

    @outlier_rule.setter
    def outlier_rule(self, rule: outlier.OutlierRule | None) -> None:
        """None turns passive outlier detection off and lifts its ejections (a leader's
        own probes judge the replicas)."""
        self._outlier_rule = rule
        if rule is None:
            for r in self._replicas.values():
                r.outlier_state, r.outlier_until = outlier.OutlierState(), 0.0

    def add(self, replica: Replica) -> None:
        replica.counts = self._ledger.counts(replica.id)
        replica.on_outcome = self._outcome
        self._replicas[replica.id] = replica

    def _outcome(self, replica: Replica, ok: bool) -> None:
        rule = self._outlier_rule
        if rule is None:
            return
        state, eject = outlier.observe(replica.outlier_state, ok, rule)
        if eject:
            now = clock.monotonic()
            peers = [r for r in self._replicas.values() if r.model == replica.model]
            ejected = sum(1 for r in peers if r.outlier_until > now)
            if outlier.may_eject(ejected, len(peers), rule):
                out_s = outlier.ejection_s(state.ejections, rule)
                replica.outlier_until = now + out_s
                log.warning(
                    "replica %s ejected for %.0f s: %d failures in a row (outlier detection)",
                    replica.id,
                    out_s,
                    rule.consecutive_failures,
                )
            else:
                state = dataclasses.replace(state, ejections=state.ejections - 1)
        replica.outlier_state = state

    def remove(self, replica_id: str) -> Replica | None:
        self._ledger.forget(replica_id)
        return self._replicas.pop(replica_id, None)

    def get(self, replica_id: str) -> Replica | None:
        return self._replicas.get(replica_id)

    def all(self) -> list[Replica]:
        return list(self._replicas.values())

    def __iter__(self) -> Iterator[Replica]:
        """The replicas in place (no copy: do not add or remove while iterating)."""
        return iter(self._replicas.values())

    def models(self) -> list[str]:
        """The public names (what clients ask for and `/v1/models` lists)."""
        return sorted({name for r in self._replicas.values() if (name := r.public)})

    def serves(self, model: str) -> bool:
        for r in self._replicas.values():  # noqa: SIM110 (per request: no generator)
            if r.public == model:
                return True
        return False

    def view(self, replica: Replica, snap: FleetSnapshot) -> ReplicaView:
        return snap.replicas.get(replica.id, _ALWAYS_ROUTABLE)

    def usable(self, replica: Replica, now: float, snap: FleetSnapshot) -> bool:
        """Routable for a new request, ignoring admission saturation."""
        if replica.ejected_until > now or replica.backoff_until > now:
            return False
        if replica.outlier_until > now:
            return False
        return self.view(replica, snap).routable

    def candidates(
        self,
        model: str,
        now: float,
        exclude: Iterable[str] = (),
        need_tokens: int = 0,
        pool: str | None = None,
    ) -> tuple[list[Replica], list[Replica]]:
        """(usable and not saturated, usable but saturated) replicas serving `model`, for a
        request that may grow to `need_tokens` KV tokens; with `pool`, in that pool only."""
        snap = self.snapshot()
        skip = set(exclude)
        free: list[Replica] = []
        saturated: list[Replica] = []
        for r in self._replicas.values():
            # An aliased replica is chosen once its served name is known (sent upstream).
            if r.public != model or r.model is None or r.id in skip:
                continue
            if pool is not None and r.pool != pool:
                continue
            if not self.usable(r, now, snap):
                continue
            view = self.view(r, snap)
            (saturated if self.saturation(r, view, now, need_tokens) else free).append(r)
        return free, saturated

    def pools_serving(self, model: str) -> set[str]:
        """The pools with at least one replica serving `model` (routable or not)."""
        return {r.pool for r in self._replicas.values() if r.public == model}

    def choose(self, candidates: list[Replica]) -> Replica | None:
        snap = self.snapshot()

        def cost(r: Replica) -> float:
            v = snap.replicas.get(r.id)
            if v is None:
                return replica_cost(r.counts.requests, 1.0, None)
            return replica_cost(r.counts.requests, v.score, v.load.kv_usage if v.load else None)

        return pick(candidates, cost, self._rng)

    def any_ready(self, now: float) -> bool:
        snap = self.snapshot()
        return any(r.model and self.usable(r, now, snap) for r in self._replicas.values())


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks `tokens` occupy: whole blocks, as the engine allocates them."""
    return -(-tokens // max(block_size, 1)) if tokens > 0 else 0


class ReplicaSignals:
    """The fleet monitor's `GatewaySignals`, from this gateway's ledger and replicas.

    The gateway keeps moving averages rather than percentiles; they stand in for p50."""

    def __init__(self, replicas: ReplicaSet, ledger: InFlight) -> None:
        self._replicas = replicas
        self._ledger = ledger

    def requests_in_flight(self, replica_id: str) -> int:
        return self._ledger.counts(replica_id).requests

    def streams_in_flight(self, replica_id: str) -> int:
        return self._ledger.counts(replica_id).streams

    def chunks_relayed_total(self, replica_id: str) -> int:
        r = self._replicas.get(replica_id)
        return r.chunks_relayed if r is not None else 0

    def observed(self, replica_id: str) -> Observed:
        r = self._replicas.get(replica_id)
        if r is None:
            return Observed()
        return Observed(r.ttft_ewma_s, r.itl_ewma_s, r.error_ewma)

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        """Until nothing is in flight on the replica, or the monotonic `deadline`."""
        return await self._ledger.wait_zero(replica_id, deadline)


def replica_reports(
    replicas: ReplicaSet, demand: Callable[[Replica], dict[str, float]] | None = None
) -> dict[str, ReplicaReport]:
    """This instance's heartbeat report per replica (`seawall.cluster.report`): its
    in-flight counts and EWMAs, and `demand` (a seam for leader-issued quotas)."""
    return {
        r.id: ReplicaReport(
            requests=r.counts.requests,
            streams=r.counts.streams,
            kv_blocks=r.counts.kv_blocks,
            chunks_relayed=r.chunks_relayed,
            ttft_ewma_s=r.ttft_ewma_s,
            itl_ewma_s=r.itl_ewma_s,
            error_ewma=r.error_ewma,
            demand=demand(r) if demand is not None else {},
        )
        for r in replicas.all()
    }
