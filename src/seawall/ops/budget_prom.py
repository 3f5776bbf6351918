"""Measured inputs for the error-budget model, read from a Prometheus server.

Owns the PromQL that turns the gateway's metrics into `seawall budget` inputs and the
HTTP calls to `/api/v1/query`. Must not compute the budget (that is `ops.budget`).

Restarts: `seawall_replica_restarts_total{reason}` counts every restart; reasons that
name a planned restart (`PLANNED_REASONS`) count as rollouts, all others as crashes
(deep-probe and watchdog restarts fail streams just like a crash does).

Pools (issue 16): when the gateway exports `seawall_replica_pool`, the same inputs are
read per pool, plus each pool's priority and mode, its losses (failovers away from it)
and how long it stays down (time with no routable replica). docs/budget.md lists the
queries.
"""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from dataclasses import dataclass, field

from seawall import metrics as m
from seawall.ops.budget import SECONDS_PER_DAY, Workload

PLANNED_REASONS = "rollout|planned|upgrade|drain|drained"
QUERY_TIMEOUT_S = 10.0
# Resolution of the "how long was the pool down" subquery: the gateway's scrape interval
# is seconds, a pool loss lasts minutes, so 15 s resolves it to a few percent.
DOWN_STEP = "15s"


class PrometheusError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class MeasuredPool:
    """One pool's values found in Prometheus; None where the server had no data."""

    name: str
    replicas: int | None = None
    streams_per_replica: float | None = None
    crashes_per_replica: float | None = None  # per window
    rollouts_per_replica: float | None = None  # per window
    priority: int | None = None
    passive: bool | None = None
    pool_losses: float | None = None  # failovers away from the pool, per window
    pool_recovery_s: float | None = None  # mean time with no routable replica per loss
    failbacks: float | None = None  # failbacks to the pool, per window (shown only)
    routable_now: int | None = None  # replicas routable at the evaluation time (shown)
    serving: tuple[str, ...] = ()  # models this pool serves at the evaluation time

    # The fields that feed the model (the others are shown beside it).
    MODEL_FIELDS = (
        "replicas",
        "streams_per_replica",
        "crashes_per_replica",
        "rollouts_per_replica",
        "priority",
        "passive",
        "pool_losses",
        "pool_recovery_s",
    )


@dataclass(frozen=True, slots=True)
class Measured:
    """Values found in Prometheus; None where the server had no data."""

    replicas: int | None = None
    streams_per_replica: float | None = None
    crashes_per_replica: float | None = None
    rollouts_per_replica: float | None = None
    workloads: tuple[Workload, ...] = ()
    pools: tuple[MeasuredPool, ...] = ()  # empty: the gateway exports no pools
    queries: dict[str, str] = field(default_factory=dict)


def queries(range_: str) -> dict[str, str]:
    """name -> PromQL. Counters are read as per-second rates over `range_`, scaled to
    the budget window by the caller, so a short history still gives a rate."""
    per_model_rate = f"sum by (model) (rate({m.E2E}_count[{range_}]))"
    return {
        "replicas": f"count(count by (replica) ({m.INFLIGHT}))",
        "streams_per_replica": f"avg(avg_over_time({m.INFLIGHT}[{range_}]))",
        "crash_rate_per_s": (
            f'sum(rate({m.RESTARTS}{{reason!~"{PLANNED_REASONS}"}}[{range_}]))'
            f" or vector(0)"  # no restarts at all is a measurement too
        ),
        "rollout_rate_per_s": (
            f'sum(rate({m.RESTARTS}{{reason=~"{PLANNED_REASONS}"}}[{range_}])) or vector(0)'
        ),
        "model_requests_per_s": per_model_rate,
        "model_stream_s": (f"sum by (model) (rate({m.E2E}_sum[{range_}])) / {per_model_rate}"),
    }


def pool_queries(range_: str) -> dict[str, str]:
    """name -> PromQL, one row per pool. `seawall_replica_pool{replica, pool}` ties the
    per-replica families to pools; restarts are counted per node, so they reach a pool
    through the nodes its replicas run on (`seawall_replica_state{replica, node}`)."""
    in_pool = f"on (replica) group_left (pool) ({m.REPLICA_POOL} == 1)"
    node_pool = f"group by (node, pool) ({m.REPLICA_STATE} * {in_pool})"

    def restarts(match: str) -> str:
        # group_right: a node whose replicas sit in two pools counts in both.
        return (
            f'sum by (pool) (sum by (node) (rate({m.RESTARTS}{{reason{match}"{PLANNED_REASONS}"}}'
            f"[{range_}])) * on (node) group_right () {node_pool})"
        )

    return {
        "pool_replicas": f"count by (pool) ({m.REPLICA_POOL} == 1)",
        "pool_streams_per_replica": (
            f"avg by (pool) (avg_over_time({m.INFLIGHT}[{range_}]) * {in_pool})"
        ),
        "pool_crash_rate_per_s": restarts("!~"),
        "pool_rollout_rate_per_s": restarts("=~"),
        "pool_info": f"{m.POOL_INFO} == 1",
        # One pool loss fails every model over: the busiest model's rate counts it once.
        "pool_loss_rate_per_s": f"max by (from_pool) (rate({m.POOL_FAILOVERS}[{range_}]))",
        "pool_failback_rate_per_s": f"max by (to_pool) (rate({m.POOL_FAILBACKS}[{range_}]))",
        "pool_down_fraction": (
            f"avg_over_time((sum by (pool) ({m.POOL_ROUTABLE}) == bool 0)[{range_}:{DOWN_STEP}])"
        ),
        "pool_routable_now": f"sum by (pool) ({m.POOL_ROUTABLE})",
        "pool_serving": f"{m.POOL_SERVING} == 1",
    }


def query(base_url: str, promql: str, at: str | None = None) -> list[tuple[dict[str, str], float]]:
    params = {"query": promql}
    if at:
        params["time"] = at
    url = base_url.rstrip("/") + "/api/v1/query?" + urllib.parse.urlencode(params)
    try:
        with urllib.request.urlopen(url, timeout=QUERY_TIMEOUT_S) as resp:
            body = json.loads(resp.read())
    except (OSError, ValueError) as e:
        raise PrometheusError(f"{url}: {e}") from e
    if body.get("status") != "success":
        raise PrometheusError(f"{promql}: {body.get('error', body)}")
    data = body.get("data", {})
    if data.get("resultType") == "scalar":
        return [({}, float(data["result"][1]))]
    out = []
    for item in data.get("result", []):
        value = float(item["value"][1])
        if value == value:  # NaN: no traffic in the range
            out.append((dict(item.get("metric", {})), value))
    return out


def measure(base_url: str, window_days: float, range_: str, at: str | None) -> Measured:
    q = queries(range_)

    def one(name: str) -> float | None:
        rows = query(base_url, q[name], at)
        return rows[0][1] if rows else None

    replicas_f = one("replicas")
    replicas = int(replicas_f) if replicas_f else None
    window_s = window_days * SECONDS_PER_DAY

    def per_replica_window(rate: float | None) -> float | None:
        if rate is None or not replicas:
            return None
        return rate * window_s / replicas

    rates = {
        labels.get("model", "?"): v for labels, v in query(base_url, q["model_requests_per_s"], at)
    }
    durations = {
        labels.get("model", "?"): v for labels, v in query(base_url, q["model_stream_s"], at)
    }
    total = sum(rates.values())
    workloads = tuple(
        Workload(model, rates[model] / total, durations[model])
        for model in sorted(rates)
        if total > 0 and model in durations and durations[model] > 0
    )
    pq = pool_queries(range_)
    return Measured(
        replicas=replicas,
        streams_per_replica=one("streams_per_replica"),
        crashes_per_replica=per_replica_window(one("crash_rate_per_s")),
        rollouts_per_replica=per_replica_window(one("rollout_rate_per_s")),
        workloads=workloads,
        pools=measure_pools(base_url, pq, window_s, at),
        queries={**q, **pq},
    )


def measure_pools(
    base_url: str, q: dict[str, str], window_s: float, at: str | None
) -> tuple[MeasuredPool, ...]:
    def by(name: str, label: str = "pool") -> dict[str, float]:
        return {labels[label]: v for labels, v in query(base_url, q[name], at) if labels.get(label)}

    replicas = {pool: int(n) for pool, n in by("pool_replicas").items() if n >= 1}
    if not replicas:
        return ()
    streams = by("pool_streams_per_replica")
    crashes = by("pool_crash_rate_per_s")
    rollouts = by("pool_rollout_rate_per_s")
    losses = by("pool_loss_rate_per_s", "from_pool")
    failbacks = by("pool_failback_rate_per_s", "to_pool")
    down = by("pool_down_fraction")
    routable = by("pool_routable_now")
    info = {labels["pool"]: labels for labels, _ in query(base_url, q["pool_info"], at)}
    serving: dict[str, list[str]] = {}
    for labels, _ in query(base_url, q["pool_serving"], at):
        serving.setdefault(labels.get("pool", ""), []).append(labels.get("model", "?"))
    restarts_seen = bool(crashes or rollouts)

    def per_replica(rates: dict[str, float], pool: str) -> float | None:
        if pool in rates:
            return rates[pool] * window_s / replicas[pool]
        # The gateway seeds every restart series at zero: a pool without one while
        # others have them restarted nothing.
        return 0.0 if restarts_seen else None

    def priority(pool: str) -> int | None:
        try:
            return int(info[pool]["priority"])
        except (KeyError, ValueError):
            return None

    out = []
    for pool in sorted(replicas):
        loss_rate = losses.get(pool)
        mode = info.get(pool, {}).get("mode")
        out.append(
            MeasuredPool(
                name=pool,
                replicas=replicas[pool],
                streams_per_replica=streams.get(pool),
                crashes_per_replica=per_replica(crashes, pool),
                rollouts_per_replica=per_replica(rollouts, pool),
                priority=priority(pool),
                passive=None if mode not in ("active", "passive") else mode == "passive",
                # No failover away from a pool in the range is a measurement when the
                # gateway exports failovers at all.
                pool_losses=(
                    loss_rate * window_s if loss_rate is not None else (0.0 if losses else None)
                ),
                # Down seconds over the range divided by the losses in it.
                pool_recovery_s=(
                    down[pool] / loss_rate if loss_rate and down.get(pool) is not None else None
                ),
                failbacks=failbacks[pool] * window_s if pool in failbacks else None,
                routable_now=int(routable[pool]) if pool in routable else None,
                serving=tuple(sorted(serving.get(pool, ()))),
            )
        )
    return tuple(out)
