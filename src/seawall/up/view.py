"""What `seawall up` shows: the live table (a TTY), one plain line per tick (no TTY),
and the summary at exit.

Pure: every function turns an `UpSnapshot` into text or a rich renderable. No I/O, no
clock; the snapshot carries the elapsed time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from seawall.actuate.local import ReplicaStatus
from seawall.up.figures import GatewayFigures, ReplicaLoad, TrafficFigures

STATE_STYLE = {"running": "green", "starting": "yellow", "backoff": "red", "stopped": "dim"}


@dataclass(frozen=True, slots=True)
class UpSnapshot:
    elapsed_s: float
    replicas: tuple[ReplicaStatus, ...]
    gateway: ReplicaStatus | None = None
    gateway_url: str = ""
    gateway_note: str = ""  # why there is no gateway, when there is none
    gateway_figures: GatewayFigures | None = None
    traffic: TrafficFigures | None = None
    traffic_target: str = ""
    events: tuple[str, ...] = ()  # the latest notable events, oldest first
    routing: dict[str, str] = field(default_factory=dict)  # replica id -> monitor state
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)  # replica id -> its load
    status_url: str = ""  # the admin API's status page, when it runs
    crashes: tuple[str, ...] = ()  # what became of the requests on each demo crash
    title: str = "seawall up"


def ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1000:.0f}ms"


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def running_count(replicas: Sequence[ReplicaStatus]) -> int:
    return sum(1 for r in replicas if r.state == "running")


def traffic_text(t: TrafficFigures) -> str:
    return (
        f"requests {t.requests}: ok {t.ok}, failed {t.failed}, dropped {t.dropped}"
        f"{f', cut {t.cut}' if t.cut else ''} | "
        f"TTFT p50 {ms(t.ttft_p50_s)} p99 {ms(t.ttft_p99_s)} (client: sent to first token) | "
        f"{t.tokens_per_s:.0f} tokens/s"
    )


def gateway_text(g: GatewayFigures, ttft: bool = True) -> str:
    """The gateway's count, in the client's categories (a stream cut mid-way is dropped,
    not ok). `ttft`: add the gateway's TTFT estimate; off when the client's own exact
    figure is shown, so that one TTFT is on screen, not two that disagree."""
    counts = (
        f"answered ok {g.requests_ok}, failed {g.requests_failed}, "
        f"dropped {g.requests_dropped}"
        f"{f', client left {g.client_left}' if g.client_left else ''}"
    )
    parts = [counts]
    if ttft:
        parts.append(f"TTFT p50 ~{ms(g.ttft_p50_s)} (gateway histogram estimate)")
    parts.append(f"retries {g.retries}, migrations {g.migrations_ok}")
    return " | ".join(parts)


def load_cells(load: ReplicaLoad | None) -> tuple[str, str, str]:
    """In flight, KV use, score: '-' for what is not known."""
    if load is None:
        return "-", "-", "-"
    return (
        "-" if load.in_flight is None else str(load.in_flight),
        "-" if load.kv_usage is None else f"{load.kv_usage:.0%}",
        "-" if load.score is None else f"{load.score:.2f}",
    )


def gateway_state(snap: UpSnapshot) -> str:
    if snap.gateway is None:
        return snap.gateway_note or "(no gateway)"
    g = snap.gateway
    pid = f" pid {g.pid}" if g.pid else ""
    note = f" ({g.reason})" if g.reason else ""
    return f"{g.state} {snap.gateway_url}{pid} restarts {g.restarts}{note}"


def render(snap: UpSnapshot) -> RenderableType:
    """The live view for a terminal."""
    table = Table(
        title=f"{snap.title} — {running_count(snap.replicas)}/{len(snap.replicas)} replicas "
        f"running — {duration(snap.elapsed_s)}",
        title_justify="left",
        expand=False,
    )
    columns = (
        "replica", "port", "process", "routing", "in flight", "KV", "score",
        "pid", "restarts", "uptime", "note",
    )  # fmt: skip
    right = ("in flight", "KV", "score", "restarts", "uptime")
    for column in columns:
        table.add_column(column, justify="right" if column in right else "left")
    for r in snap.replicas:
        table.add_row(
            r.replica_id,
            str(r.port),
            Text(r.state, style=STATE_STYLE.get(r.state, "")),
            snap.routing.get(r.replica_id, "-"),
            *load_cells(snap.loads.get(r.replica_id)),
            str(r.pid or "-"),
            str(r.restarts),
            duration(r.uptime_s) if r.pid else "-",
            r.reason[:60],
        )
    lines: list[RenderableType] = [table]
    lines.append(Text(f"gateway  {gateway_state(snap)}"))
    if snap.status_url:
        lines.append(Text(f"status   {snap.status_url}"))
    if snap.gateway_figures is not None:
        ttft = snap.traffic is None
        lines.append(Text(f"         {gateway_text(snap.gateway_figures, ttft)}"))
    if snap.traffic is not None:
        lines.append(Text(f"traffic  → {snap.traffic_target}  {traffic_text(snap.traffic)}"))
    for event in snap.events[-5:]:
        lines.append(Text(f"  · {event}", style="dim"))
    lines.append(Text("Ctrl-C stops everything.", style="dim"))
    return Group(*lines)


def plain_line(snap: UpSnapshot) -> str:
    """One line per tick when stdout is not a terminal (CI logs, pipes)."""

    def load(rid: str) -> str:
        if rid not in snap.loads:
            return ""
        inflight, kv, score = load_cells(snap.loads[rid])
        return f" inflight={inflight} kv={kv} score={score}"

    replicas = "; ".join(
        f"{r.replica_id} {r.state} pid={r.pid or '-'} port={r.port} restarts={r.restarts}"
        + (f" routing={snap.routing[r.replica_id]}" if r.replica_id in snap.routing else "")
        + load(r.replica_id)
        for r in snap.replicas
    )
    parts = [
        f"t={duration(snap.elapsed_s)}",
        f"replicas {running_count(snap.replicas)}/{len(snap.replicas)} running: {replicas}",
        f"gateway {gateway_state(snap)}",
    ]
    if snap.gateway_figures is not None:
        parts.append(f"gateway {gateway_text(snap.gateway_figures, snap.traffic is None)}")
    if snap.traffic is not None:
        parts.append(f"traffic {traffic_text(snap.traffic)}")
    return " | ".join(parts)


def summary(snap: UpSnapshot, pids: Sequence[int], left_behind: Sequence[int]) -> list[str]:
    """What `seawall up` prints as it exits."""
    lines = [f"seawall up: summary after {duration(snap.elapsed_s)}"]
    lines.append(
        "  replicas: " + ", ".join(f"{r.replica_id} (restarts {r.restarts})" for r in snap.replicas)
    )
    if snap.traffic is not None:
        lines.append(f"  traffic: {traffic_text(snap.traffic)}")
    if snap.gateway_figures is not None:
        lines.append(f"  gateway: {gateway_text(snap.gateway_figures, snap.traffic is None)}")
    elif snap.gateway is None:
        lines.append(f"  gateway: {snap.gateway_note or '(none)'}")
    for crash in snap.crashes:
        lines.append(f"  {crash}")
    lines.append("  pids: " + " ".join(str(p) for p in pids))
    if left_behind:
        lines.append("  STILL RUNNING (not stopped): " + " ".join(str(p) for p in left_behind))
    else:
        lines.append("  all processes stopped")
    return lines
