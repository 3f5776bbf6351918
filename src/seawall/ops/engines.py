"""Engine metric names the operator toolkit uses, per engine, and the table of known renames.

Owns: for each engine (vLLM, SGLang, TGI, llama.cpp), the metric each alert rule reads,
and every engine metric rename or removal we know of. `--engine` swaps one table for
another; the drift check explains a missing name with the rename table.

Must not: do I/O, or name a gateway metric (those live in `seawall.metrics`).
The load signals (running, waiting, KV usage, preemptions) are taken from the fleet
monitor's adapters (`seawall.fleet.adapters`), so both read the same series.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from seawall.fleet.adapters import ADAPTERS, EngineKind

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


def _names(
    kind: EngineKind, progress_total: str, ttft_seconds: str | None = None, **dropped: None
) -> EngineNames:
    """One engine's row: its load signals exactly as the fleet adapter reads them (one
    table, so the alerts and the load view cannot read different series), then the
    progress counter and TTFT histogram only the rules need. `dropped` names a signal the
    adapter still reads where present but the rules must not rely on."""
    a = ADAPTERS[kind]
    signals: dict[str, str | None] = {
        "running": a.running,
        "waiting": a.waiting,
        "kv_usage": a.kv_usage,
        "preemptions_total": a.preemptions_total,
    }
    signals.update(dropped)
    return EngineNames(
        engine=kind.value, progress_total=progress_total, ttft_seconds=ttft_seconds, **signals
    )


# Names per docs/engines-reference.md: §1.2 (vLLM 0.33), §4 (the others).
ENGINE_NAMES: Mapping[str, EngineNames] = {
    "vllm": _names(
        EngineKind.VLLM,
        progress_total="vllm:generation_tokens_total",
        ttft_seconds="vllm:time_to_first_token_seconds",
    ),
    # SGLang's generation_tokens_total is added to when a request finishes; the realtime
    # counter moves on every step (docs/engines-reference.md §4.5).
    "sglang": _names(
        EngineKind.SGLANG,
        progress_total="sglang:realtime_tokens_total",
        ttft_seconds="sglang:time_to_first_token_seconds",
    ),
    # TGI's token counts are histograms observed at request end; the batch counter moves
    # on every forward pass.
    "tgi": _names(EngineKind.TGI, progress_total="tgi_batch_inference_count"),
    # `llamacpp:kv_cache_usage_ratio` was dropped from current builds (see REMOVED).
    "llamacpp": _names(
        EngineKind.LLAMACPP, progress_total="llamacpp:n_decode_total", kv_usage=None
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
