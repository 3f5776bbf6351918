"""The Prometheus alert rules Seawall ships: what each alert means, its PromQL, its file.

Owns the rule set (engine alerts per `--engine`, and the gateway's own alerts), the
thresholds and windows operators may change (`AlertConfig`), and the YAML rendering.
Gateway names come from `seawall.metrics`, engine names from `ops.engines`:
nothing here retypes a metric name, so a rename breaks a test instead of an alert.

Must not do I/O: `seawall alerts` (ops/alerts_cli.py) writes the file.

Why these alerts: each one watches a control that contains a failure domain (see
`ops.domains`). Engine alerts aggregate `by (job, instance)` so that data-parallel
engines or SGLang ranks behind one replica alert once per replica.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from seawall import metrics as m
from seawall.ops.engines import ENGINE_NAMES, EngineNames

_DURATION = re.compile(r"^\d+(ms|s|m|h|d|w|y)$")

PER_REPLICA = "job, instance"


def _opt(default: Any, help_text: str) -> Any:
    return field(default=default, metadata={"help": help_text})


@dataclass(frozen=True, slots=True)
class AlertConfig:
    """Thresholds and windows. Every field is a `seawall alerts --<field>` option."""

    preemption_rate_per_s: float = _opt(0.5, "preemptions per second per replica")
    preemption_window: str = _opt("5m", "rate window for preemptions")
    preemption_for: str = _opt("10m", "how long preemption must last")
    kv_usage_ratio: float = _opt(0.95, "KV-cache usage (0..1) counted as full")
    kv_waiting_min: float = _opt(1.0, "waiting requests that make a full KV cache alert")
    kv_for: str = _opt("5m", "how long KV must stay full with requests waiting")
    queue_growth_per_s: float = _opt(0.1, "waiting-queue growth (requests/s) that alerts")
    queue_waiting_min: float = _opt(5.0, "waiting requests below which growth is ignored")
    queue_window: str = _opt("10m", "window over which queue growth is measured")
    queue_for: str = _opt("5m", "how long the queue must keep growing")
    stuck_window: str = _opt("2m", "window in which a busy replica must make progress")
    stuck_for: str = _opt("1m", "how long a replica must be stuck before alerting")
    retry_exhausted_per_s: float = _opt(0.0, "refused retries/s above which to alert")
    retry_window: str = _opt("5m", "rate window for retry-budget exhaustion")
    retry_for: str = _opt("5m", "how long the budget must stay exhausted")
    shed_ratio: float = _opt(0.05, "fraction of requests shed at the door that alerts")
    shed_window: str = _opt("5m", "rate window for shedding")
    shed_for: str = _opt("10m", "how long shedding must last")
    ttft_slo_s: float = _opt(2.5, "TTFT target in seconds (a bucket of seawall_ttft_seconds)")
    ttft_slo_objective: float = _opt(0.99, "fraction of requests that must meet the target")
    ttft_fast_burn: float = _opt(14.4, "fast burn-rate factor (pages)")
    ttft_fast_long_window: str = _opt("1h", "fast burn: long window")
    ttft_fast_short_window: str = _opt("5m", "fast burn: short window")
    ttft_fast_for: str = _opt("2m", "fast burn: for")
    ttft_slow_burn: float = _opt(6.0, "slow burn-rate factor (tickets)")
    ttft_slow_long_window: str = _opt("6h", "slow burn: long window")
    ttft_slow_short_window: str = _opt("30m", "slow burn: short window")
    ttft_slow_for: str = _opt("15m", "slow burn: for")
    deep_probe_failures: float = _opt(3.0, "deep-probe failures per replica that alert")
    deep_probe_window: str = _opt("5m", "window for deep-probe failures")
    cordon_for: str = _opt("0m", "how long a node must stay cordoned before alerting")
    stream_error_ratio: float = _opt(
        0.01, "fraction of answered requests whose stream was cut mid-way that alerts"
    )
    stream_error_window: str = _opt("5m", "rate window for mid-stream failures")
    stream_error_for: str = _opt("10m", "how long mid-stream failures must last")

    def validate(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, str) and not _DURATION.match(value):
                raise ValueError(f"{f.name}={value!r} is not a Prometheus duration like 5m")
            if isinstance(value, float) and value < 0:
                raise ValueError(f"{f.name}={value} must not be negative")
        if self.ttft_slo_s not in m.TTFT_BUCKETS_S:
            # The SLO counts requests under a bucket bound; between bounds it cannot.
            raise ValueError(
                f"ttft_slo_s={self.ttft_slo_s} must be a bucket of {m.TTFT}: {m.TTFT_BUCKETS_S}"
            )
        if not 0 < self.ttft_slo_objective < 1:
            raise ValueError("ttft_slo_objective must be between 0 and 1")


@dataclass(frozen=True, slots=True)
class Alert:
    name: str
    expr: str
    for_: str
    severity: str  # page: a person acts now; ticket: act within the day
    domain: str  # the failure domain this alert watches (ops.domains)
    summary: str
    description: str

    def as_rule(self) -> dict[str, Any]:
        return {
            "alert": self.name,
            "expr": self.expr,
            "for": self.for_,
            "labels": {"severity": self.severity, "domain": self.domain},
            "annotations": {"summary": self.summary, "description": self.description},
        }


@dataclass(frozen=True, slots=True)
class Omitted:
    alert: str
    reason: str


@dataclass(frozen=True, slots=True)
class RuleSet:
    engine: str
    engine_alerts: tuple[Alert, ...]
    gateway_alerts: tuple[Alert, ...]
    omitted: tuple[Omitted, ...]

    def alerts(self) -> tuple[Alert, ...]:
        return self.engine_alerts + self.gateway_alerts


def _engine_alerts(n: EngineNames, c: AlertConfig) -> tuple[list[Alert], list[Omitted]]:
    alerts: list[Alert] = []
    omitted: list[Omitted] = []
    inst = "{{ $labels.instance }}"

    def need(alert: str, **names: str | None) -> bool:
        missing = [k for k, v in names.items() if v is None]
        if missing:
            why = f"{n.engine} exports no {' or '.join(missing)} metric"
            omitted.append(Omitted(alert, why))
        return not missing

    if need("SeawallEnginePreemptionSustained", preemptions=n.preemptions_total):
        alerts.append(
            Alert(
                "SeawallEnginePreemptionSustained",
                f"sum by ({PER_REPLICA}) (rate({n.preemptions_total}[{c.preemption_window}]))"
                f" > {c.preemption_rate_per_s}",
                c.preemption_for,
                "ticket",
                "overload",
                f"Replica {inst} keeps preempting running requests",
                "The engine evicts running requests to free KV cache and recomputes them: "
                "throughput drops and latency rises. Lower max_num_seqs, add replicas, or "
                "let admission control hold work at the gateway.",
            )
        )
    if need("SeawallEngineKvCacheFull", kv_usage=n.kv_usage, waiting=n.waiting):
        alerts.append(
            Alert(
                "SeawallEngineKvCacheFull",
                f"max by ({PER_REPLICA}) ({n.kv_usage}) >= {c.kv_usage_ratio}"
                f"\nand sum by ({PER_REPLICA}) ({n.waiting}) >= {c.kv_waiting_min}",
                c.kv_for,
                "ticket",
                "overload",
                f"Replica {inst} has a full KV cache while requests wait",
                "New requests cannot be admitted until running ones finish. The gateway "
                "should mark this replica saturated; if it keeps happening, add capacity.",
            )
        )
    if need("SeawallEngineQueueGrowing", waiting=n.waiting):
        alerts.append(
            Alert(
                "SeawallEngineQueueGrowing",
                f"sum by ({PER_REPLICA}) (deriv({n.waiting}[{c.queue_window}]))"
                f" > {c.queue_growth_per_s}"
                f"\nand sum by ({PER_REPLICA}) ({n.waiting}) >= {c.queue_waiting_min}",
                c.queue_for,
                "page",
                "overload",
                f"The waiting queue on {inst} grows faster than it drains",
                "Arrivals exceed what the replica completes; waits will grow until clients "
                "time out. Check gateway admission and shedding, and capacity.",
            )
        )
    if need("SeawallReplicaStuck", running=n.running, progress=n.progress_total):
        alerts.append(
            Alert(
                "SeawallReplicaStuck",
                f"sum by ({PER_REPLICA}) ({n.running}) > 0"
                f"\nand sum by ({PER_REPLICA}) (increase({n.progress_total}[{c.stuck_window}]))"
                " == 0",
                c.stuck_for,
                "page",
                "crash",
                f"Replica {inst} has running requests but makes no progress",
                "A hung engine answers its liveness probe but generates nothing. The fleet "
                "watchdog should have restarted it; if this fires, the watchdog did not.",
            )
        )
    return alerts, omitted


def _ttft_error_ratio(c: AlertConfig, window: str) -> str:
    # prometheus_client prints bucket bounds like Python's repr for these magnitudes
    # ("2.5", "1.0", "0.005"); the label must match it byte for byte.
    le = repr(float(c.ttft_slo_s))
    good = f'sum by (model) (rate({m.TTFT}_bucket{{le="{le}"}}[{window}]))'
    total = f"sum by (model) (rate({m.TTFT}_count[{window}]))"
    return f"(1 - {good} / {total})"


def _burn(c: AlertConfig, long_w: str, short_w: str, factor: float) -> str:
    budget = round(1 - c.ttft_slo_objective, 10)
    return (
        f"{_ttft_error_ratio(c, long_w)} > ({factor} * {budget})"
        f"\nand {_ttft_error_ratio(c, short_w)} > ({factor} * {budget})"
    )


def _gateway_alerts(c: AlertConfig) -> list[Alert]:
    slo = f"{c.ttft_slo_objective:.4g} of first tokens within {c.ttft_slo_s:g}s"
    return [
        Alert(
            "SeawallRetryBudgetExhausted",
            f"sum by ({PER_REPLICA}) (rate({m.RETRY_BUDGET_EXHAUSTED}[{c.retry_window}]))"
            f" > {c.retry_exhausted_per_s}",
            c.retry_for,
            "ticket",
            "fleet",
            "Gateway {{ $labels.instance }} refuses retries: the retry budget is empty",
            "Failures are widespread enough that retrying would amplify load. The budget "
            "is doing its job; find why so many attempts fail.",
        ),
        Alert(
            "SeawallSheddingSustained",
            f"sum by ({PER_REPLICA}) (rate({m.SHED}[{c.shed_window}]))"
            f" / sum by ({PER_REPLICA}) (rate({m.REQUESTS}[{c.shed_window}]))"
            f" > {c.shed_ratio}",
            c.shed_for,
            "page",
            "overload",
            "Gateway {{ $labels.instance }} sheds a sustained share of requests",
            "Requests are refused at the door (429/503) because tenants exceed their "
            "limits or the fleet is saturated. Add capacity or revisit limits.",
        ),
        Alert(
            "SeawallTtftSloBurnFast",
            _burn(c, c.ttft_fast_long_window, c.ttft_fast_short_window, c.ttft_fast_burn),
            c.ttft_fast_for,
            "page",
            "overload",
            "Model {{ $labels.model }} burns its TTFT error budget fast",
            f"SLO: {slo}. At this burn rate the budget is gone in hours.",
        ),
        Alert(
            "SeawallTtftSloBurnSlow",
            _burn(c, c.ttft_slow_long_window, c.ttft_slow_short_window, c.ttft_slow_burn),
            c.ttft_slow_for,
            "ticket",
            "overload",
            "Model {{ $labels.model }} burns its TTFT error budget",
            f"SLO: {slo}. At this burn rate the budget is gone within days.",
        ),
        Alert(
            "SeawallDeepProbeFailing",
            f"sum by ({PER_REPLICA}, replica) (increase({m.DEEP_PROBE_FAILURES}"
            f"[{c.deep_probe_window}])) >= {c.deep_probe_failures}",
            "0m",
            "ticket",
            "crash",
            "Deep probes fail on replica {{ $labels.replica }}",
            "The replica answers /health but cannot generate one token. The fleet "
            "should restart it; repeated failures point at the GPU or the model.",
        ),
        Alert(
            "SeawallStreamsCutMidway",
            # Against requests answered 200: a stream is cut only after its headers went
            # out, so a refused request can never be one.
            f"sum by ({PER_REPLICA}) (rate({m.STREAM_ERRORS}[{c.stream_error_window}]))"
            f'\n/ sum by ({PER_REPLICA}) (rate({m.REQUESTS}{{status="200"}}'
            f"[{c.stream_error_window}]))"
            f" > {c.stream_error_ratio}",
            c.stream_error_for,
            "ticket",
            "crash",
            "Gateway {{ $labels.instance }} relays streams that break off mid-way",
            "Clients received part of an answer and then an error event: a replica died, "
            "hung or reset the connection after the first token, past the point where a "
            "retry is possible. Check the replicas' restarts and deep probes; enable "
            "migration (tiers.<tier>.migrate) to continue such streams elsewhere.",
        ),
        Alert(
            "SeawallNodeCordoned",
            f"max by (node) ({m.NODE_CORDONED}) == 1",
            c.cordon_for,
            "ticket",
            "gpu",
            "Node {{ $labels.node }} is cordoned",
            "Seawall cordoned the node after repeated restarts or GPU errors and opened "
            "a hardware ticket. Replace or repair the GPU, then uncordon.",
        ),
    ]


def build(engine: str = "vllm", config: AlertConfig | None = None) -> RuleSet:
    config = config or AlertConfig()
    config.validate()
    names = ENGINE_NAMES[engine]
    engine_alerts, omitted = _engine_alerts(names, config)
    return RuleSet(engine, tuple(engine_alerts), tuple(_gateway_alerts(config)), tuple(omitted))


class _Dumper(yaml.SafeDumper):
    """Multi-line expressions as literal blocks, so the file reads like PromQL."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def render(rules: RuleSet, command: str) -> str:
    """The rule file text: deterministic, so the committed copy can be compared."""
    doc = {
        "groups": [
            {
                "name": f"seawall-engine-{rules.engine}",
                "rules": [a.as_rule() for a in rules.engine_alerts],
            },
            {"name": "seawall-gateway", "rules": [a.as_rule() for a in rules.gateway_alerts]},
        ]
    }
    header = [f"# Generated by `{command}`. Do not edit: regenerate."]
    header += [f"# Left out: {o.alert} ({o.reason})." for o in rules.omitted]
    body = yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100, allow_unicode=True)
    return "\n".join(header) + "\n" + body


def rule_exprs(doc: Any) -> dict[str, str]:
    """alert or record name -> expr, for every rule in a parsed rule file."""
    out: dict[str, str] = {}
    for group in (doc or {}).get("groups", []) or []:
        for rule in group.get("rules", []) or []:
            name = rule.get("alert") or rule.get("record") or "?"
            out[str(name)] = str(rule.get("expr", ""))
    return out
