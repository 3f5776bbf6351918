"""Engine metric names the operator toolkit uses, per engine, and the table of known renames.

Owns: for each engine (vLLM, SGLang, TGI, llama.cpp), the metric each alert rule reads,
and every engine metric rename or removal we know of. `--engine` swaps one table for
another; the drift check explains a missing name with the rename table.

Must not: do I/O, or name a gateway metric (those live in `seawall.gateway.metrics`).
The fleet monitor's own per-engine names live in `seawall.fleet.adapters`; a unit test
checks that both tables agree where they name the same signal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

ENGINES = ("vllm", "sglang", "tgi", "llamacpp")


@dataclass(frozen=True, slots=True)
class EngineNames:
    """The engine metric each rule reads; None when the engine exports no such signal,
    in which case the rule that needs it is left out (and `seawall alerts` says so)."""

    engine: str
    running: str | None  # gauge: requests in the running batch
    waiting: str | None  # gauge: requests queued for capacity
    kv_usage: str | None  # gauge: KV-cache usage, 0..1
    preemptions_total: str | None  # counter: running requests evicted to free KV
    # Counter that rises while the engine makes progress on running work. Generated
    # tokens where the engine counts them per step; forward passes or decode calls
    # otherwise, because a counter updated only when a request finishes cannot tell a
    # long stream from a hung one.
    progress_total: str | None
    ttft_seconds: str | None = None  # histogram family: engine-side time to first token


# Names per docs/engines-reference.md: §1.2 (vLLM 0.33), §4 (the others).
ENGINE_NAMES: Mapping[str, EngineNames] = {
    "vllm": EngineNames(
        engine="vllm",
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_usage="vllm:kv_cache_usage_perc",
        preemptions_total="vllm:num_preemptions_total",
        progress_total="vllm:generation_tokens_total",
        ttft_seconds="vllm:time_to_first_token_seconds",
    ),
    "sglang": EngineNames(
        engine="sglang",
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_usage="sglang:token_usage",
        # Retraction is SGLang's preemption.
        preemptions_total="sglang:num_retracted_requests_total",
        progress_total="sglang:generation_tokens_total",
        ttft_seconds="sglang:time_to_first_token_seconds",
    ),
    "tgi": EngineNames(
        engine="tgi",
        running="tgi_batch_current_size",
        waiting="tgi_queue_size",
        kv_usage=None,
        preemptions_total=None,
        # TGI's token counts are histograms observed at request end; the batch counter
        # moves on every forward pass.
        progress_total="tgi_batch_inference_count",
    ),
    "llamacpp": EngineNames(
        engine="llamacpp",
        running="llamacpp:requests_processing",
        waiting="llamacpp:requests_deferred",
        kv_usage=None,  # `llamacpp:kv_cache_usage_ratio` was dropped (see REMOVED)
        preemptions_total=None,
        progress_total="llamacpp:n_decode_total",
    ),
}

# Old family name -> new family name. Families, not samples: `rename_of` maps the
# `_bucket`/`_sum`/`_count` samples of a renamed histogram too.
RENAMES: Mapping[str, str] = {
    "vllm:gpu_cache_usage_perc": "vllm:kv_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries_total": "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_hits_total": "vllm:prefix_cache_hits_total",
    "vllm:time_per_output_token_seconds": "vllm:inter_token_latency_seconds",
}

# Names that went away with no successor, and why.
REMOVED: Mapping[str, str] = {
    "vllm:num_requests_swapped": "vLLM V0 only; V1 preempts by recompute, never swaps",
    "vllm:cpu_cache_usage_perc": "vLLM V0 only",
    "vllm:gpu_prefix_cache_hit_rate": "vLLM V0 only; compute hits_total / queries_total",
    "llamacpp:kv_cache_usage_ratio": "dropped from current llama.cpp server builds",
    "llamacpp:kv_cache_tokens": "dropped from current llama.cpp server builds",
}

_SAMPLE_SUFFIXES = ("", "_bucket", "_sum", "_count", "_created")


def _map_family(name: str, table: Mapping[str, str]) -> str | None:
    for old, new in table.items():
        for suffix in _SAMPLE_SUFFIXES:
            if name == old + suffix:
                return new + suffix
    return None


def rename_of(name: str) -> str | None:
    """The current name of a sample whose family was renamed, else None."""
    return _map_family(name, RENAMES)


def previous_name_of(name: str) -> str | None:
    """The name a sample had before its family was renamed, else None."""
    return _map_family(name, {new: old for old, new in RENAMES.items()})


def removal_reason(name: str) -> str | None:
    for old, why in REMOVED.items():
        if name in (old + s for s in _SAMPLE_SUFFIXES):
            return why
    return None
