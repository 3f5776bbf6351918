"""guidellm (0.8.x), unchanged, as a client of the gateway and of the sims.

guidellm requires torch (its data loader is torch's), and PyPI's torch brings the CUDA
libraries: about 6 GB installed. So it lives in its own venv, outside the repository
and cached across runs: `$SEAWALL_GUIDELLM_VENV`, default
`~/.cache/seawall/guidellm-<version>`, which `./dev setup` creates once.

guidellm builds its synthetic prompts with a Hugging Face tokenizer, normally fetched
from the hub by model name; nothing is fetched here, so `make_tokenizer` trains a small
byte-level BPE with the `tokenizers` library and saves it where transformers'
`AutoTokenizer` loads it from a folder.

guidellm's data loader (a torch DataLoader worker, `pt_data_worker`) prepares 4,096
prompts ahead of demand by default (`prefetch_factor`): with 128-token prompts at 4
requests a second (its CPU time read with `ps` every 2 s through one 20 s run) it used
~7 s of a core, from ~2 s before the first request to ~6 s after it, while what it
measured shared the machine's two cores. A run here asks for `PREFETCH` prompts ahead
(its own `--data-loader` option; guidellm itself is unchanged): ~4 s, to ~4 s after the
first request (the rest is its start-up); idle after that either way.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.8.1"
PREFETCH = 16
TEXT = (
    "the a seawall gateway replica engine token stream model request answer fleet node "
    "cache prefix batch queue first latency retry budget hedge drain probe shard "
    "tenant limit window score health restart cordon ticket migrate"
)


def venv_dir() -> Path:
    default = Path.home() / ".cache" / "seawall" / f"guidellm-{VERSION}"
    return Path(os.environ.get("SEAWALL_GUIDELLM_VENV", str(default)))


def binary() -> Path | None:
    """The installed guidellm, or None (`./dev setup` marks a finished install)."""
    path = venv_dir() / "bin" / "guidellm"
    return path if (venv_dir() / ".complete").exists() and path.exists() else None


def make_tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = TEXT.split(" ")
    corpus = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(300)]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=800,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": 4096,
                "bos_token": "<s>",
                "eos_token": "</s>",
            }
        )
    )
    return folder


@dataclass(frozen=True, slots=True)
class Result:
    successful: int
    errored: int
    incomplete: int
    ttft_ms: dict[str, float]  # mean, median, p95 of successful requests
    itl_ms: dict[str, float]
    log: str
    # guidellm's own 95% confidence interval of the TTFT median, and each successful
    # request's TTFT (for comparisons pooled over runs).
    ttft_median_ci: tuple[float, float] = (0.0, 0.0)
    ttfts_ms: tuple[float, ...] = ()


def _stats(metric: dict[str, Any]) -> dict[str, float]:
    s = metric["successful"]
    return {"mean": s["mean"], "median": s["median"], "p95": s["percentiles"]["p95"]}


def run(
    target: str,
    out: Path,
    *,
    seed: int,
    seconds: float,
    rate: float,
    tokenizer: Path,
    prompt_tokens: int = 64,
    output_tokens: int = 16,
    timeout_s: float = 300.0,
) -> Result:
    """One constant-rate guidellm run against `target` (its own CLI, unchanged)."""
    exe = binary()
    assert exe is not None, "guidellm is not installed: ./dev setup"
    argv = [
        str(exe),
        "run",
        "--backend",
        f"kind=openai_http,target={target}",
        "--profile",
        f"kind=constant,rate={rate}",
        "--constraint",
        f"kind=max_duration,seconds={seconds}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={prompt_tokens},output_tokens={output_tokens}",
        "--tokenizer",
        f"kind=hf_auto,model={tokenizer}",
        "--data-loader",
        f"kind=pytorch,prefetch_factor={PREFETCH}",
        "--seed",
        f"kind=static,value={seed}",
        "--disable-console-interactive",
        "--output",
        f"kind=json,path={out}",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=env)
    log = done.stdout[-6000:] + done.stderr[-6000:]
    assert done.returncode == 0, f"guidellm failed ({done.returncode}):\n{log}"
    report = json.loads(out.read_text())["benchmarks"][0]
    metrics = report["metrics"]
    totals = metrics["request_totals"]
    ci = metrics["time_to_first_token_ms"]["successful"]["percentile_cis"]["p50"]
    return Result(
        successful=int(totals["successful"]),
        errored=int(totals["errored"]),
        incomplete=int(totals["incomplete"]),
        ttft_ms=_stats(metrics["time_to_first_token_ms"]),
        itl_ms=_stats(metrics["inter_token_latency_ms"]),
        log=log,
        ttft_median_ci=(ci["lower"], ci["upper"]),
        ttfts_ms=tuple(r["time_to_first_token_ms"] for r in report["requests"]["successful"]),
    )
