"""vLLM 0.33.0's own HTTP server with a stand-in engine core, for capturing its truth.

Runs INSIDE the throwaway venv that `tools/vllm/capture.sh` builds (vLLM installed with
`--no-deps` plus its import chain, CPU torch). Never imported by Seawall or its tests.

What is vLLM's here, unchanged: argument parsing and `VllmConfig`, the FastAPI app
(`build_app`: routers, exception handlers, middleware), `init_app_state` (the serving
classes, the renderer, the tokenizer wrapper), `AsyncLLM` (input processing, the output
processor: detokenization, stop strings, logprobs, n > 1 fan-out, streaming deltas).

What is ours: only the engine core, the part that would run the model on a GPU. It is
swapped for `FakeCore`, which for every running request emits one token per step from a
fixed text, finishes on EOS / `stop_token_ids` / `max_tokens` / `max_model_len` exactly as
vLLM's `check_stop` does, attaches synthetic logprobs where they were asked for, and fails
a request with `FinishReason.ERROR` when its `vllm_xargs` ask for it (`fake_error_after`). A
tiny model directory (a `config.json` naming a registered do-nothing architecture and a
byte-level tokenizer with a ChatML template) stands in for model weights: none are loaded.
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import numpy as np
import torch
import torch.nn as nn

MODEL_NAME = "sim-model"
MAX_MODEL_LEN = 4096
# The text the stand-in core "generates", one byte token at a time, then EOS.
GENERATED_TEXT = " the quick brown fox jumps over the lazy dog."

# ChatML, the template `seawall sim` renders (src/seawall/sim/textgen.py `render_chat`).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set text = message['content'] %}"
    "{% else %}{% set text = namespace(v='') %}"
    "{% for part in message['content'] %}{% if part['type'] == 'text' %}"
    "{% set text.v = text.v + part['text'] %}{% endif %}{% endfor %}"
    "{% set text = text.v %}{% endif %}"
    "{% if continue_final_message and loop.last %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + text }}"
    "{% else %}{{ '<|im_start|>' + message['role'] + '\n' + text + '<|im_end|>\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class SimForCausalLM(nn.Module):
    """A registered architecture that is never run: the engine core is fake."""

    def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return input_ids

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states


def write_model_dir(root: Path) -> Path:
    """config.json + a byte-level BPE tokenizer (one token per byte, no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    root.mkdir(parents=True, exist_ok=True)
    vocab: dict[str, int] = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": MAX_MODEL_LEN,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    (root / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["SimForCausalLM"],
                "model_type": "llama",
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "num_hidden_layers": 2,
                "vocab_size": 512,
                "max_position_embeddings": MAX_MODEL_LEN,
                "eos_token_id": 0,
                "bos_token_id": 0,
                "torch_dtype": "float32",
                "rms_norm_eps": 1e-5,
            }
        )
    )
    return root


class FakeCore:
    """The engine-core client AsyncLLM talks to, answering in-process."""

    def __init__(self, vllm_config: Any, tokenizer: Any) -> None:
        from vllm.v1.engine import EngineCoreOutputs

        self.vllm_config = vllm_config
        self.max_model_len = vllm_config.model_config.max_model_len
        self.engine_ranks_managed = [0]
        self.requests: dict[str, dict[str, Any]] = {}
        self.outputs: asyncio.Queue[Any] = asyncio.Queue()
        self._empty = EngineCoreOutputs
        self._task: asyncio.Task[None] | None = None
        eos = tokenizer.eos_token_id
        self._text_ids = [*tokenizer.encode(GENERATED_TEXT, add_special_tokens=False), eos]
        self.vocab_size = len(tokenizer)

        class _Resources:
            engine_dead = False

        self.resources = _Resources()

    # --- the methods AsyncLLM calls --------------------------------------------------

    async def get_supported_tasks_async(self) -> tuple[str, ...]:
        return ("generate",)

    async def add_request_async(self, request: Any) -> None:
        self.requests[request.request_id] = {"req": request, "out": [], "first": True}
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.requests.pop(rid, None)

    async def get_output_async(self) -> Any:
        return await self.outputs.get()

    async def reset_mm_cache_async(self) -> None:
        return None

    def dp_engines_running(self) -> bool:
        return bool(self.requests)

    def get_kv_event_sources(self) -> dict[int, Any]:
        return {}

    def shutdown(self, timeout: float | None = None) -> None:
        if self._task is not None:
            self._task.cancel()

    def __getattr__(self, name: str) -> Any:
        if name.endswith("_async"):

            async def _noop(*args: Any, **kwargs: Any) -> None:
                return None

            return _noop
        raise AttributeError(name)

    # --- the fake model -----------------------------------------------------------------

    def _logprobs(self, token_ids: list[int], k: int) -> Any:
        from vllm.v1.outputs import LogprobsLists

        k = self.vocab_size if k == -1 else k
        ids = np.zeros((len(token_ids), k + 1), dtype=np.int64)
        lps = np.zeros((len(token_ids), k + 1), dtype=np.float32)
        for row, tok in enumerate(token_ids):
            ids[row, 0] = tok
            lps[row, 0] = -0.25
            for j in range(1, k + 1):
                ids[row, j] = (tok + j) % self.vocab_size
                lps[row, j] = -0.25 * (j + 1)
        ranks = np.ones(len(token_ids), dtype=np.int64)
        return LogprobsLists(ids, lps, ranks, None)

    def _prompt_logprobs(self, prompt_ids: list[int], k: int) -> Any:
        from vllm.v1.outputs import LogprobsTensors

        k = self.vocab_size if k == -1 else k
        rows = prompt_ids[1:]
        ids = torch.zeros((len(rows), k + 1), dtype=torch.int64)
        lps = torch.zeros((len(rows), k + 1), dtype=torch.float32)
        for row, tok in enumerate(rows):
            ids[row, 0] = tok
            lps[row, 0] = -1.5
            for j in range(1, k + 1):
                ids[row, j] = (tok + j) % self.vocab_size
                lps[row, j] = -1.5 - j
        ranks = torch.ones(len(rows), dtype=torch.int64)
        return LogprobsTensors(ids, lps, ranks)

    async def _run(self) -> None:
        from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs, FinishReason

        while True:
            await asyncio.sleep(0.002)
            if not self.requests:
                continue
            outs = []
            finished = set()
            for rid, state in list(self.requests.items()):
                req = state["req"]
                sp = req.sampling_params
                produced: list[int] = state["out"]
                token = self._text_ids[len(produced) % len(self._text_ids)]
                produced.append(token)
                finish = None
                stop_reason: int | str | None = None
                num_tokens = len(req.prompt_token_ids or []) + len(produced)
                # `vllm_xargs: {"fake_error_after": N}`: a request-level engine error (what a
                # KV-load failure gives) on the N+1th output; N = 0 fails the first
                error_after = (sp.extra_args or {}).get("fake_error_after")
                if error_after is not None and len(produced) > int(error_after):
                    finish = FinishReason.ERROR
                elif token == sp.eos_token_id and not sp.ignore_eos:
                    finish = FinishReason.STOP
                elif token in (sp.stop_token_ids or ()):
                    finish = FinishReason.STOP
                    stop_reason = token
                elif num_tokens >= self.max_model_len or len(produced) >= sp.max_tokens:
                    finish = FinishReason.LENGTH
                out = EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=[token],
                    new_logprobs=(
                        self._logprobs([token], sp.logprobs) if sp.logprobs is not None else None
                    ),
                    new_prompt_logprobs_tensors=(
                        self._prompt_logprobs(req.prompt_token_ids, sp.prompt_logprobs)
                        if state["first"] and sp.prompt_logprobs is not None
                        else None
                    ),
                    finish_reason=finish,
                    stop_reason=stop_reason,
                )
                state["first"] = False
                outs.append(out)
                if finish is not None:
                    finished.add(rid)
                    del self.requests[rid]
            await self.outputs.put(
                EngineCoreOutputs(outputs=outs, timestamp=time.monotonic(),
                                  finished_requests=finished or None)
            )  # fmt: skip


async def build_server(extra_args: list[str] | None = None) -> tuple[Any, Any]:
    """(the FastAPI app, the AsyncLLM) for a `vllm serve` of the tiny model."""
    from vllm import ModelRegistry

    ModelRegistry.register_model("SimForCausalLM", SimForCausalLM)
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine import async_llm, core_client

    model_dir = write_model_dir(Path(tempfile.mkdtemp(prefix="seawall-vllm-model-")))
    parser = make_arg_parser(FlexibleArgumentParser())
    args = parser.parse_args(
        [
            "--model", str(model_dir),
            "--served-model-name", MODEL_NAME,
            "--max-model-len", str(MAX_MODEL_LEN),
            "--load-format", "dummy",
            *(extra_args or []),
        ]
    )  # fmt: skip
    validate_parsed_serve_args(args)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config()

    holder: dict[str, FakeCore] = {}

    def make_client(*a: Any, **kw: Any) -> FakeCore:
        core = FakeCore(kw["vllm_config"], kw["renderer"].tokenizer)
        holder["core"] = core
        return core

    core_client.EngineCoreClient.make_async_mp_client = staticmethod(make_client)  # type: ignore[method-assign]
    engine = async_llm.AsyncLLM(vllm_config, executor_class=None, log_stats=False)  # type: ignore[arg-type]
    supported = await engine.get_supported_tasks()
    app = build_app(args, supported, vllm_config.model_config)
    await init_app_state(engine, app.state, args, supported)
    return app, engine


async def serve(app: Any, port: int) -> Any:
    """Serve the app with uvicorn (vLLM's server) on loopback; returns the server."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                            access_log=False, lifespan="off")  # fmt: skip
    server = uvicorn.Server(config)
    asyncio.get_running_loop().create_task(server.serve())
    # uvicorn says it is listening only through this flag (it has no event to wait on)
    while not server.started:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    return server
