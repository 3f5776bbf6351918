"""The alert rules, the PromQL name scanner and the drift check, without Prometheus."""

from __future__ import annotations

import pytest
import yaml

from seawall import metrics as m
from seawall.fleet.adapters import ADAPTERS, EngineKind
from seawall.ops import rules
from seawall.ops.alerts_cli import _command_line
from seawall.ops.drift import find_drift
from seawall.ops.engines import ENGINE_NAMES, ENGINES, previous_name_of, rename_of
from seawall.ops.promql import exposed_sample_names, metric_names
from tests.support.golden import GOLDEN_SCRAPE
from tests.support.procs import REPO

GOLDEN = GOLDEN_SCRAPE
COMMITTED = REPO / "deploy" / "prometheus" / "seawall-rules.yml"


def test_promql_names_skip_functions_labels_and_durations() -> None:
    expr = (
        'sum by (job, instance) (rate(vllm:num_preemptions_total{model_name=~"a.*"}[5m]))'
        " > 0.5 and on (instance) group_left (node) max without (le) (up offset 5m)"
        " / histogram_quantile(0.99,"
        " sum(rate(seawall_ttft_seconds_bucket[$__rate_interval])) by (le))"
    )
    assert metric_names(expr) == {"vllm:num_preemptions_total", "up", "seawall_ttft_seconds_bucket"}


def test_exposed_names_come_from_samples_not_comments() -> None:
    text = '# HELP x_total help\n# TYPE x_total counter\nx_total{a="b c"} 1\ny 2 1700000000\n'
    assert exposed_sample_names(text) == {"x_total", "y"}


def test_a_declared_family_with_no_samples_yet_counts_as_exported() -> None:
    text = "# TYPE h histogram\n# TYPE c counter\n# TYPE g gauge\n"
    assert exposed_sample_names(text) == {"h_bucket", "h_sum", "h_count", "c_total", "g"}


@pytest.mark.parametrize("engine", ENGINES)
def test_every_rule_names_only_known_metrics(engine: str) -> None:
    # The gateway's families come from the registry itself, engine names from the table:
    # no rule may read a name neither side defines.
    gateway = exposed_sample_names(_registry_text())
    names = ENGINE_NAMES[engine]
    engine_names = {
        v
        for v in (
            names.running,
            names.waiting,
            names.kv_usage,
            names.preemptions_total,
            names.progress_total,
        )
        if v
    }
    for alert in rules.build(engine).alerts():
        unknown = metric_names(alert.expr) - gateway - engine_names
        assert not unknown, (alert.name, unknown)


def test_vllm_rules_only_use_names_in_the_golden_033_scrape() -> None:
    golden = exposed_sample_names(GOLDEN.read_text())
    for alert in rules.build("vllm").engine_alerts:
        assert metric_names(alert.expr) <= golden, alert.name


def test_engine_switch_changes_engine_rules_and_says_what_is_left_out() -> None:
    vllm = rules.build("vllm")
    tgi = rules.build("tgi")
    assert {a.name for a in vllm.engine_alerts} == {
        "SeawallEnginePreemptionSustained",
        "SeawallEngineKvCacheFull",
        "SeawallEngineQueueGrowing",
        "SeawallReplicaStuck",
    }
    assert {o.alert for o in tgi.omitted} == {
        "SeawallEnginePreemptionSustained",
        "SeawallEngineKvCacheFull",
    }
    assert all("vllm:" not in a.expr for a in tgi.alerts())
    assert "# Left out: SeawallEngineKvCacheFull" in rules.render(tgi, "x")


def test_rule_tables_agree_with_the_fleet_adapter() -> None:
    # The alert and the load view must read the same series, or one of them is stale.
    for engine in ENGINES:
        ours, adapter = ENGINE_NAMES[engine], ADAPTERS[EngineKind(engine)]
        assert ours.running == adapter.running
        assert ours.waiting == adapter.waiting
        if ours.kv_usage is not None:
            assert ours.kv_usage == adapter.kv_usage
        if ours.preemptions_total is not None:
            assert ours.preemptions_total == adapter.preemptions_total


def test_thresholds_and_windows_reach_the_expressions() -> None:
    config = rules.AlertConfig(stuck_window="30s", preemption_rate_per_s=2.0, ttft_slo_s=1.0)
    by_name = {a.name: a for a in rules.build("vllm", config).alerts()}
    assert "[30s]" in by_name["SeawallReplicaStuck"].expr
    assert "> 2.0" in by_name["SeawallEnginePreemptionSustained"].expr
    assert 'le="1.0"' in by_name["SeawallTtftSloBurnFast"].expr


@pytest.mark.parametrize(
    "bad",
    [
        rules.AlertConfig(stuck_window="2 minutes"),
        rules.AlertConfig(ttft_slo_s=2.0),  # not a bucket bound
        rules.AlertConfig(ttft_slo_objective=1.0),
    ],
)
def test_invalid_config_is_refused(bad: rules.AlertConfig) -> None:
    with pytest.raises(ValueError):
        rules.build("vllm", bad)


def test_committed_rule_file_is_what_the_command_generates() -> None:
    import argparse

    from seawall.cli import build_parser

    args = build_parser("alerts").parse_args(["alerts"])
    assert isinstance(args, argparse.Namespace)
    generated = rules.render(rules.build("vllm"), _command_line(args))
    assert COMMITTED.read_text() == generated, "run: seawall alerts -o " + str(COMMITTED)


def test_rule_exprs_reads_every_rule_of_a_file() -> None:
    doc = yaml.safe_load(COMMITTED.read_text())
    assert set(rules.rule_exprs(doc)) == {a.name for a in rules.build("vllm").alerts()}


def test_renames_map_histogram_samples_both_ways() -> None:
    assert rename_of("vllm:gpu_cache_usage_perc") == "vllm:kv_cache_usage_perc"
    assert (
        rename_of("vllm:time_per_output_token_seconds_bucket")
        == "vllm:inter_token_latency_seconds_bucket"
    )
    assert previous_name_of("vllm:prefix_cache_hits_total") == "vllm:gpu_prefix_cache_hits_total"
    assert rename_of("vllm:kv_cache_usage_perc") is None


def test_drift_names_the_rename_for_an_old_rule_on_a_new_engine() -> None:
    used = {"vllm:gpu_cache_usage_perc": ["rule A"], "vllm:num_requests_waiting": ["rule A"]}
    exposed = {"vllm:kv_cache_usage_perc", "vllm:num_requests_waiting"}
    [drift] = find_drift(used, exposed, check_gateway=False, check_engine=True)
    assert drift.name == "vllm:gpu_cache_usage_perc"
    assert "vllm:kv_cache_usage_perc" in drift.hint and "exported" in drift.hint


def test_drift_on_an_old_engine_points_at_the_old_name() -> None:
    used = {"vllm:kv_cache_usage_perc": ["rule A"]}
    [drift] = find_drift(used, {"vllm:gpu_cache_usage_perc"}, False, True)
    assert "old name vllm:gpu_cache_usage_perc" in drift.hint


def test_drift_scope_keeps_gateway_names_off_an_engine_report() -> None:
    used = {m.SHED: ["rule S"], "llamacpp:kv_cache_usage_ratio": ["adapter"]}
    drifts = find_drift(used, set(), check_gateway=False, check_engine=True)
    assert [d.name for d in drifts] == ["llamacpp:kv_cache_usage_ratio"]
    assert drifts[0].hint.startswith("removed:")


def _registry_text() -> str:
    from prometheus_client import generate_latest

    return generate_latest(m.Metrics().registry).decode()
