"""The names Prometheus stores from a scrape, and the drift check's word for an escaped
name: the OpenMetrics answer prometheus_client 0.23+ gives Prometheus 2.x keeps `vllm:`
on its TYPE lines but writes `vllm_` samples, and Prometheus stores the samples."""

from __future__ import annotations

from seawall.ops.drift import find_drift
from seawall.ops.promql import exposed_sample_names, stored_sample_names
from seawall.sim.metrics import SimMetrics
from tests.unit.test_sim_metrics_exposition import PROMETHEUS_2_ACCEPT, PROMETHEUS_3_ACCEPT


def _negotiated(accept: str) -> tuple[str, str]:
    sim = SimMetrics("m", 4096, block_size=16, num_gpu_blocks=1000)
    body, headers = sim.render_negotiated(accept)
    return body.decode(), headers["Content-Type"]


def test_escaped_samples_are_what_is_stored_not_the_type_names() -> None:
    text, content_type = _negotiated(PROMETHEUS_2_ACCEPT)
    stored = stored_sample_names(text, content_type)
    assert "vllm_kv_cache_usage_perc" in stored
    assert "vllm:kv_cache_usage_perc" not in stored
    # The TYPE-line reading the drift check used before would have said "exported".
    assert "vllm:kv_cache_usage_perc" in exposed_sample_names(text)


def test_a_family_with_no_sample_yet_counts_under_its_escaped_name() -> None:
    text = (
        "# HELP vllm:num_preemptions x\n# TYPE vllm:num_preemptions counter\n"
        "# HELP vllm:kv_cache_usage_perc x\n# TYPE vllm:kv_cache_usage_perc gauge\n"
        'vllm_kv_cache_usage_perc{engine="0"} 0.5\n# EOF\n'
    )
    ct = "application/openmetrics-text; version=1.0.0; charset=utf-8; escaping=underscores"
    assert stored_sample_names(text, ct) == {
        "vllm_kv_cache_usage_perc",
        "vllm_num_preemptions_total",
    }


def test_unescaped_answers_are_stored_as_declared() -> None:
    for accept in (PROMETHEUS_3_ACCEPT, "*/*"):
        text, content_type = _negotiated(accept)
        stored = stored_sample_names(text, content_type)
        assert "vllm:kv_cache_usage_perc" in stored
        assert not any(n.startswith("vllm_") for n in stored)


def test_drift_names_the_escaping_and_the_fix() -> None:
    text, content_type = _negotiated(PROMETHEUS_2_ACCEPT)
    used = {"vllm:kv_cache_usage_perc": ["rule SeawallEngineKvCacheFull"]}
    [drift] = find_drift(
        used, stored_sample_names(text, content_type), check_gateway=False, check_engine=True
    )
    assert drift.hint.startswith("stored as vllm_kv_cache_usage_perc")
    assert "metric_relabel_configs" in drift.hint
