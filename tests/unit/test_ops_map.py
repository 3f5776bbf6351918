"""The failure-domain map: every domain has a control and a real proof metric, and the
live summaries read the admin state document, tolerating missing keys."""

from __future__ import annotations

from typing import Any

from prometheus_client import generate_latest

from seawall.metrics import Metrics
from seawall.ops.domains import DOMAINS, live_states
from seawall.ops.promql import exposed_sample_names, metric_names
from tests.support.golden import GOLDEN_SCRAPE

GOLDEN = GOLDEN_SCRAPE

STATE: dict[str, Any] = {
    "replicas": [
        {
            "id": "r1",
            "node": "n1",
            "state": "ready",
            "routable": True,
            "score": 0.9,
            "load": {"running": 4, "waiting": 2, "kv_usage": 0.97},
            "restarts": 1,
            "saturated": True,
        },
        {
            "id": "r2",
            "node": "n2",
            "state": "stuck",
            "reason": "no progress for 30s",
            "routable": False,
            "score": 0.3,
            "load": {"running": 2, "waiting": 0, "kv_usage": 0.5},
            "restarts": 2,
            "saturated": False,
        },
    ],
    "retry_budget": {"level": 3.5, "ratio": 0.2},
    "draining": False,
    "limits": {"backend": "redis", "degraded": True, "tenants": 7},
    "hedging": {"enabled": True},
    "migration": {"tiers": ["replay"]},
    "timeouts": {"ttft_s": 30, "itl_s": 10, "total_s": 600},
    "nodes": [
        {"node": "n1", "cordoned": False, "restarts_in_window": 0},
        {"node": "n2", "cordoned": True, "restarts_in_window": 3},
    ],
}


def test_the_five_domains_each_have_controls_and_proof() -> None:
    assert [d.key for d in DOMAINS] == ["bad_request", "overload", "crash", "gpu", "fleet"]
    for d in DOMAINS:
        assert d.controls and d.proof


def test_every_proof_metric_is_exported_by_the_gateway_or_vllm() -> None:
    # Labelled families with no child yet count by their TYPE line.
    known = exposed_sample_names(generate_latest(Metrics().registry).decode())
    known |= exposed_sample_names(GOLDEN.read_text())
    for d in DOMAINS:
        for expr in d.proof:
            assert metric_names(expr) <= known, (d.key, expr)


def test_live_state_reads_a_full_admin_document() -> None:
    live = live_states(STATE)
    assert (
        live["bad_request"] == "limits backend redis, DEGRADED (failure mode in force), 7 tenants"
    )
    assert "1 of 2 replicas saturated (r1)" in live["overload"]
    assert "max KV usage 97%" in live["overload"]
    assert "1 of 2 replicas routable" in live["crash"]
    assert "r2: stuck (no progress for 30s)" in live["crash"]
    assert "3 restarts" in live["crash"] and "ttft=30s" in live["crash"]
    assert "1 of 2 nodes cordoned (n2)" in live["gpu"]
    assert "lowest health score 0.30 (r2)" in live["gpu"]
    assert "retry budget 3.5 (ratio 0.2)" in live["fleet"] and "not draining" in live["fleet"]


def test_live_state_tolerates_missing_and_odd_keys() -> None:
    for doc in ({}, {"replicas": None, "nodes": "x", "limits": 3}, {"replicas": [{}, 5]}):
        live = live_states(doc)
        assert set(live) == {d.key for d in DOMAINS}
        assert all(isinstance(v, str) and v for v in live.values())
