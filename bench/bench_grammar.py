"""A plain stream's inter-token latency beside a heavy-schema flood, with and without the
grammar bulkhead (issue 11, item 11).

    python bench/bench_grammar.py [--replicas 3] [--grammar-replicas 1] [--flood 6]
        [--schema-depth 9] [--flood-tokens 40] [--plain-tokens 40] [--plain-streams 4]
        [--step-ms 10] [--grammar-per-node-us 2]

About 1.5 minutes with the defaults. Smoke run: `--replicas 2 --flood 2 --flood-tokens 20
--plain-tokens 20 --plain-streams 2`.

Setup: `--replicas` `seawall sim` replicas (step cost `--step-ms` per step, no per-sequence
or prefill cost, grammar cost `--grammar-per-node-us` per schema node and depth level:
the sim's model of vLLM filling the batch's grammar bitmask while the forward pass runs)
and two gateways in front of the same replicas: `shared`, without a bulkhead, and
`bulkhead`, whose default tier names the last `--grammar-replicas` replicas as its
grammar replicas (constrained requests only there, plain requests elsewhere).

Phases, in this order, each measuring `--plain-streams` plain completion streams of
`--plain-tokens` tokens, one after another (client-side gaps between content chunks):
  unloaded   nothing else runs (through `bulkhead`; both gateways route plain requests
             alike when nothing is constrained)
  shared     `--flood` requests with a `--schema-depth` nested JSON schema (each
             `--flood-tokens` long, `ignore_eos`) are kept running through `shared`,
             which spreads them over every replica (give at least one per replica)
  bulkhead   the same flood through `bulkhead`; the plain streams through it too

Printed per phase: ITL p50, p90 and p99 (ms), the p50 and p99 ratios to unloaded, and
the flood requests completed (the bulkhead's price: its grammar replicas' steps carry
every constrained request's grammar, so the flood itself runs slower there). Goal: with
the bulkhead, the plain stream's ITL p99 within 1.2x of unloaded; without it, the
flood's slowdown shows (the schema's per-step cost over the step's). Figures from a
loaded machine mean nothing: the lead publishes them from a quiet one.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Proc, free_port, percentile, print_table, seawall_env, sim_argv, wait_http

MODEL = "sim-model"


def nested(depth: int, width: int = 2) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema for i in range(width)}}
    return schema


def start(args: argparse.Namespace, workdir: Path) -> tuple[list[Proc], dict[str, str]]:
    procs: list[Proc] = []
    sims = []
    for i in range(args.replicas):
        port = free_port()
        argv = sim_argv(port, MODEL, "--step-base-ms", str(args.step_ms), "--step-per-seq-ms",
                        "0", "--step-per-prefill-token-ms", "0", "--grammar-per-node-us",
                        str(args.grammar_per_node_us))  # fmt: skip
        sims.append(Proc(f"sim{i}", argv, workdir / f"sim{i}.log", env=seawall_env(), port=port))
    procs += sims
    for sim in sims:
        wait_http(f"http://127.0.0.1:{sim.port}/health", 30, sim)
    replicas = [{"url": f"http://127.0.0.1:{s.port}", "model": MODEL, "id": f"r{i}"}
                for i, s in enumerate(sims)]  # fmt: skip
    pool = [r["id"] for r in replicas[-args.grammar_replicas :]]
    urls: dict[str, str] = {}
    for name, tiers in (("shared", {}), ("bulkhead", {"default": {"grammar_replicas": pool}})):
        port = free_port()
        ledger = str(workdir / f"{name}.sqlite")
        cfg = {"listen": {"host": "127.0.0.1", "port": port}, "replicas": replicas,
               "tiers": tiers, "fleet": {"ledger_path": ledger}}  # fmt: skip
        path = workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        gw = Proc(name, [sys.executable, "-m", "seawall", "serve", "--config", str(path),
                         "--no-access-log"], workdir / f"{name}.log", env=seawall_env(),
                  port=port)  # fmt: skip
        procs.append(gw)
        wait_http(f"http://127.0.0.1:{port}/readyz?fleet=1", 30, gw)
        urls[name] = f"http://127.0.0.1:{port}"
    return procs, urls


def plain_gaps_s(url: str, tokens: int) -> list[float]:
    body = {"model": MODEL, "prompt": "plain", "max_tokens": tokens, "ignore_eos": True,
            "stream": True}  # fmt: skip
    arrivals: list[float] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                arrivals.append(time.monotonic())
    return [b - a for a, b in itertools.pairwise(arrivals[1:])]  # after the first token


class Flood:
    """`count` heavy-schema requests kept running (each one replaced when it ends)."""

    def __init__(self, url: str, count: int, tokens: int, schema: dict[str, Any]) -> None:
        self.body = {"model": MODEL, "prompt": "json please", "max_tokens": tokens,
                     "ignore_eos": True, "response_format": {"type": "json_schema",
                     "json_schema": {"name": "deep", "schema": schema}}}  # fmt: skip
        self.url = url
        self.stop = threading.Event()
        self.done = 0
        self.failed = 0
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(count)]

    def _loop(self) -> None:
        with httpx.Client(timeout=300) as client:
            while not self.stop.is_set():
                r = client.post(self.url + "/v1/completions", json=self.body)
                if r.status_code == 200:
                    self.done += 1
                else:
                    self.failed += 1

    def __enter__(self) -> Flood:
        for t in self.threads:
            t.start()
        time.sleep(1.0)  # every flood request admitted and decoding
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(300)


def measure(url: str, args: argparse.Namespace) -> list[float]:
    gaps: list[float] = []
    for _ in range(args.plain_streams):
        gaps += plain_gaps_s(url, args.plain_tokens)
    return gaps


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--grammar-replicas", type=int, default=1)
    p.add_argument("--flood", type=int, default=6)
    p.add_argument("--schema-depth", type=int, default=9)
    p.add_argument("--flood-tokens", type=int, default=40)
    p.add_argument("--plain-tokens", type=int, default=40)
    p.add_argument("--plain-streams", type=int, default=4)
    p.add_argument("--step-ms", type=float, default=10.0)
    p.add_argument("--grammar-per-node-us", type=float, default=2.0)
    args = p.parse_args()
    if not 1 <= args.grammar_replicas < args.replicas:
        p.error("--grammar-replicas must leave at least one replica for plain requests")

    schema = nested(args.schema_depth)
    from seawall.protocol.structured import json_shape
    from seawall.sim.scheduler import grammar_step_cost_s

    shape = json_shape(schema)
    per_step_s = grammar_step_cost_s(shape.nodes, shape.depth, args.grammar_per_node_us / 1e6)
    print(
        f"schema: {shape.nodes} nodes, depth {shape.depth}: {1000 * per_step_s:.1f} ms of "
        f"grammar per constrained sequence per step (forward pass {args.step_ms:g} ms)"
    )
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-grammar-") as tmp:
        procs, urls = start(args, Path(tmp))
        try:
            unloaded = measure(urls["bulkhead"], args)
            phases: list[tuple[str, list[float], int]] = [("unloaded", unloaded, 0)]
            for name in ("shared", "bulkhead"):
                with Flood(urls[name], args.flood, args.flood_tokens, schema) as flood:
                    gaps = measure(urls[name], args)
                phases.append((name, gaps, flood.done))
                if flood.failed:
                    print(f"{name}: {flood.failed} flood requests failed")
        finally:
            for proc in reversed(procs):
                proc.stop()
    base50, base99 = percentile(unloaded, 50), percentile(unloaded, 99)
    for name, gaps, done in phases:
        p50, p99 = percentile(gaps, 50), percentile(gaps, 99)
        rows.append([name, 1000 * p50, 1000 * percentile(gaps, 90), 1000 * p99,
                     p50 / base50, p99 / base99, done])  # fmt: skip
    print_table(["phase", "ITL p50 ms", "p90 ms", "p99 ms", "p50 x", "p99 x", "flood done"], rows)
    bulkhead_p99_ratio = rows[-1][5]
    verdict = "PASS" if bulkhead_p99_ratio <= 1.2 else "MISS"
    print(f"{verdict}: with the bulkhead, plain ITL p99 is {bulkhead_p99_ratio:.2f}x unloaded "
          "(goal: within 1.2x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
