"""`seawall sim`: a CPU-only engine emulator that behaves like vLLM 0.33 to its clients.

Owns: the command-line flags and their defaults (documented here once), turning them into
a `SimConfig`, and running the server on uvloop.

Must not: hold behaviour; the scheduler, engine and server modules do.

Flags and defaults:
  --host 127.0.0.1              address to bind
  --port 8000                   port to bind
  --model sim-model             served model name (`model` in requests, `model_name` label)
  --max-model-len 4096          context length: prompt + output tokens
  --kv-blocks 2048              KV cache blocks (one is vLLM's null block, never used)
  --block-size 16               tokens per KV block
  --max-num-seqs 256            most sequences in one batch
  --max-num-batched-tokens 2048 token budget per step (chunked prefill)
  --seed 0                      engine seed: decides greedy text and fault draws
  --enable-faults               serve POST /sim/fault and GET /sim/state (404 without)
  --fault JSON                  a fault to apply at start (repeatable; POST /sim/fault body)
  --load-time 0                 seconds before the port is bound (a model loading)
  --shutdown-timeout 0          SIGTERM: 0 aborts in-flight requests (vLLM's default);
                                S > 0 drains for up to S seconds first
  --step-base-ms 10             fixed cost of a step
  --step-per-seq-ms 0.1         extra cost per sequence in the step
  --step-per-prefill-token-ms 0.05  extra cost per prefill token in the step
  --grammar-per-node-us 2       structured output: each constrained sequence's grammar
                                costs nodes x depth x this in every step it samples in
                                (its schema's JSON nodes and nesting; `response_format`
                                or `structured_outputs`); the batch's grammars overlap
                                the forward pass, so a step takes the longer of the two;
                                0 turns grammar cost off
  --compat                      also emit vllm:gpu_cache_usage_perc and
                                vllm:time_per_output_token_seconds (pre-0.10 names)
  --enable-server-load-tracking GET /load counts in-flight requests (0 without, as vLLM)
  --dcgm-gpus 1                 GPUs shown on /dcgm/metrics (gpu="0".."N-1")
  --max-num-queued-reqs off     a full waiting queue answers 503 (vLLM's queue limit)
  --max-num-queued-tokens off   a prompt-token backlog over N answers 503
  --[no-]enable-prefix-caching  on: vLLM's prefix cache over the KV blocks (vLLM's default)

With the default costs one sequence decodes at ~10 ms per token, 100 at ~20 ms, and a
2,048-token prefill step takes ~110 ms, so TTFT grows with prompt length and load.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson

from seawall.sim import faults as fl
from seawall.sim.scheduler import StepCosts
from seawall.sim.server import SimConfig, SimServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", default="sim-model", help="served model name")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enable-faults", action="store_true")
    parser.add_argument(
        "--fault",
        action="append",
        default=[],
        metavar="JSON",
        help='a fault at start, e.g. \'{"kind":"slow","factor":3}\' (repeatable)',
    )
    parser.add_argument("--load-time", type=float, default=0.0, metavar="S")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0, metavar="S")
    parser.add_argument("--step-base-ms", type=float, default=10.0)
    parser.add_argument("--step-per-seq-ms", type=float, default=0.1)
    parser.add_argument("--step-per-prefill-token-ms", type=float, default=0.05)
    parser.add_argument("--grammar-per-node-us", type=float, default=2.0)
    parser.add_argument("--compat", action="store_true")
    parser.add_argument("--enable-server-load-tracking", action="store_true")
    parser.add_argument("--dcgm-gpus", type=int, default=1)
    parser.add_argument("--max-num-queued-reqs", type=int, default=None, metavar="N")
    parser.add_argument("--max-num-queued-tokens", type=int, default=None, metavar="N")
    parser.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The validated configuration; raises ValueError with a message for the user."""
    faults: list[fl.Fault] = []
    load_time_s = float(args.load_time)
    for raw in args.fault:
        if not args.enable_faults:
            raise ValueError("--fault needs --enable-faults")
        try:
            fault = fl.parse_fault(orjson.loads(raw))
        except orjson.JSONDecodeError as e:
            raise ValueError(f"--fault {raw!r} is not JSON: {e}") from None
        except fl.FaultError as e:
            raise ValueError(f"--fault {raw!r}: {e}") from None
        if isinstance(fault, fl.LoadTime):
            load_time_s = max(load_time_s, fault.seconds)
        else:
            faults.append(fault)
    for name in ("max_model_len", "kv_blocks", "block_size", "max_num_seqs", "dcgm_gpus"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.grammar_per_node_us < 0:
        raise ValueError("--grammar-per-node-us must be >= 0")
    if args.max_num_batched_tokens < 1:
        raise ValueError("--max-num-batched-tokens must be >= 1")
    usable_tokens = (args.kv_blocks - 1) * args.block_size
    if usable_tokens < args.max_model_len:
        # vLLM refuses to start when one max-length sequence cannot fit in the KV cache
        raise ValueError(
            f"To serve at least one request with the model's max seq len "
            f"({args.max_model_len}), {args.max_model_len} KV cache tokens are needed, which "
            f"is larger than the available KV cache ({usable_tokens} tokens in "
            f"{args.kv_blocks - 1} usable blocks). Increase --kv-blocks or decrease "
            "--max-model-len."
        )
    costs = StepCosts(
        base_s=args.step_base_ms / 1000.0,
        per_seq_s=args.step_per_seq_ms / 1000.0,
        per_prefill_token_s=args.step_per_prefill_token_ms / 1000.0,
    )
    return SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        max_model_len=args.max_model_len,
        kv_blocks=args.kv_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        enable_faults=args.enable_faults,
        faults=tuple(faults),
        load_time_s=load_time_s,
        shutdown_timeout_s=args.shutdown_timeout,
        costs=costs,
        compat=args.compat,
        enable_server_load_tracking=args.enable_server_load_tracking,
        dcgm_gpus=args.dcgm_gpus,
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        grammar_per_node_s=args.grammar_per_node_us / 1e6,
        enable_prefix_caching=args.enable_prefix_caching,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as e:
        print(f"seawall sim: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner: asyncio.Runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        runner = asyncio.Runner()

    async def main() -> int:
        return await SimServer(config).serve()

    with runner:
        return runner.run(main())
