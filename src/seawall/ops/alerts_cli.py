"""`seawall alerts`: write the Prometheus rule file; `seawall alerts check`: metric drift.

Owns the command line of the rule generator and of the drift check, and their I/O
(writing the file, fetching a scrape). The rules live in `ops.rules`, the comparison
in `ops.drift`.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import fields
from pathlib import Path

import yaml

from seawall.ops import rules
from seawall.ops.drift import escaped_name, find_drift, is_gateway_name
from seawall.ops.engines import ENGINES
from seawall.ops.promql import metric_names, stored_sample_names

FETCH_TIMEOUT_S = 10.0

# The Accept header each scraper sends, so the check sees the answer Prometheus gets:
# an engine may negotiate (prometheus_client's exporters do) and rename samples.
SCRAPER_ACCEPT = {
    # Prometheus 2.x (2.42, Debian 12): scrape/scrape.go `scrapeAcceptHeader`.
    "prometheus-2": "application/openmetrics-text;version=1.0.0,"
    "application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    # Prometheus 3.x with its default UTF-8 name validation: `escaping=allow-utf-8`.
    "prometheus-3": "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,"
    "text/plain;version=1.0.0;escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2",
    # curl, the gateway's own scraper.
    "plain": "text/plain",
}


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
    source = check.add_mutually_exclusive_group(required=True)
    source.add_argument("--metrics-url", help="an engine's or gateway's /metrics")
    source.add_argument(
        "--prometheus-url",
        help="a Prometheus server: check the names it has stored (what the rules read)",
    )
    check.add_argument(
        "--scraper",
        choices=sorted(SCRAPER_ACCEPT),
        default="prometheus-2",
        help="with --metrics-url: fetch with this scraper's Accept header, so renamed "
        "samples show (default: prometheus-2, the one that gets escaped names)",
    )
    check.add_argument("--job", help="with --prometheus-url: only names stored for this scrape job")
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


def _fetch(url: str, accept: str) -> tuple[str, str]:
    """Body and Content-Type, asked for as the chosen scraper asks."""
    req = urllib.request.Request(url, headers={"Accept": accept})
    with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S) as resp:
        body: bytes = resp.read()
        content_type = str(resp.headers.get("Content-Type", ""))
    return body.decode("utf-8", errors="replace"), content_type


def _stored_names(prometheus_url: str, job: str | None) -> set[str]:
    """Every metric name the server holds (for `job` only, when given)."""
    url = prometheus_url.rstrip("/") + "/api/v1/label/__name__/values"
    if job:
        url += "?" + urllib.parse.urlencode({"match[]": f'{{job="{job}"}}'})
    with urllib.request.urlopen(url, timeout=FETCH_TIMEOUT_S) as resp:
        doc = json.loads(resp.read())
    return {str(n) for n in doc.get("data") or []}


def _check(args: argparse.Namespace) -> int:
    from seawall.fleet.adapters import ADAPTER_METRICS, EngineKind, detect_engine

    target = args.metrics_url or args.prometheus_url
    try:
        if args.metrics_url:
            text, content_type = _fetch(args.metrics_url, SCRAPER_ACCEPT[args.scraper])
            exposed = stored_sample_names(text, content_type)
            detected = detect_engine(text)
        else:
            exposed = _stored_names(args.prometheus_url, args.job)
            detected = None
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"seawall alerts check: cannot read {target}: {e}", file=sys.stderr)
        return 2
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
    if scope == "auto" and args.prometheus_url:
        # One server holds both: check what it holds, the engines' names only when some
        # engine series is there at all (a job of gateways alone has none).
        has_engine = any(not is_gateway_name(n) and n in used for n in exposed) or any(
            escaped_name(n) in exposed for n in used if not is_gateway_name(n)
        )
        scope = "all" if is_gateway and has_engine else "gateway" if is_gateway else "engine"
    elif scope == "auto":
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
            f"are {'stored by' if args.prometheus_url else 'exported by'} {target}"
        )
        return 0
    print(
        f"drift: {len(drifts)} of {checked} {scope} metric names used by {source} or the "
        f"fleet adapter are not {'stored by' if args.prometheus_url else 'exported by'} "
        f"{target}; alerts over them never fire:"
    )
    for d in drifts:
        print("  " + d.describe())
    return 1
