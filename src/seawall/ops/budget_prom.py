"""Measured inputs for the error-budget model, read from a Prometheus server.

Owns the PromQL that turns the gateway's metrics into `seawall budget` inputs and the
HTTP calls to `/api/v1/query`. Must not compute the budget (that is `ops.budget`).

Restarts: `seawall_replica_restarts_total{reason}` counts every restart; reasons that
name a planned restart (`PLANNED_REASONS`) count as rollouts, all others as crashes
(deep-probe and watchdog restarts fail streams just like a crash does).
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


class PrometheusError(Exception):
    pass


@dataclass(frozen=True, slots=True)
class Measured:
    """Values found in Prometheus; None where the server had no data."""

    replicas: int | None = None
    streams_per_replica: float | None = None
    crashes_per_replica: float | None = None
    rollouts_per_replica: float | None = None
    workloads: tuple[Workload, ...] = ()
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
    return Measured(
        replicas=replicas,
        streams_per_replica=one("streams_per_replica"),
        crashes_per_replica=per_replica_window(one("crash_rate_per_s")),
        rollouts_per_replica=per_replica_window(one("rollout_rate_per_s")),
        workloads=workloads,
        queries=q,
    )
