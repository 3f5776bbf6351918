"""The Grafana dashboard: every query graphs a metric that really exists, and the
committed JSON is what the generator produces today."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from prometheus_client import generate_latest

from seawall.metrics import Metrics
from seawall.ops import dashboard
from seawall.ops.promql import exposed_sample_names, metric_names
from tests.support.golden import GOLDEN_SCRAPE
from tests.support.procs import REPO

GOLDEN = GOLDEN_SCRAPE
COMMITTED = REPO / "deploy" / "grafana" / "seawall-dashboard.json"


def _known_names() -> set[str]:
    # Labelled families with no child yet count by their TYPE line.
    known = exposed_sample_names(generate_latest(Metrics().registry).decode())
    return known | exposed_sample_names(GOLDEN.read_text())


def _queries(doc: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for panel in doc["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def test_every_panel_query_uses_an_exported_metric() -> None:
    doc = json.loads(COMMITTED.read_text())
    known = _known_names()
    queries = _queries(doc)
    assert len(queries) >= 20
    for title, expr in queries:
        names = metric_names(expr)
        assert names, (title, expr)
        assert names <= known, (title, names - known)
    for var in doc["templating"]["list"]:
        for name in re.findall(r"label_values\(([^,)]+)", str(var.get("query", ""))):
            assert name.strip() in known


def test_a_made_up_metric_would_be_caught() -> None:
    # Guards the check above: the extractor must see names inside panel queries.
    assert "seawall_made_up_total" not in _known_names()
    assert "seawall_made_up_total" in metric_names(
        "sum by (x) (rate(seawall_made_up_total[$__rate_interval]))"
    )


def test_committed_dashboard_is_what_the_generator_produces() -> None:
    assert COMMITTED.read_text() == dashboard.render("vllm"), (
        "run: python -m seawall.ops.dashboard > " + str(COMMITTED)
    )


@pytest.mark.parametrize("engine", ["sglang", "tgi", "llamacpp"])
def test_other_engines_get_a_dashboard_without_missing_signals(engine: str) -> None:
    doc = dashboard.build(engine)
    assert all("vllm:" not in expr for _, expr in _queries(doc))
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
