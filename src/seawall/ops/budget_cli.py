"""`seawall budget`: the error-budget calculator's command line.

Owns the flags, the `--fleet` file of pools, the optional `--from-prometheus`
measurement, and the table and JSON output. The model is `ops.budget`; the Prometheus
queries are `ops.budget_prom`.

Without pools (no `--fleet`, and a Prometheus that knows none) the command is the flat
model, flag for flag and digit for digit. With pools, every pool field the file does not
set takes the value of the matching flag; a measured value beats both.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from seawall.ops.budget import (
    BudgetInputs,
    BudgetResult,
    FleetInputs,
    FleetResult,
    Pool,
    Workload,
    as_dict,
    compute,
    compute_fleet,
    fleet_as_dict,
    fleet_what_ifs,
    what_ifs,
)

if TYPE_CHECKING:
    from seawall.ops.budget_prom import Measured, MeasuredPool

# The 4th field of --workload: where the workload's requests may go (policy/pools.py's
# TierPools): to another pool when theirs is saturated, when it is down, both, or nowhere.
LEAVES = {
    "both": (True, True),
    "overflow": (True, False),
    "failover": (False, True),
    "stay": (False, False),
}


def _workload(text: str) -> Workload:
    try:
        name, share, stream_s, *rest = text.split(":")
        if len(rest) > 1 or (rest and rest[0] not in LEAVES):
            raise ValueError
        overflow, failover = LEAVES[rest[0] if rest else "both"]
        return Workload(name, float(share), float(stream_s), overflow, failover)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME:SHARE:STREAM_S[:{'|'.join(LEAVES)}], e.g. chat:0.9:10"
        ) from None


def _leaves(w: Workload) -> str:
    return next(k for k, v in LEAVES.items() if v == (w.overflow, w.failover))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileWorkload(_Strict):
    name: str
    share: float
    stream_s: float
    overflow: bool = True
    failover: bool = True


class FilePool(_Strict):
    """A pool in `--fleet FILE`. Unset fields (None) take the matching flag's value."""

    name: str
    priority: int | None = None
    mode: Literal["active", "passive"] | None = None
    replicas: int | None = None
    streams_per_replica: float | None = None
    max_streams_per_replica: float | None = None
    crashes_per_replica: float | None = None
    restart_s: float | None = None
    rollouts_per_replica: float | None = None
    rollouts_drained: bool | None = None
    replicas_per_node: int | None = None
    node_losses: float | None = None
    node_recovery_s: float | None = None
    pool_losses: float | None = None
    pool_recovery_s: float | None = None
    detect_s: float | None = None


class FleetFile(_Strict):
    pools: list[FilePool]
    workloads: list[FileWorkload] = []


def load_fleet_file(path: Path) -> FleetFile:
    try:
        doc = yaml.safe_load(path.read_text())
        return FleetFile.model_validate(doc)
    except (OSError, yaml.YAMLError) as e:
        raise ValueError(f"{path}: {e}") from e
    except ValidationError as e:
        raise ValueError(f"{path}: {e}") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--replicas", type=int, default=4, help="replicas serving the model (default: 4)")
    a(
        "--streams-per-replica",
        type=float,
        default=8.0,
        help="mean concurrent streams per replica (default: 8)",
    )
    a("--slo", type=float, default=0.999, help="availability objective (default: 0.999)")
    a("--window-days", type=float, default=30.0, help="SLO window in days (default: 30)")
    a(
        "--crashes",
        type=float,
        default=1.0,
        help="crashes or deep-probe restarts per replica per window (default: 1)",
    )
    a(
        "--restart-s",
        type=float,
        default=120.0,
        help="seconds from failure to serving again (default: 120)",
    )
    a(
        "--stream-s",
        type=float,
        default=20.0,
        help="mean stream duration in seconds, when no --workload is given (default: 20)",
    )
    a(
        "--workload",
        type=_workload,
        action="append",
        default=[],
        metavar="NAME:SHARE:STREAM_S[:LEAVES]",
        help="a workload: its share of requests and mean stream duration; repeat for a mix. "
        "With pools, LEAVES says where its requests may go when their pool is saturated or "
        f"down: {', '.join(LEAVES)} (default: both)",
    )
    a(
        "--rollouts",
        type=float,
        default=0.0,
        help="planned restarts per replica per window (default: 0)",
    )
    a("--drained", action="store_true", help="planned restarts drain in-flight streams first")
    a(
        "--max-streams-per-replica",
        type=float,
        default=None,
        help="streams one replica can hold; enables refusals while a replica restarts",
    )
    a(
        "--fleet",
        type=Path,
        metavar="FILE",
        help="a YAML file of pools (and optionally workloads); see docs/budget.md. "
        "A field a pool does not set takes the flag's value",
    )
    a(
        "--detect-s",
        type=float,
        default=2.0,
        help="pools: seconds until the gateway takes a lost replica out of routing "
        "(liveness interval plus timeout; default: 2)",
    )
    a("--json", action="store_true", help="print JSON instead of a table")
    a(
        "--from-prometheus",
        metavar="URL",
        help="fill in replicas, streams, restarts and the workload mix measured by a "
        "Prometheus server that scrapes the gateway; per pool, with losses and recovery "
        "times, when the gateway exports pools",
    )
    a("--prom-range", default="1d", help="range the measurements cover (default: 1d)")
    a("--prom-at", default=None, help="evaluation time (unix seconds or RFC 3339; default: now)")


def run(args: argparse.Namespace) -> int:
    fleet_file = None
    if args.fleet is not None:
        try:
            fleet_file = load_fleet_file(args.fleet)
        except ValueError as e:
            print(f"seawall budget: {e}", file=sys.stderr)
            return 2
    file_workloads = tuple(
        Workload(w.name, w.share, w.stream_s, w.overflow, w.failover)
        for w in (fleet_file.workloads if fleet_file else ())
    )
    workloads = tuple(args.workload) or file_workloads or (Workload("all", 1.0, args.stream_s),)
    inputs = BudgetInputs(
        replicas=args.replicas,
        streams_per_replica=args.streams_per_replica,
        slo=args.slo,
        window_days=args.window_days,
        crashes_per_replica=args.crashes,
        restart_s=args.restart_s,
        workloads=workloads,
        rollouts_per_replica=args.rollouts,
        rollouts_drained=args.drained,
        max_streams_per_replica=args.max_streams_per_replica,
    )
    measured_fields: list[str] = []
    got: Measured | None = None
    if args.from_prometheus:
        from seawall.ops.budget_prom import PrometheusError, measure

        try:
            got = measure(args.from_prometheus, args.window_days, args.prom_range, args.prom_at)
        except PrometheusError as e:
            print(f"seawall budget: cannot read Prometheus: {e}", file=sys.stderr)
            return 2
    if fleet_file is not None or (got is not None and got.pools):
        return run_fleet(args, fleet_file, got, inputs)
    if got is not None:
        updates: dict[str, object] = {}
        for name in (
            "replicas",
            "streams_per_replica",
            "crashes_per_replica",
            "rollouts_per_replica",
        ):
            value = getattr(got, name)
            if value is not None:
                updates[name] = value
                measured_fields.append(name)
        if got.workloads and not args.workload:
            updates["workloads"] = got.workloads
            measured_fields.append("workloads")
        inputs = replace(inputs, **updates)  # type: ignore[arg-type]
    try:
        result = compute(inputs)
    except ValueError as e:
        print(f"seawall budget: {e}", file=sys.stderr)
        return 2
    alternatives = what_ifs(inputs)
    if args.json:
        doc = as_dict(result)
        doc["measured"] = measured_fields
        doc["what_ifs"] = [{"scenario": name, **as_dict(r)} for name, r in alternatives]
        print(json.dumps(doc, indent=2))
    else:
        print(render_table(result, alternatives, measured_fields))
    return 0


def _n(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:,.1f}"


def render_table(
    r: BudgetResult, alternatives: list[tuple[str, BudgetResult]], measured: list[str]
) -> str:
    i = r.inputs

    def src(name: str) -> str:
        return "  (measured)" if name in measured else ""

    mix = ", ".join(f"{w.name} {w.share:g} x {w.stream_s:g}s" for w in i.workloads)
    rows = [
        ("Inputs", ""),
        ("  replicas", f"{i.replicas}{src('replicas')}"),
        ("  streams per replica", f"{i.streams_per_replica:.2f}{src('streams_per_replica')}"),
        ("  availability SLO", f"{i.slo:.4%}"),
        ("  window", f"{i.window_days:g} days"),
        ("  crashes per replica", f"{i.crashes_per_replica:.2f}{src('crashes_per_replica')}"),
        ("  restart duration", f"{i.restart_s:g} s"),
        (
            "  planned restarts per replica",
            f"{i.rollouts_per_replica:.2f} ({'drained' if i.rollouts_drained else 'not drained'})"
            f"{src('rollouts_per_replica')}",
        ),
        (
            "  max streams per replica",
            "unlimited" if i.max_streams_per_replica is None else f"{i.max_streams_per_replica:g}",
        ),
        ("  traffic mix (share x stream)", f"{mix}{src('workloads')}"),
        ("Results", ""),
        ("  mean stream duration", f"{r.mean_stream_s:.2f} s"),
        ("  requests in window", f"{_n(r.requests)} ({r.requests_per_s:.2f}/s)"),
        ("  error budget", f"{_n(r.error_budget)} failed requests"),
        ("  failed by crashes", _n(r.crash_failures)),
        ("  failed by undrained rollouts", _n(r.rollout_failures)),
        ("  refused while restarting", _n(r.overload_failures)),
        (
            "  capacity lost to restarts",
            f"{r.replica_minutes_lost:,.1f} replica-minutes ({r.capacity_lost_pct:.4f}%)",
        ),
        ("  verdict", r.verdict),
    ]
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{k:<{width}}{v}".rstrip() for k, v in rows]
    lines += ["", "Per workload"]
    lines.append(
        f"  {'workload':<12}{'requests':>14}{'in flight':>11}{'failed':>10}"
        f"{'availability':>15}  SLO"
    )
    for w in r.workloads:
        lines.append(
            f"  {w.name:<12}{_n(w.requests):>14}{w.inflight_share:>10.1%} {_n(w.failures):>10}"
            f"{w.availability:>15.5%}  {'met' if w.meets_slo else 'MISSED'}"
        )
    lines += _what_if_lines(r, alternatives, 24)
    return "\n".join(lines)


class _Scenario(Protocol):
    @property
    def failures(self) -> float: ...
    @property
    def budget_used_pct(self) -> float: ...
    @property
    def capacity_lost_pct(self) -> float: ...
    @property
    def within_budget(self) -> bool: ...


def _what_if_lines(
    r: _Scenario, alternatives: Sequence[tuple[str, _Scenario]], width: int
) -> list[str]:
    lines = ["", "What if"]
    lines.append(
        f"  {'scenario':<{width}}{'failed':>10}{'budget used':>13}{'capacity lost':>15}  verdict"
    )
    for name, alt in [("as is", r), *alternatives]:
        lines.append(
            f"  {name:<{width}}{_n(alt.failures):>10}{alt.budget_used_pct:>12.1f}%"
            f"{alt.capacity_lost_pct:>14.4f}%  {'within' if alt.within_budget else 'OVER'}"
        )
    return lines


# --- Pools ---------------------------------------------------------------------------


def _flag_pool_values(args: argparse.Namespace) -> dict[str, object]:
    """The pool fields a flag gives: the value of every field a pool does not set."""
    return {
        "replicas": args.replicas,
        "streams_per_replica": args.streams_per_replica,
        "max_streams_per_replica": args.max_streams_per_replica,
        "crashes_per_replica": args.crashes,
        "restart_s": args.restart_s,
        "rollouts_per_replica": args.rollouts,
        "rollouts_drained": args.drained,
        "detect_s": args.detect_s,
    }


def build_pools(
    flags: Mapping[str, object],
    file_pools: Sequence[FilePool],
    measured: Sequence[MeasuredPool],
) -> tuple[tuple[Pool, ...], list[str]]:
    """Pools from the file, then pools only Prometheus knows. Each field: measured, else
    the file, else the flag. Returns the pools and the `pool.field` names measured."""
    from seawall.ops.budget_prom import MeasuredPool

    in_file = {p.name: p for p in file_pools}
    if len(in_file) != len(file_pools):
        raise ValueError("pool names in the fleet file must be unique")
    by_name = {p.name: p for p in measured}
    names = [*in_file, *sorted(n for n in by_name if n not in in_file)]
    pools: list[Pool] = []
    measured_fields: list[str] = []
    for name in names:
        values = dict(flags)
        if (fp := in_file.get(name)) is not None:
            values.update(
                (k, v) for k, v in fp.model_dump(exclude={"name", "mode"}).items() if v is not None
            )
            if fp.mode is not None:
                values["passive"] = fp.mode == "passive"
        if (mp := by_name.get(name)) is not None:
            for field_name in MeasuredPool.MODEL_FIELDS:
                value = getattr(mp, field_name)
                if value is not None:
                    values[field_name] = value
                    measured_fields.append(f"{name}.{field_name}")
        pools.append(Pool(name=name, **values))  # type: ignore[arg-type]
    return tuple(pools), measured_fields


def run_fleet(
    args: argparse.Namespace,
    fleet_file: FleetFile | None,
    got: Measured | None,
    flat: BudgetInputs,
) -> int:
    measured_pools = got.pools if got is not None else ()
    try:
        pools, measured_fields = build_pools(
            _flag_pool_values(args), fleet_file.pools if fleet_file else (), measured_pools
        )
    except ValueError as e:
        print(f"seawall budget: {e}", file=sys.stderr)
        return 2
    workloads = flat.workloads
    written = bool(args.workload) or bool(fleet_file and fleet_file.workloads)
    if got is not None and got.workloads and not written:
        # A written mix names tiers and where they may go; the measured one is per model.
        workloads = got.workloads
        measured_fields.insert(0, "workloads")
    inputs = FleetInputs(
        pools=pools, slo=args.slo, window_days=args.window_days, workloads=workloads
    )
    try:
        result = compute_fleet(inputs)
    except ValueError as e:
        print(f"seawall budget: {e}", file=sys.stderr)
        return 2
    alternatives = fleet_what_ifs(inputs)
    observed = {
        p.name: {
            "failbacks": p.failbacks,
            "routable_now": p.routable_now,
            "serving": list(p.serving),
        }
        for p in measured_pools
    }
    if args.json:
        doc = fleet_as_dict(result)
        doc["measured"] = measured_fields
        doc["observed"] = observed
        doc["what_ifs"] = [{"scenario": name, **fleet_as_dict(r)} for name, r in alternatives]
        print(json.dumps(doc, indent=2))
    else:
        print(render_fleet_table(result, alternatives, measured_fields, measured_pools))
    return 0


def _spare(x: float) -> str:
    return "unlimited" if math.isinf(x) else _n(x)


def render_fleet_table(
    r: FleetResult,
    alternatives: list[tuple[str, FleetResult]],
    measured: list[str],
    observed: Sequence[MeasuredPool] = (),
) -> str:
    f = r.inputs
    seen = {p.name: p for p in observed}

    def src(pool: str, *names: str) -> str:
        return "  (measured)" if any(f"{pool}.{n}" in measured for n in names) else ""

    def leaves(w: Workload) -> str:
        return "" if (w.overflow and w.failover) else f" ({_leaves(w)})"

    mix = ", ".join(f"{w.name} {w.share:g} x {w.stream_s:g}s{leaves(w)}" for w in f.workloads)
    rows: list[tuple[str, str]] = [
        ("Inputs", ""),
        ("  availability SLO", f"{f.slo:.4%}"),
        ("  window", f"{f.window_days:g} days"),
        (
            "  traffic mix (share x stream)",
            f"{mix}{'  (measured)' if 'workloads' in measured else ''}",
        ),
    ]
    for p in f.pools:
        n = p.name
        m = p.max_streams_per_replica
        rows += [
            (
                f"Pool {n}",
                f"{'passive' if p.passive else 'active'}, priority {p.priority}"
                f"{src(n, 'passive', 'priority')}",
            ),
            ("  replicas", f"{p.replicas}{src(n, 'replicas')}"),
            (
                "  streams per replica",
                f"{p.streams_per_replica:.2f}{src(n, 'streams_per_replica')}",
            ),
            ("  max streams per replica", "unlimited" if m is None else f"{m:g}"),
            (
                "  crashes per replica",
                f"{p.crashes_per_replica:.2f}{src(n, 'crashes_per_replica')}",
            ),
            ("  restart duration", f"{p.restart_s:g} s"),
            (
                "  planned restarts per replica",
                f"{p.rollouts_per_replica:.2f} "
                f"({'drained' if p.rollouts_drained else 'not drained'})"
                f"{src(n, 'rollouts_per_replica')}",
            ),
            (
                "  node losses",
                f"{p.node_losses:.2f} ({p.replicas_per_node} replicas per node, "
                f"{p.node_recovery_s:g} s each)"
                if p.node_losses
                else "none",
            ),
            (
                "  pool losses",
                (f"{p.pool_losses:.2f} ({p.pool_recovery_s:g} s each)" if p.pool_losses else "none")
                + src(n, "pool_losses", "pool_recovery_s"),
            ),
            ("  detection time", f"{p.detect_s:g} s"),
        ]
        if (o := seen.get(n)) is not None:
            now = f"{o.routable_now} routable" if o.routable_now is not None else "routable ?"
            serving = f", serving {', '.join(o.serving)}" if o.serving else ""
            back = f", {o.failbacks:.2f} failbacks per window" if o.failbacks is not None else ""
            rows.append(("  now", f"{now}{serving}{back}"))
    rows += [
        ("Results", ""),
        ("  mean stream duration", f"{r.mean_stream_s:.2f} s"),
        ("  requests in window", f"{_n(r.requests)} ({r.requests_per_s:.2f}/s)"),
        ("  error budget", f"{_n(r.error_budget)} failed requests"),
        ("  failed by crashes", _n(r.crash_failures)),
        ("  failed by undrained rollouts", _n(r.rollout_failures)),
        ("  failed by node losses", _n(r.node_failures)),
        ("  failed by pool losses", _n(r.pool_failures)),
        ("  refused while down", _n(r.overload_failures)),
        (
            "  capacity lost",
            f"{r.replica_minutes_lost:,.1f} replica-minutes ({r.capacity_lost_pct:.4f}%)",
        ),
        ("  verdict", r.verdict),
    ]
    width = max(len(k) for k, _ in rows) + 2
    lines = [f"{k:<{width}}{v}".rstrip() for k, v in rows]
    lines += ["", "Losses (spare and cut in streams, refused in requests, per window)"]
    lines.append(
        f"  {'pool':<10}{'loss':<9}{'events':>8}{'out':>5}{'for':>9}{'spare here':>12}"
        f"{'elsewhere':>11}{'absorbed':>10}{'cut':>8}{'refused':>9}"
    )
    for x in r.losses:
        if x.events <= 0:
            continue
        lines.append(
            f"  {x.pool:<10}{x.kind.value:<9}{x.events:>8.2f}{x.replicas_out:>5}"
            f"{x.down_s:>7.0f} s{_spare(x.spare_here):>12}{_spare(x.spare_elsewhere):>11}"
            f"{x.absorbed:>10.1%}{_n(x.cut):>8}{_n(x.refused):>9}"
        )
    lines += ["", "Per workload"]
    lines.append(
        f"  {'workload':<12}{'requests':>14}{'in flight':>11}{'failed':>10}"
        f"{'availability':>15}  SLO     leaves its pool"
    )
    for w, wi in zip(r.workloads, f.workloads, strict=True):
        lines.append(
            f"  {w.name:<12}{_n(w.requests):>14}{w.inflight_share:>10.1%} {_n(w.failures):>10}"
            f"{w.availability:>15.5%}  {'met   ' if w.meets_slo else 'MISSED'}  {_leaves(wi)}"
        )
    lines += _what_if_lines(r, alternatives, 30)
    return "\n".join(lines)
