"""Engine adapters: one Prometheus text scrape in, one normalised `EngineLoad` out.

Owns the metric names Seawall reads from each engine (vLLM, vLLM before 0.10, SGLang,
TGI, llama.cpp), the rule for combining label children, and `detect_engine`. The drift
check imports `ADAPTER_METRICS` so that a renamed engine metric is caught in CI rather
than by a silently empty load view.

Must not do I/O or read the clock: the caller passes the text and `scraped_at`.

Why a progress counter and not always "generated tokens". The progress watchdog reads
`EngineLoad.generation_tokens_total` to tell a long request from a hung one, so that field
must carry a counter the engine advances on every step. vLLM's generation-token counter
does (per engine step). llama.cpp's `tokens_predicted_total`, SGLang's
`generation_tokens_total` and TGI's token histograms are added to only when a request
finishes: read as progress, four long requests look like a hang (issue 13, bug 1). For
those engines the adapter reads the per-step counter instead: llama.cpp's decode calls,
SGLang's realtime tokens, TGI's forward passes. Its unit is then not tokens; only its
movement is used. Where each engine updates each counter: docs/engines-reference.md §4.5.

Why a hand parser: scrapes run every second per replica and a vLLM scrape is ~550 lines
of which we need six. `prometheus_client.parser` builds every family and sample object;
this parser looks at the metric name of each line and skips the rest (measured ~40x
faster on the golden vLLM 0.33 scrape: 0.25 ms against 10 ms on one shared core). A unit
test checks that both parsers read the same values from that scrape.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

from seawall.fleet.view import EngineLoad


class EngineKind(StrEnum):
    VLLM = "vllm"
    VLLM_LEGACY = "vllm_legacy"  # before 0.10: `vllm:gpu_cache_usage_perc`
    SGLANG = "sglang"
    TGI = "tgi"
    LLAMACPP = "llamacpp"


# How label children of one name combine. Counts (requests, tokens, preemptions) add up
# across data-parallel engines / dp ranks. Ratios (KV usage) do not: the replica's usage
# is the mean over its engines, which equals used/total when engines are the same size.
SUM = "sum"
MEAN = "mean"


@dataclass(frozen=True, slots=True)
class Adapter:
    """Which engine metric feeds each `EngineLoad` field (None: the engine has none)."""

    kind: EngineKind
    running: str | None
    waiting: str | None
    kv_usage: str | None
    preemptions_total: str | None
    # A counter the engine advances on every step while it works (see the module doc);
    # it feeds `EngineLoad.generation_tokens_total`, the progress watchdog's input.
    progress_total: str | None
    prompt_tokens_total: str | None
    # An info gauge whose labels give the KV cache's size (vLLM's cache_config_info).
    kv_config: str | None = None

    def metric_names(self) -> tuple[str, ...]:
        names = (
            self.running,
            self.waiting,
            self.kv_usage,
            self.preemptions_total,
            self.progress_total,
            self.prompt_tokens_total,
        )
        return tuple(n for n in names if n is not None)

    def parse(self, text: str, scraped_at: float = 0.0) -> EngineLoad:
        values = _collect(text, frozenset(self.metric_names()))
        capacity, block_size = (
            _kv_cache_config(text, self.kv_config) if self.kv_config else (None, None)
        )

        def get(name: str | None, how: str = SUM) -> float | None:
            if name is None:
                return None
            children = values.get(name)
            if not children:
                return None
            total = math.fsum(children)
            return total / len(children) if how == MEAN else total

        return EngineLoad(
            running=get(self.running),
            waiting=get(self.waiting),
            kv_usage=get(self.kv_usage, MEAN),
            preemptions_total=get(self.preemptions_total),
            generation_tokens_total=get(self.progress_total),
            prompt_tokens_total=get(self.prompt_tokens_total),
            kv_capacity_tokens=capacity,
            kv_block_size=block_size,
            scraped_at=scraped_at,
        )


# Names per docs/engines-reference.md §1.2 (vLLM 0.33), §1.4 (renames), §4 (others).
_VLLM = Adapter(
    EngineKind.VLLM,
    running="vllm:num_requests_running",
    waiting="vllm:num_requests_waiting",
    kv_usage="vllm:kv_cache_usage_perc",
    preemptions_total="vllm:num_preemptions_total",
    # Incremented by each engine step's generated tokens (PrometheusStatLogger.record).
    progress_total="vllm:generation_tokens_total",
    prompt_tokens_total="vllm:prompt_tokens_total",
    kv_config="vllm:cache_config_info",
)
ADAPTERS: Mapping[EngineKind, Adapter] = {
    EngineKind.VLLM: _VLLM,
    # Before 0.10 only the KV gauge had another name.
    EngineKind.VLLM_LEGACY: dataclasses.replace(
        _VLLM, kind=EngineKind.VLLM_LEGACY, kv_usage="vllm:gpu_cache_usage_perc"
    ),
    EngineKind.SGLANG: Adapter(
        EngineKind.SGLANG,
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_usage="sglang:token_usage",
        # Retraction is SGLang's preemption: a running request evicted to free KV.
        preemptions_total="sglang:num_retracted_requests_total",
        # generation_tokens_total is added when a request finishes; realtime_tokens_total
        # every scheduler iteration (label children: prefill_compute, prefill_cache, decode).
        progress_total="sglang:realtime_tokens_total",
        prompt_tokens_total="sglang:prompt_tokens_total",
    ),
    EngineKind.TGI: Adapter(
        EngineKind.TGI,
        running="tgi_batch_current_size",
        waiting="tgi_queue_size",
        kv_usage=None,  # TGI exports no KV usage; None, never a guess
        preemptions_total=None,
        # Token counts are histograms observed at request end; this counter goes up at
        # every prefill and decode call (label `method`).
        progress_total="tgi_batch_inference_count",
        prompt_tokens_total=None,
    ),
    EngineKind.LLAMACPP: Adapter(
        EngineKind.LLAMACPP,
        running="llamacpp:requests_processing",
        waiting="llamacpp:requests_deferred",
        # Dropped in current llama.cpp builds; read when present, None otherwise.
        kv_usage="llamacpp:kv_cache_usage_ratio",
        preemptions_total=None,
        # tokens_predicted_total is added when a slot is released (metrics_on_prediction);
        # n_decode_total at every llama_decode() call (metrics_post_decode).
        progress_total="llamacpp:n_decode_total",
        prompt_tokens_total="llamacpp:prompt_tokens_total",
    ),
}

ADAPTER_METRICS: dict[EngineKind, tuple[str, ...]] = {
    kind: adapter.metric_names() for kind, adapter in ADAPTERS.items()
}


def adapter_for(kind: EngineKind | str) -> Adapter:
    return ADAPTERS[EngineKind(kind)]


def detect_engine(text: str) -> EngineKind | None:
    """Which engine produced this scrape, from its metric-name prefixes; None if unknown."""
    if "vllm:kv_cache_usage_perc" in text:
        return EngineKind.VLLM
    if "vllm:gpu_cache_usage_perc" in text:
        return EngineKind.VLLM_LEGACY
    if "vllm:num_requests_running" in text:
        return EngineKind.VLLM
    if "sglang:" in text:
        return EngineKind.SGLANG
    if "tgi_queue_size" in text or "tgi_batch_current_size" in text:
        return EngineKind.TGI
    if "llamacpp:" in text:
        return EngineKind.LLAMACPP
    return None


def parse_samples(text: str, wanted: frozenset[str]) -> dict[str, list[float]]:
    """Values of every sample whose name is in `wanted`, one entry per label child."""
    return _collect(text, wanted)


def parse_labelled(text: str, wanted: frozenset[str]) -> dict[str, list[tuple[str, float]]]:
    """Like `parse_samples`, keeping each child's raw label text (`a="1",b="2"`)."""
    out: dict[str, list[tuple[str, float]]] = {}
    for line in _lines_of(text, wanted):
        parsed = _parse_line(line, wanted)
        if parsed is not None:
            name, labels, value = parsed
            out.setdefault(name, []).append((labels, value))
    return out


def _collect(text: str, wanted: frozenset[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for line in _lines_of(text, wanted):
        parsed = _parse_line(line, wanted)
        if parsed is not None:
            out.setdefault(parsed[0], []).append(parsed[2])
    return out


def _lines_of(text: str, wanted: frozenset[str]) -> list[str]:
    """The sample lines of the wanted names, in order, found by one regular expression
    rather than by looking at every line in Python: a vLLM scrape has some 550 lines, of
    which the load view reads a handful, and the fleet monitor parses one per replica
    every second on the gateway's event loop (`bench/bench_scrape.py`)."""
    return _line_pattern(wanted).findall("\n" + text)  # "\n": the first line too


@functools.lru_cache(maxsize=64)
def _line_pattern(wanted: frozenset[str]) -> re.Pattern[str]:
    # Each match starts at a newline: a literal prefix, which the regex engine searches
    # for at C speed. The name must be whole (a label set or a blank follows it).
    names = "|".join(map(re.escape, sorted(wanted, key=lambda n: (-len(n), n))))
    return re.compile(f"\\n((?:{names})[{{ \\t][^\\n]*)")


def _parse_line(line: str, wanted: frozenset[str]) -> tuple[str, str, float] | None:
    """`name{labels} value [timestamp]` -> (name, labels, value) if the name is wanted."""
    if not line or line[0] == "#":
        return None
    brace = line.find("{")
    space = line.find(" ")
    if brace != -1 and (space == -1 or brace < space):
        name = line[:brace]
        if name not in wanted:
            return None
        # Label values may hold spaces or braces; the value and timestamp hold neither,
        # so the last `}` ends the label set.
        close = line.rfind("}")
        if close < brace:
            return None
        labels, rest = line[brace + 1 : close], line[close + 1 :]
    else:
        name = line[:space] if space != -1 else line
        if name not in wanted:
            return None
        labels, rest = "", line[len(name) :]
    fields = rest.split()
    if not fields:
        return None
    try:
        value = float(fields[0])
    except ValueError:
        return None
    if math.isnan(value):
        return None
    return name, labels, value


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def _kv_cache_config(text: str, info_name: str) -> tuple[float | None, int | None]:
    """(usable KV tokens, block size) from vLLM's cache_config_info labels; tokens are
    summed over engines.

    vLLM keeps one block as the null block (`BlockPool.get_usage` divides by
    num_gpu_blocks - 1), so that block holds no tokens.
    """
    total = 0.0
    found = False
    block_size = 0
    for labels, _ in parse_labelled(text, frozenset({info_name})).get(info_name, []):
        fields = dict(_LABEL.findall(labels))
        try:
            blocks, block_size = int(fields["num_gpu_blocks"]), int(fields["block_size"])
        except (KeyError, ValueError):
            continue
        total += max(blocks - 1, 0) * block_size
        found = True
    return (total, block_size) if found else (None, None)
