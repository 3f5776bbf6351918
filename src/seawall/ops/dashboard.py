"""The Grafana dashboard Seawall ships (deploy/grafana/seawall-dashboard.json).

Owns the panels and their PromQL. Every name comes from `seawall.metrics` or
`ops.engines`, and a test checks each query's metrics against the gateway's registry
and a real engine scrape, so a panel never graphs a series nobody exports.

Pure: `build()` returns the JSON document. `python -m seawall.ops.dashboard [ENGINE]`
prints it; the committed file must equal that output (tested).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from seawall import metrics as m
from seawall.ops.engines import ENGINE_NAMES

RATE = "[$__rate_interval]"
MODEL = '{model=~"$model"}'
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PANEL_W, PANEL_H, PER_ROW = 8, 8, 3


def _quantiles(family: str, selector: str = "") -> list[tuple[str, str]]:
    return [
        (
            f"histogram_quantile({q}, sum by (le) (rate({family}_bucket{selector}{RATE})))",
            f"p{round(q * 100)}",
        )
        for q in (0.5, 0.99)
    ]


def _sections(engine: str) -> list[tuple[str, list[tuple[str, str, list[tuple[str, str]]]]]]:
    """(row title, [(panel title, unit, [(expr, legend)])])."""
    n = ENGINE_NAMES[engine]
    by_inst = "sum by (instance)"
    gateway = [
        (
            "Requests by status",
            "reqps",
            [(f"sum by (status) (rate({m.REQUESTS}{MODEL}{RATE}))", "{{status}}")],
        ),
        ("Time to first token (client view)", "s", _quantiles(m.TTFT, MODEL)),
        ("Inter-token gap (client view)", "s", _quantiles(m.ITL, MODEL)),
        ("Request duration", "s", _quantiles(m.E2E, MODEL)),
        ("In flight per replica", "short", [(f"sum by (replica) ({m.INFLIGHT})", "{{replica}}")]),
        (
            "Upstream attempts by outcome",
            "reqps",
            [(f"sum by (outcome) (rate({m.UPSTREAM_ATTEMPTS}{RATE}))", "{{outcome}}")],
        ),
        (
            "Shed at the door, by reason",
            "reqps",
            [(f"sum by (reason) (rate({m.SHED}{RATE}))", "{{reason}}")],
        ),
        ("Admission queue", "short", [(f"sum by (model) ({m.QUEUE_DEPTH})", "{{model}}")]),
        (
            "Retries and the retry budget",
            "short",
            [
                (f"sum by (reason) (rate({m.RETRIES}{RATE}))", "retries/s {{reason}}"),
                (f"sum(rate({m.RETRY_BUDGET_EXHAUSTED}{RATE}))", "refused/s"),
                (f"min({m.RETRY_BUDGET})", "budget tokens"),
            ],
        ),
        (
            "Timeouts by kind",
            "reqps",
            [(f"sum by (kind) (rate({m.TIMEOUTS}{RATE}))", "{{kind}}")],
        ),
        (
            "Streams cut mid-way, by cause",
            "reqps",
            [(f"sum by (reason) (rate({m.STREAM_ERRORS}{RATE}))", "{{reason}}")],
        ),
        (
            "Hedges and migrations",
            "reqps",
            [
                (f"sum by (outcome) (rate({m.HEDGES}{RATE}))", "hedge {{outcome}}"),
                (f"sum by (outcome) (rate({m.MIGRATIONS}{RATE}))", "migration {{outcome}}"),
            ],
        ),
        (
            "Client cancellations",
            "reqps",
            [(f"sum by (stage) (rate({m.CANCELLATIONS}{RATE}))", "{{stage}}")],
        ),
    ]
    fleet = [
        ("Health score", "percentunit", [(f"min by (replica) ({m.REPLICA_SCORE})", "{{replica}}")]),
        (
            "Health score factors",
            "percentunit",
            [(f"min by (replica, part) ({m.REPLICA_SCORE_PART})", "{{replica}} {{part}}")],
        ),
        (
            "Replicas by state",
            "short",
            [
                (f"sum by (state) ({m.REPLICA_STATE})", "{{state}}"),
                (f"sum({m.REPLICA_READY})", "ready"),
            ],
        ),
        (
            "Deep-probe failures",
            "short",
            [(f"sum by (replica) (increase({m.DEEP_PROBE_FAILURES}{RATE}))", "{{replica}}")],
        ),
        (
            "Restarts by reason",
            "short",
            [(f"sum by (node, reason) (increase({m.RESTARTS}{RATE}))", "{{node}} {{reason}}")],
        ),
        (
            "Nodes cordoned, hardware tickets",
            "short",
            [
                (f"max by (node) ({m.NODE_CORDONED})", "cordoned {{node}}"),
                (f"sum by (node) (increase({m.HARDWARE_TICKETS}{RATE}))", "tickets {{node}}"),
            ],
        ),
        (
            "Gateway state",
            "short",
            [
                (f"max({m.DRAINING})", "draining"),
                (f"max({m.RATELIMIT_BACKEND_DEGRADED})", "rate-limit backend degraded"),
                # Fewest instances any gateway counts: a fail-open fallback holds 1/N.
                (f"min({m.RATELIMIT_INSTANCES})", "instances sharing tenant limits (fewest)"),
            ],
        ),
        (
            "Shed latency",
            "s",
            [
                (
                    f"histogram_quantile(0.99, sum by (le) (rate({m.SHED_LATENCY}_bucket{RATE})))",
                    "p99",
                )
            ],
        ),
    ]
    engines: list[tuple[str, str, list[tuple[str, str]]]] = []
    if n.running and n.waiting:
        engines.append(
            (
                "Running and waiting",
                "short",
                [
                    (f"{by_inst} ({n.running})", "running {{instance}}"),
                    (f"{by_inst} ({n.waiting})", "waiting {{instance}}"),
                ],
            )
        )
    if n.kv_usage:
        engines.append(
            (
                "KV-cache usage",
                "percentunit",
                [(f"max by (instance) ({n.kv_usage})", "{{instance}}")],
            )
        )
    if n.preemptions_total:
        engines.append(
            (
                "Preemptions",
                "ops",
                [(f"{by_inst} (rate({n.preemptions_total}{RATE}))", "{{instance}}")],
            )
        )
    if n.progress_total:
        engines.append(
            (
                "Progress (stuck when flat while requests run)",
                "ops",
                [(f"{by_inst} (rate({n.progress_total}{RATE}))", "{{instance}}")],
            )
        )
    if n.ttft_seconds:
        engines.append(("Time to first token (engine view)", "s", _quantiles(n.ttft_seconds)))
    return [("Gateway", gateway), ("Fleet", fleet), (f"Engines ({engine})", engines)]


def build(engine: str = "vllm") -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    y = 0
    panel_id = 1
    for title, section in _sections(engine):
        panels.append(
            {
                "type": "row",
                "title": title,
                "id": panel_id,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                "panels": [],
            }
        )
        panel_id += 1
        y += 1
        for k, (panel_title, unit, targets) in enumerate(section):
            panels.append(
                {
                    "type": "timeseries",
                    "title": panel_title,
                    "id": panel_id,
                    "datasource": DATASOURCE,
                    "gridPos": {
                        "h": PANEL_H,
                        "w": PANEL_W,
                        "x": (k % PER_ROW) * PANEL_W,
                        "y": y + (k // PER_ROW) * PANEL_H,
                    },
                    "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
                    "options": {"legend": {"displayMode": "list", "placement": "bottom"}},
                    "targets": [
                        {
                            "datasource": DATASOURCE,
                            "expr": expr,
                            "legendFormat": legend,
                            "refId": chr(65 + t),
                        }
                        for t, (expr, legend) in enumerate(targets)
                    ],
                }
            )
            panel_id += 1
        y += -(-len(section) // PER_ROW) * PANEL_H
    return {
        "title": f"Seawall ({engine})",
        "uid": f"seawall-{engine}",
        "tags": ["seawall", "llm-serving"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "editable": True,
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "type": "datasource",
                    "query": "prometheus",
                    "label": "Data source",
                },
                {
                    "name": "model",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": f"label_values({m.REQUESTS}, model)",
                    "includeAll": True,
                    "multi": True,
                    "allValue": ".*",
                    "current": {"text": "All", "value": "$__all"},
                    "refresh": 2,
                },
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render(engine: str = "vllm") -> str:
    return json.dumps(build(engine), indent=2) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render(sys.argv[1] if len(sys.argv) > 1 else "vllm"))
