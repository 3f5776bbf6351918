"""The shipped alert rules under the real `promtool`: syntax, and each alert firing on
input series that should fire it and staying silent on series that should not."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from seawall import metrics as m
from seawall.ops import rules
from seawall.ops.engines import ENGINE_NAMES, ENGINES, EngineNames
from tests.support import prometheus_config
from tests.support.procs import REPO, require_binary

pytestmark = pytest.mark.integration

REPLICA = {"job": "engines", "instance": "10.0.0.7:8000"}
GATEWAY = {"job": "seawall", "instance": "10.0.0.2:8080"}


def _series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{inner}}}", "values": values}


def _render(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda mt: labels.get(mt.group(1), ""), template)


def _case(
    alert: rules.Alert,
    series: list[dict[str, str]],
    eval_time: str,
    fires_with: dict[str, str] | None,
) -> dict[str, Any]:
    expected: list[dict[str, Any]] = []
    if fires_with is not None:
        expected.append(
            {
                "exp_labels": {**fires_with, "severity": alert.severity, "domain": alert.domain},
                "exp_annotations": {
                    "summary": _render(alert.summary, fires_with),
                    "description": _render(alert.description, fires_with),
                },
            }
        )
    return {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [
            {"eval_time": eval_time, "alertname": alert.name, "exp_alerts": expected}
        ],
    }


def _engine_cases(n: EngineNames, a: rules.Alert) -> list[dict[str, Any]]:
    """Firing and silent inputs for one engine alert (1 sample per minute)."""
    r = REPLICA
    if a.name == "SeawallEnginePreemptionSustained":
        assert n.preemptions_total
        return [
            _case(a, [_series(n.preemptions_total, r, "0+60x40")], "30m", r),  # 1/s
            _case(a, [_series(n.preemptions_total, r, "0+6x40")], "30m", None),  # 0.1/s
        ]
    if a.name == "SeawallEngineKvCacheFull":
        assert n.kv_usage and n.waiting
        return [
            _case(a, [_series(n.kv_usage, r, "0.97x20"), _series(n.waiting, r, "3x20")], "15m", r),
            # Full cache with nobody waiting is a well-packed batch, not a problem.
            _case(
                a, [_series(n.kv_usage, r, "0.97x20"), _series(n.waiting, r, "0x20")], "15m", None
            ),
            _case(
                a, [_series(n.kv_usage, r, "0.5x20"), _series(n.waiting, r, "3x20")], "15m", None
            ),
        ]
    if a.name == "SeawallEngineQueueGrowing":
        assert n.waiting
        return [
            _case(a, [_series(n.waiting, r, "0+30x40")], "30m", r),  # +0.5 requests/s
            # A long but steady queue drains as fast as it fills.
            _case(a, [_series(n.waiting, r, "40x40")], "30m", None),
        ]
    if a.name == "SeawallReplicaStuck":
        assert n.running and n.progress_total
        return [
            _case(
                a, [_series(n.running, r, "2x20"), _series(n.progress_total, r, "100x20")], "10m", r
            ),
            _case(
                a,
                [_series(n.running, r, "2x20"), _series(n.progress_total, r, "100+50x20")],
                "10m",
                None,
            ),
            # Idle: nothing running, nothing generated.
            _case(
                a,
                [_series(n.running, r, "0x20"), _series(n.progress_total, r, "100x20")],
                "10m",
                None,
            ),
        ]
    raise AssertionError(f"no promtool case for {a.name}")


def _gateway_cases(a: rules.Alert) -> list[dict[str, Any]]:
    g = GATEWAY
    model = {"model": "m"}
    if a.name == "SeawallRetryBudgetExhausted":
        return [
            _case(a, [_series(m.RETRY_BUDGET_EXHAUSTED, g, "0+30x30")], "20m", g),
            _case(a, [_series(m.RETRY_BUDGET_EXHAUSTED, g, "0x30")], "20m", None),
        ]
    if a.name == "SeawallSheddingSustained":
        shed = {**g, "tenant": "t", "tier": "free", "reason": "rate"}
        req = {**g, "model": "m", "route": "chat", "status": "200"}
        return [
            _case(
                a,
                [_series(m.SHED, shed, "0+10x40"), _series(m.REQUESTS, req, "0+100x40")],
                "30m",
                g,
            ),
            _case(
                a,
                [_series(m.SHED, shed, "0+1x40"), _series(m.REQUESTS, req, "0+100x40")],
                "30m",
                None,
            ),
        ]
    if a.name.startswith("SeawallTtftSloBurn"):
        le = {**g, "model": "m", "le": "2.5"}
        count = {**g, "model": "m"}
        total = _series(f"{m.TTFT}_count", count, "0+100x400")

        def good(per_min: int) -> list[dict[str, str]]:
            return [_series(f"{m.TTFT}_bucket", le, f"0+{per_min}x400"), total]

        fast = a.name.endswith("Fast")
        return [
            _case(a, good(50), "6h30m", model),  # half the requests miss: both alerts
            _case(a, good(100), "6h30m", None),  # all meet the target
            # 8% miss: burn 8, over the slow factor (6), under the fast one (14.4).
            _case(a, good(92), "6h30m", None if fast else model),
        ]
    if a.name == "SeawallDeepProbeFailing":
        rep = {**g, "replica": "r1"}
        return [
            _case(a, [_series(m.DEEP_PROBE_FAILURES, rep, "0+1x20")], "15m", rep),
            _case(
                a,
                [_series(m.DEEP_PROBE_FAILURES, rep, "0 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1")],
                "15m",
                None,
            ),
        ]
    if a.name == "SeawallStreamsCutMidway":
        cut = {**g, "reason": "upstream_reset"}
        ok = {**g, "model": "m", "route": "chat", "status": "200"}
        shed = {**g, "model": "m", "route": "chat", "status": "429"}
        return [
            # 5 of 100 answered streams cut: over 1%.
            _case(
                a,
                [_series(m.STREAM_ERRORS, cut, "0+5x40"), _series(m.REQUESTS, ok, "0+100x40")],
                "30m",
                g,
            ),
            # Zero cuts, as a seeded series reads before any event.
            _case(
                a,
                [_series(m.STREAM_ERRORS, cut, "0x40"), _series(m.REQUESTS, ok, "0+100x40")],
                "30m",
                None,
            ),
            # Refusals are not streams: 1 cut over 10 answered plus 1000 refused is 10%.
            _case(
                a,
                [
                    _series(m.STREAM_ERRORS, cut, "0+1x40"),
                    _series(m.REQUESTS, ok, "0+10x40"),
                    _series(m.REQUESTS, shed, "0+1000x40"),
                ],
                "30m",
                g,
            ),
        ]
    if a.name == "SeawallNodeCordoned":
        node = {"node": "gpu-7"}
        return [
            _case(a, [_series(m.NODE_CORDONED, {**g, **node}, "1x10")], "5m", node),
            _case(a, [_series(m.NODE_CORDONED, {**g, **node}, "0x10")], "5m", None),
        ]
    raise AssertionError(f"no promtool case for {a.name}")


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_binary("promtool"), *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def _run_cases(ruleset: rules.RuleSet, cases: list[dict[str, Any]], tmp_path: Path) -> None:
    (tmp_path / "rules.yml").write_text(rules.render(ruleset, "test"))
    checked = _promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    (tmp_path / "rules_test.yml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": cases})
    )
    result = _promtool("test", "rules", "rules_test.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@pytest.mark.parametrize("engine", ENGINES)
def test_engine_rules_fire_and_stay_silent_under_promtool(engine: str, tmp_path: Path) -> None:
    ruleset = rules.build(engine)
    cases = [c for a in ruleset.engine_alerts for c in _engine_cases(ENGINE_NAMES[engine], a)]
    _run_cases(ruleset, cases, tmp_path)


def test_gateway_rules_fire_and_stay_silent_under_promtool(tmp_path: Path) -> None:
    # The gateway's rules do not depend on --engine: one run covers them.
    ruleset = rules.build("vllm")
    _run_cases(ruleset, [c for a in ruleset.gateway_alerts for c in _gateway_cases(a)], tmp_path)


def test_a_broken_threshold_fails_promtool_tests(tmp_path: Path) -> None:
    # Guards the harness itself: a rule that cannot fire must make the run fail.
    ruleset = rules.build("vllm", rules.AlertConfig(kv_usage_ratio=2.0))
    (tmp_path / "rules.yml").write_text(rules.render(ruleset, "test"))
    kv = next(a for a in ruleset.engine_alerts if a.name == "SeawallEngineKvCacheFull")
    cases = _engine_cases(ENGINE_NAMES["vllm"], kv)[:1]
    (tmp_path / "t.yml").write_text(
        yaml.safe_dump({"rule_files": ["rules.yml"], "evaluation_interval": "1m", "tests": cases})
    )
    assert _promtool("test", "rules", "t.yml", cwd=tmp_path).returncode != 0


def test_committed_rule_file_passes_promtool_check() -> None:
    path = REPO / "deploy" / "prometheus" / "seawall-rules.yml"
    result = _promtool("check", "rules", str(path), cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr


def test_example_prometheus_config_passes_promtool_and_loads_the_rules(tmp_path: Path) -> None:
    # Debian's promtool has no Kubernetes discovery: check the file with file
    # discovery in its place (tests/support/prometheus_config.py); everything else,
    # relabel rules included, is checked as shipped.
    (tmp_path / "seawall-rules.yml").write_text(
        (REPO / "deploy" / "prometheus" / "seawall-rules.yml").read_text()
    )
    (tmp_path / "targets.json").write_text("[]")
    config = prometheus_config.with_file_sd(prometheus_config.shipped(), "targets.json")
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 1 rule files found" in result.stdout + result.stderr


def test_the_shipped_pod_discovery_keeps_exactly_the_pods_it_should(
    tmp_path: Path, artifacts: Path
) -> None:
    """The shipped scrape jobs' relabel rules, run by a real Prometheus over pods as the
    Kubernetes API would describe them (its `__meta_kubernetes_*` labels, given here by
    file discovery: Debian's Prometheus has no Kubernetes discovery): the gateway's and
    the actuator's `http` ports go to `seawall`, vLLM's to `engines`, each labelled with
    its pod and namespace; the gateway's admin port and other pods (Redis) are dropped."""
    import json
    import urllib.request

    from tests.support.fleet import wait_until
    from tests.support.procs import free_port, spawn, wait_http

    prometheus = require_binary("prometheus")

    def pod(app: str, name: str, port_name: str, port: int) -> dict[str, Any]:
        return {
            "targets": [f"127.0.0.1:{port}"],
            "labels": {
                "__meta_kubernetes_namespace": "seawall",
                "__meta_kubernetes_pod_name": name,
                "__meta_kubernetes_pod_label_app_kubernetes_io_name": app,
                "__meta_kubernetes_pod_container_port_name": port_name,
            },
        }

    pods = [
        pod("seawall-gateway", "seawall-gateway-7d9f-a", "http", 18080),
        pod("seawall-gateway", "seawall-gateway-7d9f-a", "admin", 18081),
        pod("seawall-actuator", "seawall-actuator-5c6b-x", "http", 18090),
        pod("vllm", "vllm-0", "http", 18000),
        pod("vllm", "vllm-1", "http", 18001),
        pod("redis", "redis-0", "redis", 16379),
    ]
    (tmp_path / "pods.json").write_text(json.dumps(pods))
    (tmp_path / "seawall-rules.yml").write_text(
        (REPO / "deploy" / "prometheus" / "seawall-rules.yml").read_text()
    )
    doc = prometheus_config.with_file_sd(prometheus_config.shipped(), str(tmp_path / "pods.json"))
    doc["rule_files"] = [str(tmp_path / "seawall-rules.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(doc))
    port = free_port()
    proc = spawn(
        [
            prometheus,
            f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        artifacts / "prometheus.log",
        port=port,
    )
    try:
        wait_http(proc.url + "/-/ready", timeout=60, proc=proc)

        def targets() -> dict[str, Any]:
            with urllib.request.urlopen(proc.url + "/api/v1/targets", timeout=5) as r:
                data: dict[str, Any] = json.loads(r.read())["data"]
                return data

        wait_until(lambda: len(targets()["activeTargets"]) >= 4, 30, what="targets")
        found = targets()
        kept = sorted(
            (t["labels"]["job"], t["labels"]["pod"], t["labels"]["namespace"], t["scrapeUrl"])
            for t in found["activeTargets"]
        )
    finally:
        proc.stop()
    assert kept == [
        ("engines", "vllm-0", "seawall", "http://127.0.0.1:18000/metrics"),
        ("engines", "vllm-1", "seawall", "http://127.0.0.1:18001/metrics"),
        ("seawall", "seawall-actuator-5c6b-x", "seawall", "http://127.0.0.1:18090/metrics"),
        ("seawall", "seawall-gateway-7d9f-a", "seawall", "http://127.0.0.1:18080/metrics"),
    ]
    # Each of the two jobs saw all six pods and dropped the rest.
    assert len(found["droppedTargets"]) == 2 * len(pods) - len(kept)
