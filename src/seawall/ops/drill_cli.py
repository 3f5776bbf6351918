"""`seawall drill SCENARIO --admin URL`: run one bounded drill and print what users saw.

Owns: the command line and the rendering (a table, or JSON with `--json`). The drill
itself is `seawall.ops.drill`. Exit codes: 0 the drill ran (whatever it found), 2 it
could not run (admin API, token, replicas without faults), 3 the gateway lacks what the
scenario needs (the rollout endpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import cast

import orjson
from rich.console import Console
from rich.table import Table

from seawall.admin_args import add_admin_arguments
from seawall.ops.drill import (
    EXIT_OK,
    SCENARIOS,
    Drill,
    DrillError,
    DrillReport,
    PhaseFigures,
    Scenario,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("scenario", choices=SCENARIOS, help="what to break")
    add_admin_arguments(p)
    p.add_argument(
        "--api-key",
        default=os.environ.get("SEAWALL_API_KEY"),
        help="API key for the load, when the gateway needs one (default: $SEAWALL_API_KEY)",
    )
    p.add_argument(
        "--duration", type=float, default=20.0, metavar="S", help="the whole drill (default 20)"
    )
    p.add_argument(
        "--concurrency", type=int, default=8, metavar="N", help="steady load streams (default 8)"
    )
    p.add_argument(
        "--target", metavar="ID", help="replica to fault (default: the busiest at injection)"
    )
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1000:.0f} ms"


def _phase(f: PhaseFigures) -> str:
    return f"{f.requests} req: {f.ok} ok, {f.failed} failed, {f.dropped} dropped, {f.cut} cut"


def render(report: DrillReport, console: Console) -> None:
    t = Table(title=f"drill {report.scenario}", show_header=False)
    t.add_column("figure", style="bold")
    t.add_column("value")
    t.add_row("target", report.target or "the fleet")
    t.add_row("model / API", f"{report.model} at {report.api_url}")
    t.add_row("fault", orjson.dumps(report.fault).decode() if report.fault else "-")
    t.add_row("streams dropped", str(report.streams_dropped))
    t.add_row("requests failed", f"{report.requests_failed} of {report.requests}")
    if report.target_inflight_at_fault is not None:
        t.add_row("target in-flight at crash", str(report.target_inflight_at_fault))
    detection = "not seen" if report.detection_s is None else f"{report.detection_s:.2f} s"
    if report.rollout is not None:
        ro = report.rollout
        t.add_row("rollout", f"{ro.get('state')} {ro.get('failure') or ''}".strip())
        t.add_row("replaced", ", ".join(f"{old} -> {new}" for old, new in ro.get("replaced", [])))
        t.add_row("streams cut by drains", str(ro.get("streams_cut_by_drains", "-")))
        t.add_row(
            "ready replicas before / min during",
            f"{ro.get('ready_before', '-')} / {ro.get('ready_min_during', '-')}",
        )
    elif report.scenario == "pool-loss":
        t.add_row("pool taken down", str(report.pool))
        t.add_row("time to fail over", detection)
        failback = "not seen" if report.failback_s is None else f"{report.failback_s:.2f} s"
        t.add_row("time to fail back (after the pool returned)", failback)
        t.add_row("failed before a first token", str(report.failed_before_first_token))
        t.add_row("retried on another replica", f"{report.retries:g}")
    elif report.scenario != "rolling-restart":
        why = f" ({report.detected_as})" if report.detected_as else ""
        t.add_row("detection time", detection + why)
    amp = report.retry_amplification
    t.add_row(
        "retry amplification",
        "-" if amp is None else f"{amp:.2f} ({report.upstream_attempts:g} upstream attempts)",
    )
    t.add_row(
        "TTFT p50 / p99 before",
        f"{_ms(report.baseline.ttft_p50_s)} / {_ms(report.baseline.ttft_p99_s)}",
    )
    t.add_row(
        "TTFT p50 / p99 during",
        f"{_ms(report.during.ttft_p50_s)} / {_ms(report.during.ttft_p99_s)}",
    )
    t.add_row(f"before ({report.baseline_s:.1f} s)", _phase(report.baseline))
    t.add_row(f"during ({report.fault_s:.1f} s)", _phase(report.during))
    if report.burst is not None:
        t.add_row("extra load", _phase(report.burst))
    t.add_row("shed rate", f"{report.shed_per_s:.2f}/s")
    if report.scenario == "preemption-storm" or any(report.preemptions.values()):
        t.add_row(
            "preemptions",
            ", ".join(f"{rid} {n:g}" for rid, n in sorted(report.preemptions.items())),
        )
    if report.health_during_fault is not None:
        t.add_row("target /health during", str(report.health_during_fault or "no answer"))
    if report.fault is not None:
        t.add_row("back in routing while faulted", str(report.readmitted))
        t.add_row("fault cleared", "yes" if report.cleared else "no")
    console.print(t)
    for error, count in report.errors.items():
        console.print(f"error x{count}: {error}")
    for note in report.notes:
        console.print(f"note: {note}")


def run(args: argparse.Namespace) -> int:
    console = Console(width=120, stderr=True)

    def log(line: str) -> None:
        if not args.json:
            console.print(f"[dim]{line}[/dim]")

    try:
        drill = Drill(
            args.admin,
            args.admin_token,
            cast(Scenario, args.scenario),
            duration_s=args.duration,
            concurrency=args.concurrency,
            api_key=args.api_key,
            target=args.target,
            max_tokens=args.max_tokens,
            log=log,
        )
        report = asyncio.run(drill.run())
    except DrillError as e:
        print(f"seawall drill: {e}", file=sys.stderr)
        return e.code
    if args.json:
        sys.stdout.write(orjson.dumps(report.as_dict(), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        render(report, Console(width=120))
    return EXIT_OK
