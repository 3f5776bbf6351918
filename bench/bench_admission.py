"""Fleet admission under overload: preemptions, throughput and shed latency, with and without.

    python bench/bench_admission.py [--replicas 2] [--kv-blocks 100] [--seconds 20]
        [--variant '{"kv_usage_max": 1.0, "inflight_max": 5}' ...] [--runs 0,1,2,5]
        [--jitter 0.5] [--prompt-style exact|prose]

About 2.5 minutes with the defaults (five runs of ~26 s, each a fresh gateway).

The issue's goal: against `seawall sim` replicas with a small KV cache, at three times the
fleet's capacity, (a) the engines' preemptions stay at most 5% of what the same load
causes without admission control, (b) the fleet's generated tokens/s stay at least 90% of
what it completes at capacity, and (c) shed requests are answered within 5 ms (p99).

Setup. `--replicas` sims with `--kv-blocks` blocks of `--block-size` tokens (one block is
vLLM's null block, never used), default step costs (10 ms + 0.1 ms per sequence + 0.05 ms
per prefill token). Every request is a streamed completion of a distinct `--prompt-tokens`
prompt (random pseudo-words, so the prefix cache never shares blocks) with `--max-tokens`
and `ignore_eos`, so each one ends holding ceil((prompt+max_tokens)/block) blocks. With
`--prompt-style exact` (default) the words are ones the gateway's token estimate (no
tokenizer configured) counts exactly as the engine does, so what the gateway reserves
per request is what the engine will use; `prose` uses all words, which the estimate
counts about twice (see `make_prompt`).

Capacity is computed from the blocks, not probed: per replica
floor((kv_blocks - 1) / ceil((prompt + max_tokens) / block_size)), the most requests that
can run to their full length together without the engine ever preempting; the fleet's
capacity is that times the replicas. The balancer need not split the clients evenly, so
run 0 (capacity, no admission) can still preempt: "max run" shows the split.

Runs, one gateway each (fresh process, so the fleet monitor's state does not carry
over), same sims, `--seconds` of load each, then up to `--grace` seconds for the streams
in flight to finish (then they are cut):

  0. capacity, no admission `capacity` clients, `admission.enabled: false`: what the
                           fleet completes at capacity when nothing is shed
  1. capacity, admission   `capacity` clients through the gateway with admission (defaults)
  2. 3x, no admission      `3 x capacity` clients, `admission.enabled: false`
  3. 3x, admission         `3 x capacity` clients, admission defaults
  4. 3x, inflight_max=C    as 3, plus `admission.inflight_max` = per-replica capacity
  5+ each `--variant JSON`: as 3 with those `admission:` overrides

Every gateway runs with `fleet.scrape_interval_s` = `--scrape-interval` (0.2 s). The
load is sent as a tier of priority 1 (`tiers.default.priority: 1`), above the default
`lowest_priority_to_queue` of 0, so when the fleet is saturated it is shed at once (429)
rather than held in the gateway queue for up to `queue_timeout_s`; the figure the issue
asks for is the latency of that refusal. A client that gets a 429 waits
min(Retry-After, `--backoff`) and sends again (bounded by the run's time and a count);
every 429 counts as one shed.

Figures per run:
- preemptions: delta of the engines' `vllm:num_preemptions_total` (summed over replicas)
  from the start of the load to the end of its drain, so all the work the load caused;
- max run: the most requests running in one engine, sampled every 0.25 s (the KV
  cache holds `capacity` per replica at full length);
- done: streams that ended with `[DONE]`; cut: still running at the end of the grace;
  starved: requests shed at least once and never served before the load ended (the
  TTFT and wait percentiles cover served requests only, so they hide these);
- tok/s: delta of the engines' `vllm:generation_tokens_total` over the load window
  after a warm-up (`--warmup`, the first 3 s: the clients all start together), divided by
  its length: tokens the fleet generated per second in steady state;
- TTFT p50/p99: client-observed, from sending the attempt that was served to its first
  content token; "wait p50/p99": from the client's FIRST attempt for that request (the
  429 back-offs included) to the first token;
- shed: 429s the clients got; shed p50/p99: client-observed, from sending to the 429
  status line; gw shed p50/p99: quantiles of the gateway's own
  `seawall_shed_latency_seconds` histogram (linear within buckets, as PromQL's
  histogram_quantile), read after the run; floor p50/p99: GET /readyz from the same
  client every 50 ms during the load, the cheapest answer the gateway gives: what any
  answer costs on this machine with this client and this gateway event loop; lag p99:
  how late the client's own event loop wakes from a 50 ms sleep (its share of the above);
- probe shed/p50/p99 (overloaded runs with admission only): a quiet prober in its own
  process (blocking http.client, keep-alive) sends a 1-token completion every 20 ms
  during the window and times each 429 from sending to the status line: the gateway's
  shed latency as a client sees it, without the load client's own event-loop lag;
  probe floor p99: the prober's GET /readyz, sent just before each of its completions.

Then the ratios against the goals, with PASS/MISS, for each protected overloaded run:
preemptions against run 2; tokens/s against run 1 (the brief's baseline) and run 0
(capacity with nothing shed); shed p99 as the load's clients, the prober and the
gateway's histogram see it.
The machine may be shared (header: cores, load average); latencies on a loaded machine
include the wait for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    Proc,
    free_port,
    machine_context,
    percentile,
    print_table,
    seawall_env,
    sim_argv,
    wait_http,
)

MODEL = "sim-model"
LOGS = REPO / "bench" / "results" / "admission-logs"
GOAL_PREEMPT_RATIO = 0.05
GOAL_TOKENS_RATIO = 0.90
GOAL_SHED_P99_S = 0.005


# ----------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] for every sample (histogram series keep their suffix)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((dict(s.labels), float(s.value)))
    return out


def metric_sum(m: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    return sum(v for _, v in m.get(name, []))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """PromQL's histogram_quantile over cumulative (le, count) buckets; NaN when empty."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le  # beyond the last finite bucket: its upper bound, as PromQL
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


async def scrape(session: Any, url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    async with session.get(url + "/metrics") as r:
        return parse_metrics(await r.text())


async def fleet_counters(session: Any, sims: list[str]) -> tuple[float, float]:
    """(preemptions, generation tokens) summed over the replicas."""
    pre = gen = 0.0
    for m in await asyncio.gather(*(scrape(session, u) for u in sims)):
        pre += metric_sum(m, "vllm:num_preemptions_total")
        gen += metric_sum(m, "vllm:generation_tokens_total")
    return pre, gen


# ----------------------------------------------------------------------------- processes


def start_sims(args: argparse.Namespace) -> list[Proc]:
    sims = []
    for i in range(args.replicas):
        port = free_port()
        argv = sim_argv(
            port, MODEL, "--seed", str(i),
            "--kv-blocks", str(args.kv_blocks), "--block-size", str(args.block_size),
            "--max-model-len", str(args.prompt_tokens + args.max_tokens + 16),
        )  # fmt: skip
        sims.append(
            Proc(f"sim{i}", argv, LOGS / f"sim{i}.log", env=seawall_env(), cwd=REPO, port=port)
        )
    for p in sims:
        wait_http(f"http://127.0.0.1:{p.port}/health", 60, p)
    return sims


def gateway_config(
    port: int, sims: list[str], admission: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [{"url": u, "model": MODEL, "id": f"r{i}"} for i, u in enumerate(sims)],
        "fleet": {"scrape_interval_s": args.scrape_interval, "ledger_path": ":memory:"},
        "tiers": {"default": {"priority": 1}},
        "admission": admission,
    }


def start_gateway(name: str, config: dict[str, Any], sims: list[str]) -> tuple[Proc, str]:
    path = LOGS / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    argv = [sys.executable, "-m", "seawall", "serve", "--config", str(path)]
    argv += ["--no-access-log", "--log-level", "WARNING"]
    proc = Proc(name, argv, LOGS / f"{name}.log", env=seawall_env(), cwd=REPO)
    url = f"http://127.0.0.1:{config['listen']['port']}"
    wait_http(url + "/readyz", 60, proc)
    return proc, url


# ----------------------------------------------------------------------------- load


@dataclass
class Load:
    ttft: list[float] = field(default_factory=list)  # served attempt -> first token
    wait: list[float] = field(default_factory=list)  # first attempt -> first token
    shed_latency: list[float] = field(default_factory=list)
    floor: list[float] = field(default_factory=list)  # GET /readyz, same client and time
    lag: list[float] = field(default_factory=list)  # client loop: asyncio.sleep overshoot
    done: int = 0
    cut: int = 0
    starved: int = 0  # shed at least once and never served before the load ended
    other: dict[str, int] = field(default_factory=dict)  # errors other than 429

    def error(self, what: str) -> None:
        self.other[what] = self.other.get(what, 0) + 1


def make_prompt(rng: random.Random, n: int, style: str) -> str:
    """n tokens for the sim's tokenizer: each ' word' of its vocabulary is one token.

    "exact": two-letter words only, which the gateway's estimate (no tokenizer configured:
    ceil(bytes/3) per word, plus 1) also counts as one token each, so the gateway sees
    n + 1, as with a real tokenizer configured. "prose": any vocabulary word; the estimate
    then counts ~2 per word, about twice the engine's count (its conservative side).
    """
    from seawall.sim import textgen

    pool = [w for w in textgen.WORDS if len(w) <= 2] if style == "exact" else textgen.WORDS
    return "".join(" " + rng.choice(pool) for _ in range(n))


async def run_clients(
    url: str, clients: int, args: argparse.Namespace, seed: int, load: Load
) -> None:
    """`clients` closed-loop clients for `args.seconds`; in-flight streams then get
    `args.grace` seconds to finish and are cut after that."""
    import aiohttp

    rng = random.Random(seed)
    headers = {"Content-Type": "application/json"}
    deadline = time.monotonic() + args.seconds
    max_attempts = 100_000  # a count bound on top of the time bound

    async def one_request(session: aiohttp.ClientSession) -> None:
        body = json.dumps(
            {
                "model": MODEL,
                "prompt": make_prompt(rng, args.prompt_tokens, args.prompt_style),
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
            }
        ).encode()
        first = time.perf_counter()
        shed = False
        while time.monotonic() < deadline:
            sent = time.perf_counter()
            async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
                if r.status == 429:
                    load.shed_latency.append(time.perf_counter() - sent)
                    shed = True
                    await r.read()
                    try:
                        retry_after = float(r.headers.get("Retry-After", args.backoff))
                    except ValueError:
                        retry_after = args.backoff
                    wait = min(retry_after, args.backoff)
                    await asyncio.sleep(wait * (1.0 - args.jitter * rng.random()))
                    continue
                if r.status != 200:
                    load.error(f"http {r.status}")
                    await r.read()
                    await asyncio.sleep(args.backoff)
                    return
                ttft = None
                async for line in r.content:
                    if ttft is None and line.startswith(b"data: {") and b'"text":"' in line:
                        now = time.perf_counter()
                        ttft = now - sent
                        load.ttft.append(ttft)
                        load.wait.append(now - first)
                    if line.startswith(b"data: [DONE]"):
                        load.done += 1
                        return
                load.error("stream ended without [DONE]")
                return
        if shed:
            load.starved += 1

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in range(max_attempts):
            if time.monotonic() >= deadline:
                return
            try:
                await one_request(session)
            except (aiohttp.ClientError, ConnectionError) as e:
                load.error(type(e).__name__)
                await asyncio.sleep(args.backoff)

    async def floor_probe(session: aiohttp.ClientSession) -> None:
        # The cheapest answer the gateway gives, from the same client at the same time:
        # what any answer costs on this machine, with this client and this gateway loop.
        while time.monotonic() < deadline:
            sent = time.perf_counter()
            try:
                async with session.get(url + "/readyz") as r:
                    await r.read()
                load.floor.append(time.perf_counter() - sent)
            except (aiohttp.ClientError, ConnectionError) as e:
                load.error(f"readyz {type(e).__name__}")
            slept = time.perf_counter()
            await asyncio.sleep(0.05)
            load.lag.append(time.perf_counter() - slept - 0.05)

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=args.seconds + args.grace + 30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.ensure_future(client(session)) for _ in range(clients)]
        tasks.append(asyncio.ensure_future(floor_probe(session)))
        _, pending = await asyncio.wait(tasks, timeout=args.seconds + args.grace)
        for t in pending:
            t.cancel()
        load.cut = len([t for t in pending if t is not tasks[-1]])
        await asyncio.gather(*pending, return_exceptions=True)


# ----------------------------------------------------------------------------- one run


@dataclass
class Result:
    name: str
    clients: int
    preemptions: float
    tokens_per_s: float
    load: Load
    shed_by_reason: dict[str, float]
    gw_shed_p50: float
    gw_shed_p99: float
    gw_shed_count: float
    max_running: float  # most requests running in one engine, sampled every 0.25 s
    probe_shed: list[float]  # the quiet prober's 429 latencies
    probe_served: int
    probe_floor: list[float]  # the prober's GET /readyz latencies


async def sample_running(
    session: Any, sims: list[str], until: asyncio.Future[None], out: list[float]
) -> None:
    """Every 0.25 s until `until` is done: each engine's `vllm:num_requests_running`."""
    while not until.done():
        for m in await asyncio.gather(*(scrape(session, u) for u in sims)):
            out.append(metric_sum(m, "vllm:num_requests_running"))
        await asyncio.sleep(0.25)


async def run_one(
    name: str,
    clients: int,
    admission: dict[str, Any],
    sims: list[str],
    args: argparse.Namespace,
    seed: int,
    probe: bool,
) -> Result:
    import aiohttp

    port = free_port()
    proc, url = start_gateway(name, gateway_config(port, sims, admission, args), sims)
    try:
        # /readyz needs a live replica; admission also needs a first scrape of each one.
        await asyncio.sleep(max(1.0, 3 * args.scrape_interval))
        async with aiohttp.ClientSession() as session:
            pre0, _ = await fleet_counters(session, sims)
            load = Load()
            clients_task = asyncio.ensure_future(run_clients(url, clients, args, seed, load))
            running: list[float] = []
            sampler = asyncio.ensure_future(sample_running(session, sims, clients_task, running))
            await asyncio.sleep(args.warmup)
            _, gen0 = await fleet_counters(session, sims)
            t0 = time.monotonic()
            prober = None
            if probe:
                prober = await asyncio.create_subprocess_exec(
                    sys.executable, __file__, "--probe", url,
                    "--seconds", str(args.seconds - args.warmup - 1),
                    stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
            await asyncio.sleep(args.seconds - args.warmup)
            _, gen1 = await fleet_counters(session, sims)
            window = time.monotonic() - t0
            probed: dict[str, Any] = {}
            if prober is not None:
                out, _ = await asyncio.wait_for(prober.communicate(), timeout=30)
                probed = json.loads(out or b"{}")
            await clients_task
            await sampler
            pre1, _ = await fleet_counters(session, sims)
            gw = await scrape(session, url)
    finally:
        proc.stop()
    shed_by_reason: dict[str, float] = {}
    for labels, v in gw.get("seawall_shed_total", []):
        shed_by_reason[labels["reason"]] = shed_by_reason.get(labels["reason"], 0.0) + v
    buckets = [
        (float(labels["le"]), v) for labels, v in gw.get("seawall_shed_latency_seconds_bucket", [])
    ]
    # let the engines finish anything aborted or still queued before the next run
    await asyncio.sleep(0.5)
    return Result(
        name=name,
        clients=clients,
        preemptions=pre1 - pre0,
        tokens_per_s=(gen1 - gen0) / window,
        load=load,
        shed_by_reason=shed_by_reason,
        gw_shed_p50=histogram_quantile(0.5, buckets),
        gw_shed_p99=histogram_quantile(0.99, buckets),
        gw_shed_count=metric_sum(gw, "seawall_shed_latency_seconds_count"),
        max_running=max(running, default=math.nan),
        probe_shed=probed.get("shed_s", []),
        probe_served=probed.get("served", 0),
        probe_floor=probed.get("floor_s", []),
    )


# ----------------------------------------------------------------------------- main


def _ms(v: float) -> float:
    return v * 1000.0 if not math.isnan(v) else math.nan


def ratio(value: float, reference: float | None) -> float:
    """value / reference; NaN when the reference run did not run (or is 0)."""
    return value / reference if reference else math.nan


def _pct(v: float) -> str:
    return "-" if math.isnan(v) else f"{v:.1%}"


def verdict(ok: bool, value: float) -> str:
    return "-" if math.isnan(value) else ("PASS" if ok else "MISS")


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'{"kv_usage_max": 1.0, ...}' -> ("kv_usage_max=1.0,...", the overrides)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: not JSON: {e}") from None
    if not isinstance(value, dict) or not value:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected a JSON object")
    return ",".join(f"{k}={v}" for k, v in value.items()), value


async def amain(args: argparse.Namespace) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    seq_tokens = args.prompt_tokens + args.max_tokens
    blocks_per_seq = -(-seq_tokens // args.block_size)
    per_replica = (args.kv_blocks - 1) // blocks_per_seq
    if per_replica < 1:
        print("the KV cache holds less than one request; raise --kv-blocks", file=sys.stderr)
        return 2
    capacity = per_replica * args.replicas
    over = args.factor * capacity
    print(f"machine: {machine_context()}")
    print(
        f"fleet: {args.replicas} sims x {args.kv_blocks} KV blocks of {args.block_size} tokens "
        f"({args.kv_blocks - 1} usable); request: {args.prompt_tokens} prompt + "
        f"{args.max_tokens} generated tokens = {blocks_per_seq} blocks at full length"
    )
    print(
        f"capacity (computed from blocks): floor({args.kv_blocks - 1}/{blocks_per_seq}) = "
        f"{per_replica} per replica, {capacity} for the fleet; {args.factor}x = {over} clients"
    )
    print(
        f"load: {args.seconds:g}s per run (tokens/s over the last "
        f"{args.seconds - args.warmup:g}s), grace {args.grace:g}s, 429 back-off "
        f"min(Retry-After, {args.backoff:g}s), scrape interval {args.scrape_interval:g}s"
    )
    sims = start_sims(args)
    urls = [f"http://127.0.0.1:{p.port}" for p in sims]
    runs: list[tuple[str, int, dict[str, Any]]] = [
        ("0 capacity, no admission", capacity, {"enabled": False}),
        ("1 capacity, admission", capacity, {}),
        (f"2 {args.factor}x, no admission", over, {"enabled": False}),
        (f"3 {args.factor}x, admission", over, {}),
        (f"4 {args.factor}x, inflight_max={per_replica}", over, {"inflight_max": per_replica}),
    ]
    for i, (name, overrides) in enumerate(args.variant, start=5):
        runs.append((f"{i} {args.factor}x, {name}", over, overrides))
    results: list[Result] = []
    try:
        for i, (name, clients, admission) in enumerate(runs):
            if args.runs is not None and i not in args.runs:
                continue
            started = time.monotonic()
            slug = "run" + name.split()[0]
            probe = clients > capacity and admission.get("enabled", True)
            res = await run_one(slug, clients, admission, urls, args, 1000 * (i + 1), probe)
            res.name = name
            results.append(res)
            reasons = ", ".join(f"{k} {v:g}" for k, v in sorted(res.shed_by_reason.items()))
            print(
                f"  {name}: {time.monotonic() - started:.0f}s, admission={json.dumps(admission)}"
                + (f", gateway shed by reason: {reasons}" if reasons else "")
                + (f", errors: {res.load.other}" if res.load.other else "")
            )
    finally:
        for p in sims:
            p.stop()

    print()
    print_table(
        [
            "run",
            "clients",
            "preempt",
            "max run",
            "done",
            "cut",
            "starved",
            "tok/s",
            "TTFT p50 ms",
            "p99",
            "wait p50 ms",
            "p99",
            "shed",
            "shed p50 ms",
            "p99",
            "gw shed p50 ms",
            "p99",
            "floor p50 ms",
            "p99",
            "lag p99 ms",
            "probe shed",
            "p50 ms",
            "p99",
            "probe floor p99",
        ],
        [
            [
                r.name,
                r.clients,
                int(r.preemptions),
                int(r.max_running) if not math.isnan(r.max_running) else "-",
                r.load.done,
                r.load.cut,
                r.load.starved,
                r.tokens_per_s,
                _ms(percentile(r.load.ttft, 50)),
                _ms(percentile(r.load.ttft, 99)),
                _ms(percentile(r.load.wait, 50)),
                _ms(percentile(r.load.wait, 99)),
                len(r.load.shed_latency),
                _ms(percentile(r.load.shed_latency, 50)),
                _ms(percentile(r.load.shed_latency, 99)),
                _ms(r.gw_shed_p50),
                _ms(r.gw_shed_p99),
                _ms(percentile(r.load.floor, 50)),
                _ms(percentile(r.load.floor, 99)),
                _ms(percentile(r.load.lag, 99)),
                len(r.probe_shed) if r.probe_shed else "-",
                _ms(percentile(r.probe_shed, 50)),
                _ms(percentile(r.probe_shed, 99)),
                _ms(percentile(r.probe_floor, 99)),
            ]
            for r in results
        ],
    )
    print()
    by_number = {int(r.name.split()[0]): r for r in results}
    bare, base, unprotected = (by_number.get(n) for n in (0, 1, 2))
    for r in (bare, base):
        if r is not None and r.preemptions:
            why = (
                "more than capacity ran in one engine"
                if r.max_running > per_replica
                else "with no engine seen over capacity"
            )
            print(
                f"note: {r.name} preempted {int(r.preemptions)} times; {why} (max run "
                f"{r.max_running:g}, capacity {per_replica} per replica)"
            )
    print(
        f"\ngoals at {args.factor}x: preemptions <= {GOAL_PREEMPT_RATIO:.0%} of run 2's (no "
        f"admission); tokens/s >= {GOAL_TOKENS_RATIO:.0%} of run 1's (capacity, through "
        f"admission) and of run 0's (capacity, nothing shed); shed p99 < "
        f"{GOAL_SHED_P99_S * 1000:g} ms as seen by the load's clients, by the quiet prober, "
        "and by the gateway's own histogram"
    )
    rows = []
    for n, r in sorted(by_number.items()):
        if n < 3:
            continue
        pre_ratio = ratio(r.preemptions, unprotected.preemptions if unprotected else None)
        tok_ratio = ratio(r.tokens_per_s, base.tokens_per_s if base else None)
        tok_ratio0 = ratio(r.tokens_per_s, bare.tokens_per_s if bare else None)
        row: list[Any] = [
            r.name,
            _pct(pre_ratio),
            verdict(pre_ratio <= GOAL_PREEMPT_RATIO, pre_ratio),
            _pct(tok_ratio),
            verdict(tok_ratio >= GOAL_TOKENS_RATIO, tok_ratio),
            _pct(tok_ratio0),
            verdict(tok_ratio0 >= GOAL_TOKENS_RATIO, tok_ratio0),
        ]
        for p99 in (
            percentile(r.load.shed_latency, 99),
            percentile(r.probe_shed, 99),
            r.gw_shed_p99,
        ):
            row += [_ms(p99), verdict(p99 < GOAL_SHED_P99_S, p99)]
        rows.append(row)
    print_table(
        [
            "run",
            "preempt ratio",
            "goal",
            "tok/s vs 1",
            "goal",
            "tok/s vs 0",
            "goal",
            "shed p99 clients ms",
            "goal",
            "probe ms",
            "goal",
            "gateway ms",
            "goal",
        ],
        rows,
    )
    print(f"\nlogs and gateway configs: {LOGS.relative_to(REPO)}/")
    return 0


def probe_main(url: str, seconds: float, interval: float = 0.02) -> int:
    """The quiet prober: one blocking client in its own process, one small request every
    `interval` s for `seconds`, each after a GET /readyz (the floor: the cheapest answer);
    prints {"shed_s": [429 latencies], "floor_s": [/readyz latencies], "served": n}."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = json.dumps({"model": MODEL, "prompt": " of to in", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    shed: list[float] = []
    floor: list[float] = []
    served = 0
    deadline = time.monotonic() + seconds
    for _ in range(int(seconds / interval) + 1):
        if time.monotonic() >= deadline:
            break
        sent = time.perf_counter()
        try:
            conn.request("GET", "/readyz")
            conn.getresponse().read()
            floor.append(time.perf_counter() - sent)
        except (OSError, http.client.HTTPException):
            conn.close()
        sent = time.perf_counter()
        try:
            conn.request("POST", "/v1/completions", body, headers)
            r = conn.getresponse()
            elapsed = time.perf_counter() - sent
            r.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            time.sleep(interval)
            continue
        if r.status == 429:
            shed.append(elapsed)
        else:
            served += 1
        time.sleep(interval)
    conn.close()
    print(json.dumps({"shed_s": shed, "floor_s": floor, "served": served}))
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--probe" and sys.argv[3] == "--seconds":
        return probe_main(sys.argv[2], float(sys.argv[4]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=100)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=20.0, help="load per run")
    parser.add_argument("--warmup", type=float, default=3.0, help="not counted in tok/s")
    parser.add_argument("--grace", type=float, default=15.0, help="drain bound per run")
    parser.add_argument("--factor", type=int, default=3, help="overload, x capacity")
    parser.add_argument("--backoff", type=float, default=0.5, help="cap on a 429's wait")
    parser.add_argument("--scrape-interval", type=float, default=0.2)
    parser.add_argument(
        "--jitter",
        type=float,
        default=0.0,
        help="a 429's wait is scaled by a uniform draw in [1 - jitter, 1] (0: none)",
    )
    parser.add_argument("--prompt-style", choices=("exact", "prose"), default="exact")
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="JSON",
        help="an extra overloaded run with these admission overrides (repeatable)",
    )
    parser.add_argument(
        "--runs",
        type=lambda t: {int(x) for x in t.split(",")},
        default=None,
        metavar="N,N,...",
        help="only these runs (numbers as printed; default all)",
    )
    args = parser.parse_args()
    if not 0 <= args.warmup < args.seconds:
        parser.error("--warmup must be in [0, --seconds)")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
