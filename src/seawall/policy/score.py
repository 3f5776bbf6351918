"""The health score: one number in (0, 1] per replica, and the factors it is made of.

Why a score as well as a state. The state machine (`health`) answers "route or not"; it
is deliberately coarse so that restarts and cordons are rare and explainable. Between
"perfect" and "restart it" there is a wide band of replicas that work but worse than
their peers: a slow GPU, a noisy neighbour, a replica under preemption pressure. The
score lets routing (`balance.replica_cost` divides by it) send such a replica less work
in proportion, without a state change, and recover as soon as the inputs do.

The formula. The score is the product of independent factors, each in (0, 1], where 1
means "no evidence of a problem". A product (not a weighted mean) because any single
severe problem should pull the whole score down: a replica that fails half its deep
probes is not made healthy by low latency. Every input is optional; an unknown input
gives factor 1 (no evidence either way), so an engine that exports fewer metrics is not
penalised for it; a NaN input is a broken measurement and scores as the worst value.
Each factor except `hardware` is floored at `factor_floor` (0.05) so that one bad input
cannot drive the score to zero and the product stays positive.

  probe_success  = deep_probe_success_ratio
  probe_latency  = min(1, tolerance * fleet_median / latency)     tolerance = 1.5
  ttft, itl      = same relative rule against the fleet median, from gateway observations
  kv             = 1 - 0.5 * clamp((kv_usage - 0.8) / 0.2, 0, 1)   (down to 0.5 at a full cache)
  waiting        = waiting_half / (waiting_half + waiting)        waiting_half = 10 requests
  preemption     = preemption_half_per_s / (preemption_half_per_s + rate)   half at 1/s
  errors         = 1 - error_rate
  hardware       = 0.01 with a hardware fault flagged, else 1
  total          = product of all factors

The relative latency rules compare a replica to the fleet median rather than to a fixed
SLO: a long-prompt workload makes every replica slow, and that is not a health problem.
Within `tolerance` times the median costs nothing; beyond it the factor falls as
median/latency (twice as slow as the tolerated latency means half the score).

Property-tested: a worse input never raises the score.

Must not: read the clock, compute rates (callers pass rates they derived from two
scrapes), or decide state transitions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ScoreInputs:
    """What is known about one replica; None means not measured."""

    deep_probe_success_ratio: float | None = None  # 0..1 over the recent probe window
    deep_probe_latency_s: float | None = None
    fleet_median_deep_probe_latency_s: float | None = None
    kv_usage: float | None = None  # 0..1
    waiting: float | None = None  # requests queued in the engine
    preemption_rate_per_s: float | None = None
    ttft_s: float | None = None  # gateway-observed, recent typical value
    fleet_median_ttft_s: float | None = None
    itl_s: float | None = None
    fleet_median_itl_s: float | None = None
    error_rate: float | None = None  # 0..1 fraction of recent requests that failed
    hardware_fault: bool = False


@dataclass(frozen=True, slots=True)
class ScoreBreakdown:
    """The total and each factor, for the per-factor metric and the admin API."""

    total: float
    probe_success: float
    probe_latency: float
    kv: float
    waiting: float
    preemption: float
    ttft: float
    itl: float
    errors: float
    hardware: float

    def factors(self) -> dict[str, float]:
        """Factor name -> value, in a stable order (metric label values)."""
        return {
            "probe_success": self.probe_success,
            "probe_latency": self.probe_latency,
            "kv": self.kv,
            "waiting": self.waiting,
            "preemption": self.preemption,
            "ttft": self.ttft,
            "itl": self.itl,
            "errors": self.errors,
            "hardware": self.hardware,
        }


@dataclass(frozen=True, slots=True)
class HealthScore:
    """The tunable constants of the formula (see the module docstring)."""

    latency_tolerance: float = 1.5
    kv_soft_limit: float = 0.8
    kv_max_penalty: float = 0.5
    waiting_half: float = 10.0
    preemption_half_per_s: float = 1.0
    factor_floor: float = 0.05
    hardware_factor: float = 0.01

    def score(self, parts: ScoreInputs) -> ScoreBreakdown:
        floor = self.factor_floor

        def bounded(x: float) -> float:
            # NaN (a broken input) is treated as the worst value, not as healthy.
            if math.isnan(x):
                return floor
            return min(1.0, max(floor, x))

        def relative(latency_s: float | None, median_s: float | None) -> float:
            if latency_s is None or median_s is None or not median_s > 0:
                return 1.0
            if not latency_s > 0:
                return 1.0 if latency_s == 0 else floor
            return bounded(self.latency_tolerance * median_s / latency_s)

        probe_success = (
            1.0
            if parts.deep_probe_success_ratio is None
            else bounded(parts.deep_probe_success_ratio)
        )
        probe_latency = relative(
            parts.deep_probe_latency_s, parts.fleet_median_deep_probe_latency_s
        )
        kv = 1.0
        if parts.kv_usage is not None:
            over = (parts.kv_usage - self.kv_soft_limit) / (1.0 - self.kv_soft_limit)
            over = 1.0 if math.isnan(over) else min(1.0, max(0.0, over))
            kv = bounded(1.0 - self.kv_max_penalty * over)
        waiting = 1.0
        if parts.waiting is not None:
            queued = parts.waiting if not parts.waiting < 0 else 0.0  # keeps NaN as NaN
            waiting = bounded(self.waiting_half / (self.waiting_half + queued))
        preemption = 1.0
        if parts.preemption_rate_per_s is not None:
            rate = parts.preemption_rate_per_s
            rate = rate if not rate < 0 else 0.0  # keeps NaN as NaN
            preemption = bounded(self.preemption_half_per_s / (self.preemption_half_per_s + rate))
        ttft = relative(parts.ttft_s, parts.fleet_median_ttft_s)
        itl = relative(parts.itl_s, parts.fleet_median_itl_s)
        errors = 1.0 if parts.error_rate is None else bounded(1.0 - parts.error_rate)
        hardware = self.hardware_factor if parts.hardware_fault else 1.0

        total = (
            probe_success * probe_latency * kv * waiting * preemption * ttft * itl * errors
        ) * hardware
        return ScoreBreakdown(
            total=total,
            probe_success=probe_success,
            probe_latency=probe_latency,
            kv=kv,
            waiting=waiting,
            preemption=preemption,
            ttft=ttft,
            itl=itl,
            errors=errors,
            hardware=hardware,
        )


DEFAULT = HealthScore()


def score(parts: ScoreInputs, config: HealthScore = DEFAULT) -> ScoreBreakdown:
    """The health score of one replica with the default (or given) constants."""
    return config.score(parts)
