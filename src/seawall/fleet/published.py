"""The fleet view as the leader publishes it to the other gateway instances.

Owns `PublishedView` (the leader's `FleetSnapshot`, the membership that produced it, the
cordons, what a successor needs to carry on without a blip) and its encoding. The leader's
monitor builds one (`FleetMonitor.export_view`); a follower's monitor applies one
(`FleetMonitor.apply_view`), and when a follower is promoted its monitor carries on
from the last one it applied. The cluster transports the bytes (`seawall.cluster`).

Times. Monotonic clocks differ between hosts, so the encoding carries no monotonic
time: a scrape's time and a replica's start are ages at the moment of publishing, and
the publish itself is stamped with the leader's wall clock. A follower turns the ages
back into its own monotonic times from its own estimate of when the view was published
(`ViewClock`: the smallest difference seen between receipt and the leader's stamp,
NTP's minimum filter), so that one scrape republished in several views maps to one
time, and admission's trends (the preemption rate between two scrapes) stay exact.
A leader's wall clock that steps back resets the estimate.

Seams: `quotas` carries what the leader grants each instance (per-instance KV quotas,
computed elsewhere); it is transported as it is, JSON values keyed by instance id.

Must not: read the clock (callers pass `now`), do I/O, or decide anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import orjson

from seawall.fleet.tracked import ReplicaSpec
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView

VIEW_VERSION = 1
# A receipt this much later than the earliest one implies is not transit delay: the
# leader's wall clock stepped back. Start the estimate again.
CLOCK_RESET_S = 2.0


@dataclass(frozen=True, slots=True)
class PublishedReplica:
    """One replica as the leader knows it: what routing needs, and what a successor
    needs to carry on (its counts, when its process started, a pending verification)."""

    spec: ReplicaSpec
    view: ReplicaView
    restarts: int = 0
    failures: int = 0
    started_at: float = 0.0  # local monotonic seconds (an age on the wire)
    verify_with_deep_probe: bool = False


@dataclass(frozen=True, slots=True)
class PublishedView:
    leader: str
    epoch: int
    seq: int  # grows with every publish; (epoch, seq) orders views across leaders
    published_wall: float
    taken_at: float  # local monotonic seconds: when it was published, as we estimate it
    replicas: tuple[PublishedReplica, ...] = ()
    cordons: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # domain -> why
    quotas: Mapping[str, Any] = field(default_factory=dict)

    @property
    def order(self) -> tuple[int, int]:
        return (self.epoch, self.seq)

    def snapshot(self) -> FleetSnapshot:
        return FleetSnapshot(
            {p.spec.replica_id: p.view for p in self.replicas},
            self.taken_at,
            frozenset(self.cordons),
        )


class ViewClock:
    """When, on our monotonic clock, the leader published a view (see the docstring)."""

    def __init__(self) -> None:
        self._epoch: int | None = None
        self._offset: float | None = None  # min(received_mono - published_wall)

    def local_time(self, epoch: int, published_wall: float, received_at: float) -> float:
        sample = received_at - published_wall
        offset = self._offset
        if epoch != self._epoch or offset is None or sample > offset + CLOCK_RESET_S:
            offset = sample  # a new leader (its own wall clock), or one that stepped back
        self._epoch, self._offset = epoch, min(offset, sample)
        return published_wall + self._offset


# ------------------------------------------------------------------------------ encoding


def _spec_json(s: ReplicaSpec) -> dict[str, Any]:
    return {
        "id": s.replica_id,
        "url": s.url,
        "model": s.model,
        "node": s.node,
        "engine": s.engine,
        "pod": s.pod,
        "namespace": s.namespace,
        "uid": s.uid,
        "pool": s.pool,
    }


def _spec_from(d: Mapping[str, Any]) -> ReplicaSpec:
    return ReplicaSpec(
        replica_id=str(d["id"]),
        url=str(d["url"]),
        model=str(d.get("model") or ""),
        node=d.get("node"),
        engine=str(d.get("engine") or "auto"),
        pod=d.get("pod"),
        namespace=d.get("namespace"),
        uid=d.get("uid"),
        pool=str(d.get("pool") or "default"),
    )


_LOAD_FIELDS = (
    "running",
    "waiting",
    "kv_usage",
    "preemptions_total",
    "generation_tokens_total",
    "prompt_tokens_total",
    "kv_capacity_tokens",
    "kv_block_size",
    "slots",
)


def _load_json(load: EngineLoad | None, now: float) -> dict[str, Any] | None:
    if load is None:
        return None
    out: dict[str, Any] = {name: getattr(load, name) for name in _LOAD_FIELDS}
    out["age_s"] = max(0.0, now - load.scraped_at)
    return out


def _load_from(d: Mapping[str, Any] | None, taken_at: float) -> EngineLoad | None:
    if d is None:
        return None
    values = {name: d.get(name) for name in _LOAD_FIELDS}
    return EngineLoad(**values, scraped_at=taken_at - float(d.get("age_s", 0.0)))


def _view_json(v: ReplicaView, now: float) -> dict[str, Any]:
    return {
        "routable": v.routable,
        "state": v.state,
        "reason": v.reason,
        "score": v.score,
        "load": _load_json(v.load, now),
        "saturated": v.saturated,
        "saturation_reason": v.saturation_reason,
        "held": v.held,
        "no_metrics": v.no_metrics,
        "health_score": v.health_score,
        "score_parts": [list(p) for p in v.score_parts],
        "model": v.model,
        "node": v.node,
    }


def _view_from(rid: str, url: str, d: Mapping[str, Any], taken_at: float) -> ReplicaView:
    return ReplicaView(
        replica_id=rid,
        url=url,
        model=str(d.get("model") or ""),
        node=str(d.get("node") or ""),
        routable=bool(d["routable"]),
        state=str(d["state"]),
        reason=str(d.get("reason") or ""),
        score=float(d["score"]),
        load=_load_from(d.get("load"), taken_at),
        saturated=bool(d.get("saturated", False)),
        saturation_reason=str(d.get("saturation_reason") or ""),
        held=bool(d.get("held", False)),
        # A leader from before this field admitted on a missing load as on one without
        # metrics; a view that does not say keeps that.
        no_metrics=bool(d.get("no_metrics", True)),
        health_score=d.get("health_score"),
        score_parts=tuple((str(k), float(v)) for k, v in d.get("score_parts", ())),
    )


def encode_view(view: PublishedView, now: float) -> bytes:
    """The view on the wire; `now` (our monotonic clock) turns its times into ages."""
    return orjson.dumps(
        {
            "v": VIEW_VERSION,
            "leader": view.leader,
            "epoch": view.epoch,
            "seq": view.seq,
            "published_wall": view.published_wall,
            "replicas": [
                {
                    "spec": _spec_json(p.spec),
                    "view": _view_json(p.view, now),
                    "restarts": p.restarts,
                    "failures": p.failures,
                    "up_for_s": max(0.0, now - p.started_at),
                    "verify": p.verify_with_deep_probe,
                }
                for p in view.replicas
            ],
            "cordons": {k: list(v) for k, v in view.cordons.items()},
            "quotas": dict(view.quotas),
        }
    )


def view_order(raw: bytes) -> tuple[int, int] | None:
    """(epoch, seq) of an encoded view without building it, or None if unreadable."""
    try:
        d = orjson.loads(raw)
        return (int(d["epoch"]), int(d["seq"]))
    except (KeyError, TypeError, ValueError):
        return None


def decode_view(raw: bytes, view_clock: ViewClock, received_at: float) -> PublishedView:
    """A view received at `received_at` (our monotonic clock), its ages turned into our
    times. Raises ValueError for one this version cannot read."""
    try:
        d = orjson.loads(raw)
        if d.get("v") != VIEW_VERSION:
            raise ValueError(f"view version {d.get('v')!r}")
        epoch, published_wall = int(d["epoch"]), float(d["published_wall"])
        taken_at = view_clock.local_time(epoch, published_wall, received_at)
        replicas = []
        for item in d["replicas"]:
            spec = _spec_from(item["spec"])
            replicas.append(
                PublishedReplica(
                    spec=spec,
                    view=_view_from(spec.replica_id, spec.url, item["view"], taken_at),
                    restarts=int(item.get("restarts", 0)),
                    failures=int(item.get("failures", 0)),
                    started_at=taken_at - float(item.get("up_for_s", 0.0)),
                    verify_with_deep_probe=bool(item.get("verify", False)),
                )
            )
        return PublishedView(
            leader=str(d["leader"]),
            epoch=epoch,
            seq=int(d["seq"]),
            published_wall=published_wall,
            taken_at=taken_at,
            replicas=tuple(replicas),
            cordons={str(k): tuple(str(r) for r in v) for k, v in d.get("cordons", {}).items()},
            quotas=dict(d.get("quotas") or {}),
        )
    except (KeyError, TypeError, orjson.JSONDecodeError) as e:
        raise ValueError(f"unreadable fleet view: {e!r}") from None
