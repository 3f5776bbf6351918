"""The failure-domain map: each way a serving fleet fails, the control that keeps the
failure in its domain, the metric that proves the control works, and how to read the
control's live state from the admin API's `/admin/state` document.

Owns the table and the summarising of a state document. Pure: no I/O (the CLI fetches
the state). Summaries tolerate missing keys, because the admin API grows over time and
an old gateway must still get a map rather than a traceback.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from seawall import metrics as m
from seawall.ops.engines import ENGINE_NAMES

State = Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class Domain:
    key: str
    name: str
    example: str
    controls: tuple[str, ...]
    proof: tuple[str, ...]  # PromQL selectors an operator can graph
    live: Callable[[State], str]


def _get(doc: Any, *path: str, default: Any = None) -> Any:
    for key in path:
        if not isinstance(doc, Mapping) or key not in doc:
            return default
        doc = doc[key]
    return doc


def _replicas(state: State) -> list[Mapping[str, Any]]:
    items = _get(state, "replicas", default=[])
    return [r for r in items if isinstance(r, Mapping)] if isinstance(items, Sequence) else []


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _live_bad_request(state: State) -> str:
    backend = _get(state, "limits", "backend", default="unknown")
    degraded = _get(state, "limits", "degraded")
    tenants = _get(state, "limits", "tenants")
    parts = [f"limits backend {backend}"]
    if degraded is not None:
        parts.append("DEGRADED (failure mode in force)" if degraded else "healthy")
    if tenants is not None:
        parts.append(f"{tenants} tenants")
    return ", ".join(parts)


def _live_overload(state: State) -> str:
    replicas = _replicas(state)
    if not replicas:
        return "no replicas reported"
    saturated = [str(r.get("id", "?")) for r in replicas if r.get("saturated")]
    kv = [v for r in replicas if (v := _num(_get(r, "load", "kv_usage"))) is not None]
    waiting = [v for r in replicas if (v := _num(_get(r, "load", "waiting"))) is not None]
    parts = [f"{len(saturated)} of {len(replicas)} replicas saturated"]
    if saturated:
        parts[0] += f" ({', '.join(saturated)})"
    if kv:
        parts.append(f"max KV usage {max(kv):.0%}")
    if waiting:
        parts.append(f"{sum(waiting):g} requests waiting in engines")
    return ", ".join(parts)


def _live_crash(state: State) -> str:
    replicas = _replicas(state)
    ready = sum(1 for r in replicas if r.get("routable"))
    restarts = sum(v for r in replicas if (v := _num(r.get("restarts"))) is not None)
    unwell = [
        f"{r.get('id', '?')}: {r.get('state', '?')}"
        + (f" ({r['reason']})" if r.get("reason") else "")
        for r in replicas
        if r.get("state") not in (None, "ready")
    ]
    parts = [f"{ready} of {len(replicas)} replicas routable", f"{restarts:g} restarts"]
    if unwell:
        parts.append("; ".join(unwell))
    timeouts = _get(state, "timeouts", default={})
    if isinstance(timeouts, Mapping) and timeouts:
        parts.append(
            "timeouts " + " ".join(f"{k.removesuffix('_s')}={v}s" for k, v in timeouts.items())
        )
    tiers = _get(state, "migration", "tiers")
    if isinstance(tiers, Sequence) and not isinstance(tiers, str):
        parts.append(f"migration tiers {', '.join(map(str, tiers)) or 'none'}")
    return ", ".join(parts)


def _live_gpu(state: State) -> str:
    nodes = _get(state, "nodes", default=[])
    nodes = [n for n in nodes if isinstance(n, Mapping)] if isinstance(nodes, Sequence) else []
    cordoned = [str(n.get("node", "?")) for n in nodes if n.get("cordoned")]
    parts = [f"{len(cordoned)} of {len(nodes)} nodes cordoned"]
    if cordoned:
        parts[0] += f" ({', '.join(cordoned)})"
    scored = [(v, str(r.get("id", "?"))) for r in _replicas(state) if (v := _num(r.get("score")))]
    if scored:
        low, rid = min(scored)
        parts.append(f"lowest health score {low:.2f} ({rid})")
    busiest = max(nodes, key=lambda n: _num(n.get("restarts_in_window")) or 0, default=None)
    if busiest is not None and _num(busiest.get("restarts_in_window")):
        parts.append(
            f"most restarts: {busiest.get('node', '?')} ({busiest['restarts_in_window']} in window)"
        )
    return ", ".join(parts)


def _live_fleet(state: State) -> str:
    replicas = _replicas(state)
    routable = sum(1 for r in replicas if r.get("routable"))
    parts = [f"{routable} of {len(replicas)} replicas routable"]
    level = _get(state, "retry_budget", "level")
    ratio = _get(state, "retry_budget", "ratio")
    if level is not None:
        budget = f"retry budget {level}"
        if ratio is not None:
            budget += f" (ratio {ratio})"
        parts.append(budget)
    draining = _get(state, "draining")
    if draining is not None:
        parts.append("DRAINING" if draining else "not draining")
    hedging = _get(state, "hedging", "enabled")
    if hedging is not None:
        parts.append(f"hedging {'on' if hedging else 'off'}")
    pools = _get(state, "pools", default=[]) or []
    if len(pools) > 1:
        shown = []
        for p in pools:
            serving = p.get("serving") or []
            tag = f" serving {', '.join(serving)}" if serving else ""
            circuit = p.get("circuit")
            tag += f", circuit {circuit}" if circuit and circuit != "closed" else ""
            shown.append(
                f"{p.get('pool')} ({p.get('mode')}, {p.get('routable')}/{p.get('replicas')}"
                f" routable{tag})"
            )
        parts.append("pools: " + "; ".join(shown))
        moves = [
            e for e in _get(state, "pool_events", default=[]) or [] if e.get("change") != "first"
        ]
        if moves:
            last = moves[-1]
            parts.append(f"last move: {last.get('change')} {last.get('from')} -> {last.get('to')}")
    return ", ".join(parts)


_V = ENGINE_NAMES["vllm"]

DOMAINS: tuple[Domain, ...] = (
    Domain(
        "bad_request",
        "a bad request",
        "a prompt longer than the context, a malformed body, one tenant's flood",
        (
            "validation at the gateway answers 4xx before any replica sees it; 4xx is "
            "never retried",
            "per-tenant rate limits and concurrency caps",
        ),
        (
            f'sum by (status) (rate({m.REQUESTS}{{status=~"4.."}}[5m]))',
            f"sum by (tenant, reason) (rate({m.SHED}[5m]))",
        ),
        _live_bad_request,
    ),
    Domain(
        "overload",
        "engine overload",
        "KV cache full, the waiting queue growing, preemptions",
        (
            "admission: a saturated replica takes no new work",
            "shedding at the door (429 with Retry-After) instead of unbounded queues",
            "balancing by load and health score",
        ),
        (
            m.SHED,
            m.QUEUE_DEPTH,
            # Shedding only contains overload if saying no stays cheap.
            f"histogram_quantile(0.99, sum by (le) (rate({m.SHED_LATENCY}_bucket[5m])))",
            str(_V.preemptions_total),
            str(_V.kv_usage),
        ),
        _live_overload,
    ),
    Domain(
        "crash",
        "a process crash",
        "the engine dies or hangs while /health still answers 200",
        (
            "retry on another replica before the first token, within the retry budget",
            "TTFT, inter-token and total timeouts",
            "deep probes and the progress watchdog restart the replica",
            "mid-stream migration of streams that were in flight",
        ),
        (m.RETRIES, m.TIMEOUTS, m.DEEP_PROBE_FAILURES, m.RESTARTS, m.MIGRATIONS, m.STREAM_ERRORS),
        _live_crash,
    ),
    Domain(
        "gpu",
        "a sick GPU",
        "Xid or ECC errors; a node whose replicas keep restarting",
        (
            "the health score lowers the replica's routing weight",
            "the restart ledger cordons the node after repeated restarts and opens a "
            "hardware ticket",
        ),
        (m.REPLICA_SCORE, m.REPLICA_SCORE_PART, m.NODE_CORDONED, m.HARDWARE_TICKETS),
        _live_gpu,
    ),
    Domain(
        "fleet",
        "fleet or region loss",
        "many replicas fail together; a zone or a region goes away",
        (
            "pools: a request overflows to the next pool when its pool is saturated and "
            "fails over when it has no routable replica, as its tier allows; the serving "
            "pool moves (failover, failback) with hysteresis; a standby region is passive",
            "a remote pool has its own timeouts, a circuit breaker and a deep-probe floor",
            "the retry budget caps retries so failures do not multiply load",
            "shedding keeps the survivors serving rather than all timing out",
            "drain on shutdown finishes in-flight streams",
        ),
        (
            m.RETRY_BUDGET,
            m.RETRY_BUDGET_EXHAUSTED,
            m.REPLICA_READY,
            m.DRAINING,
            m.POOL_SERVING,
            m.POOL_FAILOVERS,
        ),
        _live_fleet,
    ),
)


def live_states(state: State) -> dict[str, str]:
    """domain key -> one line of live state."""
    return {d.key: d.live(state) for d in DOMAINS}
