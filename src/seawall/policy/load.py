"""An engine's load, normalised: the one record every engine adapter produces and every
load-reading policy (admission, the health score, the watchdog's callers) reads.

Plain data, in `policy/` so that pure decisions can take it without importing the
fleet's I/O shells; `seawall.fleet.view` re-exports it beside the snapshot it is part of.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of an engine's /metrics, normalised across engines by an adapter.

    Counters are cumulative as the engine reports them; rates are computed by whoever
    holds two scrapes. A field the engine does not export is None, never a guess.
    """

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # 0..1
    preemptions_total: float | None = None
    generation_tokens_total: float | None = None
    prompt_tokens_total: float | None = None
    kv_capacity_tokens: float | None = None  # usable KV cache, in tokens (vLLM cache config)
    kv_block_size: int | None = None  # tokens per KV block (vLLM cache config)
    # Sequences the engine runs at once, when it says (llama.cpp's slots, from /props):
    # with every one busy a new request waits in the engine for a whole generation.
    slots: int | None = None
    scraped_at: float = 0.0  # monotonic seconds
