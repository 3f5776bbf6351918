"""Series the gateway can name in advance exist at zero before their first event.

A labelled counter born at its first event shows "No data" on a dashboard and is
invisible to `increase()` (no earlier sample to rise from): DeepProbeFailing missed
each replica's first failure that way.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import get_args

from prometheus_client import generate_latest

import seawall.gateway
from seawall import metrics as m
from seawall.gateway.outcomes import Attempt, StreamEnd
from seawall.metrics import Metrics
from seawall.state.limits import DenyReason

GATEWAY_SRC = Path(seawall.gateway.__file__).parent


def scrape(metrics: Metrics) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
    return out


def test_a_fresh_gateway_exports_nothing_for_labelled_events() -> None:
    # The state before seeding, which the dashboard showed as "No data".
    series = scrape(Metrics(process=False))
    assert not any(s.startswith(m.DEEP_PROBE_FAILURES + "{") for s in series)
    assert not any(s.startswith(m.HEDGES + "{") for s in series)


def test_seeded_series_start_at_zero_per_replica_node_model_tenant_and_reason() -> None:
    metrics = Metrics(process=False)
    metrics.seed(
        replicas=[("r0", "gpu-1"), ("r1", "gpu-2")],
        models=["qwen"],
        tenants={"acme": "gold", "beta": "free"},
    )
    series = scrape(metrics)
    for replica in ("r0", "r1"):
        assert series[f'{m.DEEP_PROBE_FAILURES}{{replica="{replica}"}}'] == 0
        assert series[f'{m.UPSTREAM_ATTEMPTS}{{outcome="ok",replica="{replica}"}}'] == 0
    for node in ("gpu-1", "gpu-2"):
        assert series[f'{m.NODE_CORDONED}{{node="{node}"}}'] == 0
        assert series[f'{m.HARDWARE_TICKETS}{{node="{node}"}}'] == 0
        assert series[f'{m.RESTARTS}{{node="{node}",reason="health check failed"}}'] == 0
    assert series[f'{m.QUEUE_DEPTH}{{model="qwen"}}'] == 0
    assert series[f'{m.REQUESTS}{{model="qwen",route="chat",status="200"}}'] == 0
    assert series[f'{m.TTFT}_count{{model="qwen"}}'] == 0
    assert series[f'{m.SHED}{{reason="max_concurrent",tenant="acme",tier="gold"}}'] == 0
    assert series[f'{m.SHED}{{reason="fleet_saturated",tenant="beta",tier="free"}}'] == 0
    for outcome in ("launched", "won", "lost"):
        assert series[f'{m.HEDGES}{{outcome="{outcome}"}}'] == 0
    for outcome in ("ok", "failed", "refused"):
        assert series[f'{m.MIGRATIONS}{{outcome="{outcome}"}}'] == 0
    assert series[f'{m.STREAM_ERRORS}{{reason="upstream_reset"}}'] == 0


def test_an_open_gateway_seeds_the_anonymous_tenant() -> None:
    metrics = Metrics(process=False)
    metrics.seed(replicas=[("r0", "local")], tenants={})
    series = scrape(metrics)
    assert series[f'{m.SHED}{{reason="fleet_saturated",tenant="default",tier="default"}}'] == 0


def test_seeding_again_never_changes_a_value() -> None:
    metrics = Metrics(process=False)
    metrics.seed(replicas=[("r0", "gpu-1")])
    metrics.deep_probe_failures.labels("r0").inc()
    metrics.node_cordoned.labels("gpu-1").set(1)
    metrics.seed(replicas=[("r0", "gpu-1")])
    series = scrape(metrics)
    assert series[f'{m.DEEP_PROBE_FAILURES}{{replica="r0"}}'] == 1
    assert series[f'{m.NODE_CORDONED}{{node="gpu-1"}}'] == 1


def test_a_departed_replica_loses_its_series() -> None:
    metrics = Metrics(process=False)
    metrics.seed(replicas=[("10.0.0.1:8000", "n1"), ("10.0.0.2:8000", "n1")])
    metrics.upstream_attempts.labels("10.0.0.1:8000", "reset").inc()
    metrics.seed(replicas=[("10.0.0.2:8000", "n1"), ("10.0.0.3:8000", "n1")])
    series = scrape(metrics)
    assert not any('"10.0.0.1:8000"' in s for s in series)
    assert series[f'{m.DEEP_PROBE_FAILURES}{{replica="10.0.0.2:8000"}}'] == 0
    assert series[f'{m.DEEP_PROBE_FAILURES}{{replica="10.0.0.3:8000"}}'] == 0
    # The node keeps its series: a cordon outlives the replicas that were on it.
    assert series[f'{m.NODE_CORDONED}{{node="n1"}}'] == 0


def _string_args(path: Path, call: str, index: int = 0) -> set[str]:
    """Literal arguments at `index` of `<...>.<call>(...)` or `<call>(...)` calls."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
            if name == call and len(node.args) > index:
                arg = node.args[index]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.add(arg.value)
    return found


def test_the_seeded_values_cover_every_label_the_source_writes() -> None:
    # Guards the tables in metrics.py against a new outcome or reason in the code.
    assert {a.value for a in Attempt} <= set(m.ATTEMPT_OUTCOMES)
    assert {e.value for e in StreamEnd} - {"done"} <= set(m.STREAM_ERROR_REASONS)
    retryable = {a.value for a in Attempt if a.value in m.RETRY_REASONS}
    assert {"connect_error", "reset", "http_5xx", "ttft_timeout"} <= retryable
    text = "\n".join(p.read_text() for p in GATEWAY_SRC.glob("*.py"))
    for family, table in (
        ("hedges", m.HEDGE_OUTCOMES),
        ("migrations", m.MIGRATION_OUTCOMES),
        ("cancellations", m.CANCEL_STAGES),
    ):
        used = set(re.findall(rf"metrics\.{family}\.labels\(\"(\w+)\"", text))
        assert used and used <= set(table), (family, used - set(table))
    shed: set[str] = set()
    for path in GATEWAY_SRC.glob("*.py"):
        shed |= _string_args(path, "shed", index=1)
    assert shed and set(get_args(DenyReason)) | shed <= set(m.SHED_REASONS), shed
