"""The admin API's view of the fleet monitor: every replica and failure domain, with why.

Owns the shape of `FleetMonitor.describe()` (JSON-ready dicts, what `GET /admin/state`
serves and the status page draws). Reads the monitor's records; the monitor delegates
to `describe` here.

Must not change anything, decide anything, or do I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from seawall.fleet.signals import GatewaySignals
from seawall.fleet.tracked import TrackedDomain, TrackedReplica, TransitionRecord
from seawall.fleet.view import EngineLoad, FleetSnapshot


def describe(
    replicas: Iterable[TrackedReplica],
    domains: Iterable[TrackedDomain],
    history: Iterable[TransitionRecord],
    snapshot: FleetSnapshot,
    signals: GatewaySignals,
    now: float,
) -> dict[str, Any]:
    """`{"replicas": [...], "nodes": [...], "transitions": [...]}` at monotonic `now`."""
    return {
        "replicas": [_replica(rep, snapshot, signals, now) for rep in replicas],
        "nodes": [_domain(d) for d in domains],
        "transitions": [_transition(t) for t in history],
    }


def _replica(
    rep: TrackedReplica, snapshot: FleetSnapshot, signals: GatewaySignals, now: float
) -> dict[str, Any]:
    rid = rep.spec.replica_id
    view = snapshot.replicas.get(rid)
    sig = rep.signals
    return {
        "id": rid,
        "url": rep.spec.url,
        "model": rep.model or rep.spec.model,
        "node": rep.spec.domain,
        "engine": rep.adapter.kind.value if rep.adapter else rep.spec.engine,
        "state": rep.state.value,
        "reason": rep.reason,
        "routable": view.routable if view else False,
        "held": rep.held,
        "saturated": view.saturated if view else False,
        "score": rep.breakdown.total if rep.breakdown else 1.0,
        "routing_score": view.score if view else 0.0,
        "score_parts": rep.breakdown.factors() if rep.breakdown else {},
        "load": _load_dict(rep.load),
        "scrape": rep.scrape_note,
        "in_flight": signals.streams_in_flight(rid),
        "requests_in_flight": signals.requests_in_flight(rid),
        "restarts": rep.restarts,
        "failures": rep.failures,
        "liveness": {
            "probes": sig.liveness_probes,
            "consecutive_failures": sig.liveness_failures,
            "last_error": sig.liveness_error,
            "inconclusive": sig.liveness_inconclusive,
        },
        "deep_probe": {
            "success_ratio": sig.deep_success_ratio,
            "latency_s": sig.deep_latency_s,
            "consecutive_failures": sig.deep_streak,
            "inconclusive": sig.deep_inconclusive,
            "last_inconclusive": sig.last_inconclusive,
        },
        "storm": rep.storm.state.value,
        "preemption_rate_per_s": rep.storm.last_rate_per_s,
        "up_for_s": now - sig.started_at,
    }


def _domain(d: TrackedDomain) -> dict[str, Any]:
    return {
        "node": d.name,
        "cordoned": d.cordoned,
        "since_wall": d.since_wall,
        "evidence": list(d.evidence.reasons) if d.evidence else [],
        "restarts": [list(r) for r in d.evidence.restarts] if d.evidence else [],
        "gpu": {
            "fatal": d.gpu.fatal,
            "reasons": list(d.gpu.reasons),
            "warnings": list(d.gpu.warnings),
        },
    }


def _transition(t: TransitionRecord) -> dict[str, Any]:
    return {
        "at": t.at,
        "at_wall": t.at_wall,
        "replica": t.replica_id,
        "event": t.event,
        "from": t.before,
        "to": t.after,
        "reason": t.reason,
    }


def _load_dict(load: EngineLoad | None) -> dict[str, float | None] | None:
    if load is None:
        return None
    return {
        "running": load.running,
        "waiting": load.waiting,
        "kv_usage": load.kv_usage,
        "preemptions_total": load.preemptions_total,
        "generation_tokens_total": load.generation_tokens_total,
        "prompt_tokens_total": load.prompt_tokens_total,
        "kv_capacity_tokens": load.kv_capacity_tokens,
        "slots": load.slots,
    }
