"""The error-budget model: what crashes and restarts cost a fleet of streaming replicas.

Owns the arithmetic behind `seawall budget` and its what-ifs. Pure: no I/O, no clock;
the CLI gathers the inputs (flags, or a Prometheus server) and prints the result.

The model, in one paragraph (docs/budget.md has the worked example):
- Little's law: the fleet holds `replicas * streams_per_replica` streams in flight on
  average, so requests arrive at `in_flight / mean_stream_s` per second.
- A crash (or a restart after failed deep probes) fails every stream in flight on that
  replica: `streams_per_replica` of them. A planned restart that is not drained does
  the same; a drained one fails none, but keeps the replica out for the drain too.
- While a replica is down the others carry its streams. If they have a stream limit
  (`max_streams_per_replica`) and the load exceeds it, the excess is refused for as long
  as the replica is down. Restarts are assumed not to overlap.
- Workloads share the fleet by request count; a workload's share of the streams in
  flight is its requests times its duration, so long streams lose more per crash.

With pools (`compute_fleet`): the same per pool, plus node and whole-pool losses. A
loss's displaced work goes first to its pool's survivors, then, for the workloads that
may overflow (pool saturated) or fail over (pool without a routable replica), to the
other pools' spare streams; a pool with no replica left fails every arrival until the
gateway notices (`detect_s`). `compute` stays the flat model, unchanged.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    share: float  # fraction of requests; shares are normalised to sum to 1
    stream_s: float  # mean stream duration
    # Pools only (the flat model ignores both): whether this workload's requests may go
    # to another pool when theirs is saturated (overflow) or has no routable replica
    # (failover), as a tier's `TierPools` allows in policy/pools.py.
    overflow: bool = True
    failover: bool = True


@dataclass(frozen=True, slots=True)
class BudgetInputs:
    replicas: int
    streams_per_replica: float  # mean concurrent streams per replica
    slo: float  # availability objective, e.g. 0.999
    window_days: float
    crashes_per_replica: float  # crashes or deep-probe restarts per replica per window
    restart_s: float  # from failure to serving again
    workloads: tuple[Workload, ...]
    rollouts_per_replica: float = 0.0  # planned restarts per replica per window
    rollouts_drained: bool = False
    max_streams_per_replica: float | None = None  # None: survivors absorb any load

    def validate(self) -> None:
        if self.replicas < 1:
            raise ValueError("replicas must be at least 1")
        if not 0 < self.slo < 1:
            raise ValueError("slo must be between 0 and 1, e.g. 0.999")
        if not self.workloads:
            raise ValueError("at least one workload is needed")
        if sum(w.share for w in self.workloads) <= 0:
            raise ValueError("workload shares must add up to more than 0")
        for name, value in (
            ("streams_per_replica", self.streams_per_replica),
            ("window_days", self.window_days),
            ("crashes_per_replica", self.crashes_per_replica),
            ("restart_s", self.restart_s),
            ("rollouts_per_replica", self.rollouts_per_replica),
        ):
            if value < 0:
                raise ValueError(f"{name} must not be negative")
        if self.window_days == 0:
            raise ValueError("window_days must be more than 0")
        for w in self.workloads:
            if w.share < 0 or w.stream_s <= 0:
                raise ValueError(f"workload {w.name}: share >= 0 and stream_s > 0 needed")
        if self.max_streams_per_replica is not None:
            if self.max_streams_per_replica <= 0:
                raise ValueError("max_streams_per_replica must be more than 0")
            if self.max_streams_per_replica < self.streams_per_replica:
                # Then the fleet refuses work with every replica up, and restarts are the
                # least of its problems: this model would understate the failures.
                raise ValueError(
                    "streams_per_replica exceeds max_streams_per_replica: the fleet is "
                    "over its limit even with every replica up; add replicas first"
                )


@dataclass(frozen=True, slots=True)
class WorkloadResult:
    name: str
    requests: float
    inflight_share: float  # of the streams in flight, the fraction of this workload
    failures: float
    availability: float
    meets_slo: bool


@dataclass(frozen=True, slots=True)
class BudgetResult:
    inputs: BudgetInputs
    mean_stream_s: float
    requests_per_s: float
    requests: float  # in the window
    error_budget: float  # failed requests the SLO allows in the window
    crash_failures: float
    rollout_failures: float
    overload_failures: float  # refused while a replica restarts, beyond survivors' limit
    replica_minutes_lost: float
    capacity_lost_pct: float
    workloads: tuple[WorkloadResult, ...] = field(default_factory=tuple)

    @property
    def failures(self) -> float:
        return self.crash_failures + self.rollout_failures + self.overload_failures

    @property
    def budget_used_pct(self) -> float:
        return 100.0 * self.failures / self.error_budget if self.error_budget else float("inf")

    @property
    def within_budget(self) -> bool:
        return self.failures <= self.error_budget

    @property
    def verdict(self) -> str:
        used = f"{self.budget_used_pct:.1f}% of the error budget"
        return f"within budget ({used})" if self.within_budget else f"over budget ({used})"


def compute(i: BudgetInputs) -> BudgetResult:
    i.validate()
    total_share = sum(w.share for w in i.workloads)
    shares = [w.share / total_share for w in i.workloads]
    mean_stream_s = sum(s * w.stream_s for s, w in zip(shares, i.workloads, strict=True))
    in_flight = i.replicas * i.streams_per_replica
    requests_per_s = in_flight / mean_stream_s  # Little's law: L = lambda * W
    window_s = i.window_days * SECONDS_PER_DAY
    requests = requests_per_s * window_s
    error_budget = (1.0 - i.slo) * requests

    crash_failures = i.replicas * i.crashes_per_replica * i.streams_per_replica
    rollouts = i.replicas * i.rollouts_per_replica
    rollout_failures = 0.0 if i.rollouts_drained else rollouts * i.streams_per_replica

    # A drained replica takes no new work and waits for its streams to finish; the mean
    # wait is about one mean stream duration (residual life of a stream in progress).
    rollout_down_s = i.restart_s + (mean_stream_s if i.rollouts_drained else 0.0)
    down_s = i.replicas * i.crashes_per_replica * i.restart_s + rollouts * rollout_down_s

    overload_fraction = 0.0
    if i.max_streams_per_replica is not None and in_flight > 0:
        survivors_capacity = (i.replicas - 1) * i.max_streams_per_replica
        overload_fraction = max(0.0, 1.0 - survivors_capacity / in_flight)
    overload_failures = requests_per_s * down_s * overload_fraction

    stream_failures = crash_failures + rollout_failures
    per_workload = []
    for share, w in zip(shares, i.workloads, strict=True):
        w_requests = requests * share
        inflight_share = share * w.stream_s / mean_stream_s
        w_failures = stream_failures * inflight_share + overload_failures * share
        availability = 1.0 - w_failures / w_requests if w_requests else 1.0
        per_workload.append(
            WorkloadResult(
                w.name, w_requests, inflight_share, w_failures, availability, availability >= i.slo
            )
        )

    return BudgetResult(
        inputs=i,
        mean_stream_s=mean_stream_s,
        requests_per_s=requests_per_s,
        requests=requests,
        error_budget=error_budget,
        crash_failures=crash_failures,
        rollout_failures=rollout_failures,
        overload_failures=overload_failures,
        replica_minutes_lost=down_s / 60.0,
        capacity_lost_pct=100.0 * down_s / (i.replicas * window_s),
        workloads=tuple(per_workload),
    )


def what_ifs(i: BudgetInputs) -> list[tuple[str, BudgetResult]]:
    """The three levers an operator has, one at a time, each against the same traffic."""
    spare = replace(
        i,
        replicas=i.replicas + 1,
        # Same traffic over one more replica: each carries a smaller share.
        streams_per_replica=i.streams_per_replica * i.replicas / (i.replicas + 1),
    )
    return [
        (
            "halve the crash rate",
            compute(replace(i, crashes_per_replica=i.crashes_per_replica / 2)),
        ),
        ("drain rollouts", compute(replace(i, rollouts_drained=True))),
        ("add a spare replica", compute(spare)),
    ]


def as_dict(r: BudgetResult) -> dict[str, object]:
    i = r.inputs
    return {
        "inputs": {
            "replicas": i.replicas,
            "streams_per_replica": i.streams_per_replica,
            "slo": i.slo,
            "window_days": i.window_days,
            "crashes_per_replica": i.crashes_per_replica,
            "restart_s": i.restart_s,
            "rollouts_per_replica": i.rollouts_per_replica,
            "rollouts_drained": i.rollouts_drained,
            "max_streams_per_replica": i.max_streams_per_replica,
            "workloads": [
                {"name": w.name, "share": w.share, "stream_s": w.stream_s} for w in i.workloads
            ],
        },
        "mean_stream_s": r.mean_stream_s,
        "requests_per_s": r.requests_per_s,
        "requests": r.requests,
        "error_budget": r.error_budget,
        "crash_failures": r.crash_failures,
        "rollout_failures": r.rollout_failures,
        "overload_failures": r.overload_failures,
        "failures": r.failures,
        "budget_used_pct": r.budget_used_pct,
        "within_budget": r.within_budget,
        "verdict": r.verdict,
        "replica_minutes_lost": r.replica_minutes_lost,
        "capacity_lost_pct": r.capacity_lost_pct,
        "workloads": [
            {
                "name": w.name,
                "requests": w.requests,
                "inflight_share": w.inflight_share,
                "failures": w.failures,
                "availability": w.availability,
                "meets_slo": w.meets_slo,
            }
            for w in r.workloads
        ],
    }


# --- Pools -------------------------------------------------------------------------------
#
# The same arithmetic over a fleet of pools (policy/pools.py), with two more kinds of
# loss than a replica: a node (several replicas at once) and a whole pool (a region or a
# cluster). What a loss costs depends on where its work can go: first to the surviving
# replicas of its own pool (up to their stream limit), then, for the workloads allowed
# to leave, to the spare streams of the other pools. docs/budget.md has the formulas
# and a worked example.


class Loss(StrEnum):
    crash = "crash"  # one replica, unplanned (crash, deep-probe or watchdog restart)
    rollout = "rollout"  # one replica, planned
    node = "node"  # every replica on one node
    pool = "pool"  # every replica of the pool: a region or a cluster down


@dataclass(frozen=True, slots=True)
class Pool:
    name: str
    replicas: int
    streams_per_replica: float  # mean concurrent streams per replica (0: a passive pool)
    crashes_per_replica: float  # per window, as `BudgetInputs`
    restart_s: float
    max_streams_per_replica: float | None = None  # None: its survivors absorb any load
    priority: int = 0  # shown; the arithmetic lets work go to every other pool
    passive: bool = False
    rollouts_per_replica: float = 0.0
    rollouts_drained: bool = False
    replicas_per_node: int = 1
    node_losses: float = 0.0  # node failures in this pool per window
    node_recovery_s: float = 0.0  # from the node failing to its replicas serving again
    pool_losses: float = 0.0  # whole-pool losses per window
    pool_recovery_s: float = 0.0
    # From the loss to the gateway taking the lost replicas out of routing (liveness
    # interval plus its timeout for a local pool; the circuit breaker for a remote one).
    detect_s: float = 2.0

    def validate(self) -> None:
        where = f"pool {self.name}"
        if not self.name:
            raise ValueError("every pool needs a name")
        if self.replicas < 1:
            raise ValueError(f"{where}: replicas must be at least 1")
        if self.replicas_per_node < 1:
            raise ValueError(f"{where}: replicas_per_node must be at least 1")
        for name, value in (
            ("streams_per_replica", self.streams_per_replica),
            ("crashes_per_replica", self.crashes_per_replica),
            ("restart_s", self.restart_s),
            ("rollouts_per_replica", self.rollouts_per_replica),
            ("node_losses", self.node_losses),
            ("node_recovery_s", self.node_recovery_s),
            ("pool_losses", self.pool_losses),
            ("pool_recovery_s", self.pool_recovery_s),
            ("detect_s", self.detect_s),
        ):
            if not value >= 0:  # also refuses NaN
                raise ValueError(f"{where}: {name} must not be negative")
        if self.node_losses > 0 and self.node_recovery_s == 0:
            raise ValueError(f"{where}: node_losses needs node_recovery_s")
        if self.pool_losses > 0 and self.pool_recovery_s == 0:
            raise ValueError(f"{where}: pool_losses needs pool_recovery_s")
        m = self.max_streams_per_replica
        if m is not None:
            if m <= 0:
                raise ValueError(f"{where}: max_streams_per_replica must be more than 0")
            if m < self.streams_per_replica:
                raise ValueError(
                    f"{where}: streams_per_replica exceeds max_streams_per_replica: the pool "
                    "is over its limit even with every replica up; add replicas first"
                )

    @property
    def spare_streams(self) -> float:
        """Streams this pool can still take with every replica up (inf: no limit)."""
        m = self.max_streams_per_replica
        return math.inf if m is None else self.replicas * (m - self.streams_per_replica)


@dataclass(frozen=True, slots=True)
class FleetInputs:
    pools: tuple[Pool, ...]
    slo: float
    window_days: float
    workloads: tuple[Workload, ...]

    def validate(self) -> None:
        if not self.pools:
            raise ValueError("at least one pool is needed")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be unique: {', '.join(names)}")
        for p in self.pools:
            p.validate()
        if sum(p.replicas * p.streams_per_replica for p in self.pools) <= 0:
            raise ValueError("no pool carries traffic: give a pool streams_per_replica > 0")
        # The fleet-wide checks are the flat model's, on a stand-in with valid pool parts.
        BudgetInputs(
            replicas=1,
            streams_per_replica=1.0,
            slo=self.slo,
            window_days=self.window_days,
            crashes_per_replica=0.0,
            restart_s=0.0,
            workloads=self.workloads,
        ).validate()


@dataclass(frozen=True, slots=True)
class LossResult:
    """One kind of loss in one pool, over the window."""

    pool: str
    kind: Loss
    events: float  # per window
    replicas_out: int
    down_s: float  # each time
    cut_each: float  # streams in flight on the lost replicas, which fail
    spare_here: float  # streams the pool's survivors can still take (inf: no limit)
    spare_elsewhere: float  # spare streams in the other pools (inf: one has no limit)
    absorbed: float  # of the work the lost replicas would have served, the share served
    cut: float  # streams failed in the window
    refused: float  # requests refused (or failed before their first token) in the window
    refused_by_workload: tuple[float, ...]

    @property
    def failures(self) -> float:
        return self.cut + self.refused


@dataclass(frozen=True, slots=True)
class FleetResult:
    inputs: FleetInputs
    mean_stream_s: float
    requests_per_s: float
    requests: float
    error_budget: float
    losses: tuple[LossResult, ...]
    replica_minutes_lost: float
    capacity_lost_pct: float
    workloads: tuple[WorkloadResult, ...]

    def cut_by(self, kind: Loss) -> float:
        return sum(x.cut for x in self.losses if x.kind is kind)

    @property
    def crash_failures(self) -> float:
        return self.cut_by(Loss.crash)

    @property
    def rollout_failures(self) -> float:
        return self.cut_by(Loss.rollout)

    @property
    def node_failures(self) -> float:
        return self.cut_by(Loss.node)

    @property
    def pool_failures(self) -> float:
        return self.cut_by(Loss.pool)

    @property
    def overload_failures(self) -> float:
        return sum(x.refused for x in self.losses)

    @property
    def failures(self) -> float:
        return sum(x.failures for x in self.losses)

    @property
    def budget_used_pct(self) -> float:
        return 100.0 * self.failures / self.error_budget if self.error_budget else float("inf")

    @property
    def within_budget(self) -> bool:
        return self.failures <= self.error_budget

    @property
    def verdict(self) -> str:
        used = f"{self.budget_used_pct:.1f}% of the error budget"
        return f"within budget ({used})" if self.within_budget else f"over budget ({used})"


def _kinds(p: Pool, mean_stream_s: float) -> tuple[tuple[Loss, float, int, float, float], ...]:
    """(kind, events per window, replicas out, seconds out, streams cut each time)."""
    c = p.streams_per_replica
    node = min(p.replicas_per_node, p.replicas)
    # A drained replica waits about one mean stream for its streams to finish (as flat).
    rollout_s = p.restart_s + (mean_stream_s if p.rollouts_drained else 0.0)
    return (
        (Loss.crash, p.replicas * p.crashes_per_replica, 1, p.restart_s, c),
        (
            Loss.rollout,
            p.replicas * p.rollouts_per_replica,
            1,
            rollout_s,
            0.0 if p.rollouts_drained else c,
        ),
        (Loss.node, p.node_losses, node, p.node_recovery_s, node * c),
        (Loss.pool, p.pool_losses, p.replicas, p.pool_recovery_s, p.replicas * c),
    )


def _placed(wanted: float, spare: float) -> float:
    """The share of `wanted` streams that `spare` streams can take."""
    return 1.0 if wanted <= spare else spare / wanted


def compute_fleet(f: FleetInputs) -> FleetResult:
    """The flat model per pool, plus node and pool losses, with the spare streams of
    the other pools taking what the workloads allowed to leave cannot place at home."""
    f.validate()
    total_share = sum(w.share for w in f.workloads)
    shares = [w.share / total_share for w in f.workloads]
    mean_stream_s = sum(s * w.stream_s for s, w in zip(shares, f.workloads, strict=True))
    # A workload's share of the streams in flight, and of those that may leave.
    inflight = [s * w.stream_s / mean_stream_s for s, w in zip(shares, f.workloads, strict=True)]
    overflow_inflight = sum(x for x, w in zip(inflight, f.workloads, strict=True) if w.overflow)
    failover_inflight = sum(x for x, w in zip(inflight, f.workloads, strict=True) if w.failover)
    window_s = f.window_days * SECONDS_PER_DAY
    requests_per_s = sum(p.replicas * p.streams_per_replica for p in f.pools) / mean_stream_s
    requests = requests_per_s * window_s

    losses: list[LossResult] = []
    down_s = 0.0
    for p in f.pools:
        held = p.replicas * p.streams_per_replica  # streams in flight in the pool
        pool_rps = held / mean_stream_s  # Little's law, per pool
        # Losses do not overlap: while this pool loses capacity the others are whole.
        # Overflow goes to active pools only (a passive pool takes traffic by failover);
        # failover to any (policy/pools.py `may_enter`).
        elsewhere = sum(q.spare_streams for q in f.pools if q is not p)
        elsewhere_active = sum(q.spare_streams for q in f.pools if q is not p and not q.passive)
        for kind, events, out, each_s, cut_each in _kinds(p, mean_stream_s):
            down_s += events * out * each_s
            m = p.max_streams_per_replica
            left = p.replicas - out
            refused_each: list[float] = []
            if left > 0:
                # The pool still routes, saturated: the arrivals its survivors cannot
                # hold are shed, or overflow to the other pools if their workload may.
                spare_here = math.inf if m is None else left * (m - p.streams_per_replica)
                excess = 0.0 if m is None else max(0.0, held - left * m)
                full = excess / held if held else 0.0  # share of arrivals with no room
                placed = _placed(overflow_inflight * excess, elsewhere_active)
                for s, w in zip(shares, f.workloads, strict=True):
                    stays = (1.0 - placed) if w.overflow else 1.0
                    refused_each.append(pool_rps * s * full * each_s * stays)
            else:
                # The pool has no routable replica. Until the gateway notices (`detect_s`)
                # it still routes there, and retries stay in a pool that looks healthy:
                # those arrivals fail. Then each request of a workload that may fail
                # over goes on at once (pools.may_leave; no wait for the failover hold),
                # as far as the other pools' spare streams reach; the others get a 503.
                spare_here = 0.0
                blind_s = min(p.detect_s, each_s)
                placed = _placed(failover_inflight * held, elsewhere)
                for s, w in zip(shares, f.workloads, strict=True):
                    stays = (1.0 - placed) if w.failover else 1.0
                    refused_each.append(pool_rps * s * (blind_s + (each_s - blind_s) * stays))
            lost_work = pool_rps * out / p.replicas * each_s  # arrivals the lost replicas held
            absorbed = 1.0 - sum(refused_each) / lost_work if lost_work > 0 else 1.0
            losses.append(
                LossResult(
                    pool=p.name,
                    kind=kind,
                    events=events,
                    replicas_out=out,
                    down_s=each_s,
                    cut_each=cut_each,
                    spare_here=spare_here,
                    spare_elsewhere=elsewhere,
                    absorbed=max(0.0, absorbed),
                    cut=events * cut_each,
                    refused=events * sum(refused_each),
                    refused_by_workload=tuple(events * r for r in refused_each),
                )
            )

    workloads = []
    for k, (s, w) in enumerate(zip(shares, f.workloads, strict=True)):
        w_requests = requests * s
        w_failures = sum(x.cut * inflight[k] + x.refused_by_workload[k] for x in losses)
        availability = 1.0 - w_failures / w_requests if w_requests else 1.0
        workloads.append(
            WorkloadResult(
                w.name, w_requests, inflight[k], w_failures, availability, availability >= f.slo
            )
        )
    return FleetResult(
        inputs=f,
        mean_stream_s=mean_stream_s,
        requests_per_s=requests_per_s,
        requests=requests,
        error_budget=(1.0 - f.slo) * requests,
        losses=tuple(losses),
        replica_minutes_lost=down_s / 60.0,
        capacity_lost_pct=100.0 * down_s / (sum(p.replicas for p in f.pools) * window_s),
        workloads=tuple(workloads),
    )


def standby_for(pools: tuple[Pool, ...]) -> Pool:
    """A passive pool the size of the largest active one, with the same failure rates,
    carrying no traffic, after every other pool."""
    active = [p for p in pools if not p.passive and p.streams_per_replica > 0] or list(pools)
    model = max(active, key=lambda p: p.replicas)  # the first of the largest on a tie
    taken = {p.name for p in pools}
    name, k = "standby", 1
    while name in taken:
        k += 1
        name = f"standby-{k}"
    return replace(
        model,
        name=name,
        priority=max(p.priority for p in pools) + 1,
        passive=True,
        streams_per_replica=0.0,
    )


def fleet_what_ifs(f: FleetInputs) -> list[tuple[str, FleetResult]]:
    """The flat what-ifs, each over every pool, plus a standby region."""

    def per_pool(change: Callable[[Pool], Pool]) -> FleetResult:
        return compute_fleet(replace(f, pools=tuple(change(p) for p in f.pools)))

    return [
        (
            "halve the crash rate",
            per_pool(lambda p: replace(p, crashes_per_replica=p.crashes_per_replica / 2)),
        ),
        ("drain rollouts", per_pool(lambda p: replace(p, rollouts_drained=True))),
        (
            "add a spare replica per pool",
            # Same traffic over one more replica in each pool, as the flat what-if.
            per_pool(
                lambda p: replace(
                    p,
                    replicas=p.replicas + 1,
                    streams_per_replica=p.streams_per_replica * p.replicas / (p.replicas + 1),
                )
            ),
        ),
        (
            "add a standby region",
            compute_fleet(replace(f, pools=(*f.pools, standby_for(f.pools)))),
        ),
    ]


def _finite(x: float) -> float | None:
    """JSON has no infinity: an unlimited spare is null."""
    return None if math.isinf(x) else x


def fleet_as_dict(r: FleetResult) -> dict[str, object]:
    f = r.inputs
    return {
        "inputs": {
            "slo": f.slo,
            "window_days": f.window_days,
            "workloads": [
                {
                    "name": w.name,
                    "share": w.share,
                    "stream_s": w.stream_s,
                    "overflow": w.overflow,
                    "failover": w.failover,
                }
                for w in f.workloads
            ],
            "pools": [
                {name: getattr(p, name) for name in Pool.__dataclass_fields__} for p in f.pools
            ],
        },
        "mean_stream_s": r.mean_stream_s,
        "requests_per_s": r.requests_per_s,
        "requests": r.requests,
        "error_budget": r.error_budget,
        "crash_failures": r.crash_failures,
        "rollout_failures": r.rollout_failures,
        "node_failures": r.node_failures,
        "pool_failures": r.pool_failures,
        "overload_failures": r.overload_failures,
        "failures": r.failures,
        "budget_used_pct": r.budget_used_pct,
        "within_budget": r.within_budget,
        "verdict": r.verdict,
        "replica_minutes_lost": r.replica_minutes_lost,
        "capacity_lost_pct": r.capacity_lost_pct,
        "losses": [
            {
                "pool": x.pool,
                "kind": x.kind.value,
                "events": x.events,
                "replicas_out": x.replicas_out,
                "down_s": x.down_s,
                "cut_each": x.cut_each,
                "spare_here": _finite(x.spare_here),
                "spare_elsewhere": _finite(x.spare_elsewhere),
                "absorbed": x.absorbed,
                "cut": x.cut,
                "refused": x.refused,
                "failures": x.failures,
            }
            for x in r.losses
        ],
        "workloads": [
            {
                "name": w.name,
                "requests": w.requests,
                "inflight_share": w.inflight_share,
                "failures": w.failures,
                "availability": w.availability,
                "meets_slo": w.meets_slo,
            }
            for w in r.workloads
        ],
    }
