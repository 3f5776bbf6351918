"""The fleet view: what the fleet monitor publishes and the request path reads.

The request path never waits on the fleet. Monitors (scraper, prober, watchdog) build a
new immutable `FleetSnapshot` and swap it in; the gateway reads the current one per
request. Everything here is plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of an engine's /metrics, normalised across engines by an adapter.

    Counters are cumulative as the engine reports them; rates are computed by whoever
    holds two scrapes. A field the engine does not export is None, never a guess.
    """

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None
    kv_capacity_tokens: float | None = None  # usable KV cache, in tokens (vLLM cache config)
    kv_block_size: int | None = None  # tokens per KV block (vLLM cache config)
    scraped_at: float = 0.0  # monotonic seconds


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What routing needs to know about one replica, at one moment."""

    replica_id: str
    url: str
    model: str
    node: str  # the failure domain: the node, or `replica:<id>` for a replica without one
    routable: bool = True  # ready, not draining, not cordoned, not stuck
    state: str = "ready"
    reason: str = ""
    score: float = 1.0  # routing score in (0, 1]: health score x the state's weight
    load: EngineLoad | None = None
    saturated: bool = False  # admission: no new work while true
    saturation_reason: str = ""
    health_score: float | None = None  # the health score alone; None before the first
    score_parts: tuple[tuple[str, float], ...] = ()  # its factors, for the metrics


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    replicas: dict[str, ReplicaView] = field(default_factory=dict)
    taken_at: float = 0.0
    cordoned: frozenset[str] = frozenset()  # failure domains out of service
