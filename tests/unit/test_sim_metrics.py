"""Golden test: the emulator's /metrics families against vLLM 0.33.0's own scrape."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from seawall.sim.metrics import SimMetrics, build_1_2_5_buckets
from tests.support.golden import GOLDEN_SCRAPE


def _families(text: str) -> dict[str, tuple[str, str, frozenset[str], tuple[str, ...]]]:
    """name -> (type, help, label names, bucket bounds) for every family."""
    out: dict[str, tuple[str, str, frozenset[str], tuple[str, ...]]] = {}
    for family in text_string_to_metric_families(text):
        labels: set[str] = set()
        buckets: list[str] = []
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
            if sample.name.endswith("_bucket"):
                buckets.append(sample.labels["le"])
        out[family.name] = (family.type, family.documentation, frozenset(labels), tuple(buckets))
    return out


def _golden_text() -> str:
    return GOLDEN_SCRAPE.read_text()


def test_every_core_vllm_family_matches_the_reference_scrape() -> None:
    golden = _families(_golden_text())
    ours = _families(
        SimMetrics("Qwen/Qwen3-0.6B", 4096, block_size=16, num_gpu_blocks=27000).render().decode()
    )
    core = {n for n in golden if n.startswith("vllm:")}
    assert len(core) > 30
    missing = core - set(ours)
    assert not missing, f"families missing from the emulator: {sorted(missing)}"
    for name in sorted(core):
        g_type, g_help, g_labels, g_buckets = golden[name]
        o_type, o_help, o_labels, o_buckets = ours[name]
        assert (o_type, o_help, o_labels) == (g_type, g_help, g_labels), name
        assert o_buckets == g_buckets, name
    # a real single-server scrape also has the process and gc collectors
    for name in ("process_cpu_seconds", "python_gc_collections", "python_info"):
        assert name in ours


def test_label_children_exist_before_any_traffic() -> None:
    text = SimMetrics("m", 4096, 16, 100).render().decode()
    for reason in ("stop", "length", "abort", "error", "repetition"):
        assert f'finished_reason="{reason}"' in text
    assert 'vllm:engine_sleep_state{engine="0",model_name="m",sleep_state="awake"} 1.0' in text
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 0.0' in text


def test_compat_profile_adds_the_pre_0_10_names_only_when_asked() -> None:
    plain = SimMetrics("m", 4096, 16, 100).render().decode()
    compat = SimMetrics("m", 4096, 16, 100, compat=True)
    compat.set_gauges(1, 0, 0.25)
    compat.observe_itl(0.02)
    text = compat.render().decode()
    assert "vllm:gpu_cache_usage_perc" not in plain
    assert 'vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.25' in text
    assert 'vllm:time_per_output_token_seconds_count{engine="0",model_name="m"} 1.0' in text


def test_request_token_buckets_follow_max_model_len() -> None:
    assert build_1_2_5_buckets(4096) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(1000)[-1] == 1000
