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
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

SECONDS_PER_DAY = 86_400.0


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    share: float  # fraction of requests; shares are normalised to sum to 1
    stream_s: float  # mean stream duration


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
