"""`seawall budget`: the error-budget calculator's command line.

Owns the flags, the optional `--from-prometheus` measurement, and the table and JSON
output. The model is `ops.budget`; the Prometheus queries are `ops.budget_prom`.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from seawall.ops.budget import BudgetInputs, BudgetResult, Workload, as_dict, compute, what_ifs


def _workload(text: str) -> Workload:
    try:
        name, share, stream_s = text.split(":")
        return Workload(name, float(share), float(stream_s))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected NAME:SHARE:STREAM_S, e.g. chat:0.9:10"
        ) from None


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
        metavar="NAME:SHARE:STREAM_S",
        help="a workload: its share of requests and mean stream duration; repeat for a mix",
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
    a("--json", action="store_true", help="print JSON instead of a table")
    a(
        "--from-prometheus",
        metavar="URL",
        help="fill in replicas, streams, restarts and the workload mix measured by a "
        "Prometheus server that scrapes the gateway",
    )
    a("--prom-range", default="1d", help="range the measurements cover (default: 1d)")
    a("--prom-at", default=None, help="evaluation time (unix seconds or RFC 3339; default: now)")


def run(args: argparse.Namespace) -> int:
    workloads = tuple(args.workload) or (Workload("all", 1.0, args.stream_s),)
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
    if args.from_prometheus:
        from seawall.ops.budget_prom import PrometheusError, measure

        try:
            got = measure(args.from_prometheus, args.window_days, args.prom_range, args.prom_at)
        except PrometheusError as e:
            print(f"seawall budget: cannot read Prometheus: {e}", file=sys.stderr)
            return 2
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
    lines += ["", "What if"]
    lines.append(
        f"  {'scenario':<24}{'failed':>10}{'budget used':>13}{'capacity lost':>15}  verdict"
    )
    for name, alt in [("as is", r), *alternatives]:
        lines.append(
            f"  {name:<24}{_n(alt.failures):>10}{alt.budget_used_pct:>12.1f}%"
            f"{alt.capacity_lost_pct:>14.4f}%  {'within' if alt.within_budget else 'OVER'}"
        )
    return "\n".join(lines)
