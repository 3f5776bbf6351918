"""`seawall alerts`: write the Prometheus rule file; `seawall alerts check`: metric drift.

Owns the command line of the rule generator and of the drift check, and their I/O
(writing the file, fetching a scrape). The rules live in `ops.rules`, the comparison
in `ops.drift`.
"""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import fields
from pathlib import Path

import yaml

from seawall.ops import rules
from seawall.ops.drift import find_drift, is_gateway_name
from seawall.ops.engines import ENGINES
from seawall.ops.promql import exposed_sample_names, metric_names

FETCH_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engine", choices=ENGINES, default=None, help="engine the rules read (default: vllm)"
    )
    parser.add_argument("-o", "--output", help="write the rule file here (default: stdout)")
    for f in fields(rules.AlertConfig):
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=type(f.default),
            default=f.default,
            metavar="DURATION" if isinstance(f.default, str) else "N",
            help=f"{f.metadata['help']} (default: {f.default})",
        )
    sub = parser.add_subparsers(dest="alerts_action", metavar="ACTION")
    check = sub.add_parser(
        "check",
        help="report metric names the rules or the fleet adapter use that a scrape lacks",
        description="Exit status 1 when any name is missing (drift), 2 when the scrape fails.",
    )
    check.add_argument("--metrics-url", required=True, help="an engine's or gateway's /metrics")
    check.add_argument("--rules", help="a rule file to check (default: the generated rules)")
    check.add_argument(
        "--engine",
        dest="check_engine",
        choices=ENGINES,
        default=None,
        help="engine behind --metrics-url (default: detected from the scrape, else vllm)",
    )
    check.add_argument(
        "--scope",
        choices=("auto", "engine", "gateway", "all"),
        default="auto",
        help="which names to check; auto: gateway names for a gateway scrape, engine "
        "names for an engine scrape",
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "alerts_action", None) == "check":
        return _check(args)
    return _write(args)


def _config(args: argparse.Namespace) -> rules.AlertConfig:
    return rules.AlertConfig(**{f.name: getattr(args, f.name) for f in fields(rules.AlertConfig)})


def _command_line(args: argparse.Namespace) -> str:
    parts = ["seawall alerts"]
    if args.engine:
        parts.append(f"--engine {args.engine}")
    defaults = rules.AlertConfig()
    for f in fields(rules.AlertConfig):
        value = getattr(args, f.name)
        if value != getattr(defaults, f.name):
            parts.append(f"--{f.name.replace('_', '-')} {value}")
    return " ".join(parts)


def _write(args: argparse.Namespace) -> int:
    try:
        ruleset = rules.build(args.engine or "vllm", _config(args))
    except ValueError as e:
        print(f"seawall alerts: {e}", file=sys.stderr)
        return 2
    text = rules.render(ruleset, _command_line(args))
    for o in ruleset.omitted:
        print(f"seawall alerts: left out {o.alert}: {o.reason}", file=sys.stderr)
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _fetch(url: str) -> str:
    # A plain Accept header: with OpenMetrics some clients rewrite `vllm:` sample names
    # (engines.md §1.1), and the fleet scraper reads the plain format too.
    req = urllib.request.Request(url, headers={"Accept": "text/plain"})
    with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S) as resp:
        body: bytes = resp.read()
    return body.decode("utf-8", errors="replace")


def _check(args: argparse.Namespace) -> int:
    from seawall.fleet.adapters import ADAPTER_METRICS, EngineKind, detect_engine

    try:
        text = _fetch(args.metrics_url)
    except (urllib.error.URLError, OSError) as e:
        print(f"seawall alerts check: cannot read {args.metrics_url}: {e}", file=sys.stderr)
        return 2
    exposed = exposed_sample_names(text)
    detected = detect_engine(text)
    engine = args.check_engine or args.engine
    if engine is None:
        engine = "vllm" if detected in (None, EngineKind.VLLM_LEGACY) else str(detected)

    used: dict[str, list[str]] = defaultdict(list)
    if args.rules:
        try:
            doc = yaml.safe_load(Path(args.rules).read_text())
        except (OSError, yaml.YAMLError) as e:
            print(f"seawall alerts check: cannot read {args.rules}: {e}", file=sys.stderr)
            return 2
        exprs = rules.rule_exprs(doc)
        source = args.rules
    else:
        exprs = {a.name: a.expr for a in rules.build(engine, _config(args)).alerts()}
        source = f"seawall alerts --engine {engine}"
    for alert, expr in exprs.items():
        for name in metric_names(expr):
            used[name].append(f"rule {alert}")
    for name in ADAPTER_METRICS[EngineKind(engine)]:
        used[name].append(f"fleet adapter ({engine})")

    is_gateway = any(is_gateway_name(n) for n in exposed)
    scope = args.scope
    if scope == "auto":
        scope = "gateway" if is_gateway and detected is None else "engine"
    drifts = find_drift(
        used,
        exposed,
        check_gateway=scope in ("gateway", "all"),
        check_engine=scope in ("engine", "all"),
    )
    checked = sum(
        1
        for n in used
        if (is_gateway_name(n) and scope in ("gateway", "all"))
        or (not is_gateway_name(n) and scope in ("engine", "all"))
    )
    if not drifts:
        print(
            f"ok: all {checked} {scope} metric names used by {source} and the fleet adapter "
            f"are exported by {args.metrics_url}"
        )
        return 0
    print(
        f"drift: {len(drifts)} of {checked} {scope} metric names used by {source} or the "
        f"fleet adapter are not exported by {args.metrics_url}; alerts over them never fire:"
    )
    for d in drifts:
        print("  " + d.describe())
    return 1
