"""The golden scrape: what vLLM 0.33.0's own metrics code exports (copied from shared/)."""

from pathlib import Path

GOLDEN_SCRAPE = Path(__file__).resolve().parents[1] / "data" / "vllm-0.33.0-metrics.txt"
