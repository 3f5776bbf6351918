"""Fleet admission under overload, per workload: preemptions, throughput, TTFT, starvation.

    python bench/bench_admission.py [--workloads full,eos,mix,shift] [--modes none,reserve,adaptive]
        [--replicas 2] [--factor 3] [--seconds S] [--rounds R]
        [--variant '{"adaptive": {"kv_high": 0.9}}' ...]

About 8 minutes with the defaults (four workloads, three or four runs each, each run a
fresh gateway in front of the workload's own sims); `--rounds R` runs every mode R times,
interleaved, and pools them (every TTFT sample, summed preemptions and starved clients,
mean tokens/s): a run has 60-200 served requests, so its TTFT p99 is nearly a maximum
and its tokens/s moves by several percent from run to run. `--seconds` shortens every run (the
shift then happens at a third of it).

What it answers (issue 17): at `--factor` (3) times a small-KV fleet's capacity, does the
gateway's admission keep the engines out of preemption storms without giving throughput
away? Each workload runs the same load three ways in one process, one after the other:
`none` (`admission.enabled: false`), `reserve` (every request reserves prompt +
max_tokens: the rule before issue 17) and `adaptive` (the default: reserve on learned
output lengths, corrected by the engine's gauges; see policy/adaptive_admission.py).

Workloads (prompts of `--prompt-tokens` (100) exact tokens, streamed completions):
- full:  `ignore_eos`, max_tokens 200, 100-block sims: every request runs to max_tokens,
         where no admission storms (the benchmark before issue 17).
- eos:   EOS sampled, max_tokens 1000, 200-block sims: outputs as the sim samples them
         (about 1 EOS in 330 tokens: mean ~315, long tail cut at 1000).
- mix:   EOS sampled, max_tokens 1000: 85% short chats (natural length 1-120 tokens) and
         15% long generations (500-1000).
- shift: EOS sampled, max_tokens 1000: short chats (1-120) until a third of the run, then
         long generations (500-1000) only.
How lengths are chosen while EOS is still sampled by the engine: every sim runs with
`--seed 0`, so at temperature 0 the output of a prompt is a pure function of the prompt;
the benchmark computes it with the emulator's own generator (`_common.natural_length`) and
picks prompts whose natural length falls in the class wanted. The gateway sees ordinary
requests with max_tokens far above use; each prompt is used once (no prefix-cache sharing).

Clients. Capacity per replica is floor(usable blocks / blocks of prompt + max_tokens): the
most requests that can run to max_tokens together without the engine preempting (the
definition of the issue's table: 2 x 200-block sims, max_tokens 1000 -> 4, so 12 clients at
3x). `--factor` x capacity x replicas closed-loop clients (`--clients` overrides). The
mean blocks per request of the workload's lengths is printed beside it. A 429 waits
min(retry-after-ms, or else Retry-After, `--backoff`), as the OpenAI SDKs do, and
resends the same request; every 429 counts as one shed. The load is a tier of priority
1, above `lowest_priority_to_queue` 0, so a saturated fleet sheds at once rather than
queueing.
`full` also runs `capacity` clients with admission off: the fleet's full-length capacity.

Figures per run:
- preempt: delta of the engines' `vllm:num_preemptions_total` from the load's start to
  the end of its drain (all the work the load caused); rate/replica: that / replicas /
  (load + drain seconds), the storm alert's `rate(vllm:num_preemptions_total[5m])` per
  replica if the run were five minutes long; peak 10s: the worst 10-second window, per
  replica, from samples every 0.25 s;
- max run: most requests running in one engine (sampled); done / cut / starved: streams
  ended with [DONE], still running after `--grace`, clients shed at least once and never
  served during the run;
- tok/s: delta of `vllm:generation_tokens_total` over the load after `--warmup`;
- TTFT p50/p99: of served requests, from sending the attempt that was served to its first
  content token; wait p99: from the request's first attempt (429 back-offs included);
- shed, shed p99 (client-observed 429 latency), and for `full` the quiet prober's shed
  p99 (one blocking client in its own process, a 1-token request every 20 ms) beside its
  `GET /health` p99 (sent after each, on the same connection: the gateway answering with
  no admission work under the same load, the floor a 429 cannot beat on this machine);
- level: the adaptive controller's reserve level (`seawall_admission_reserve_level`, max
  over replicas) at the end of the load, and its peak. Every run's samples (per replica
  preemptions and running, the level, every 0.25 s; and from the gateway's admin API each
  replica's controller cause, KV blocks reserved / limit, requests in flight, and why a
  request would be refused there now) go to `<workload>-<mode>-samples.json` in the log
  directory, and every served request (when its served attempt was sent, its TTFT, its
  natural length, the 429s it met first) to `<workload>-<mode>-requests.json` beside it.
Goals (PASS/MISS), adaptive against none in the same workload: preemption rate per replica
under the alert's 0.5/s; TTFT p99 no worse; no client starved; for eos/mix/shift tokens/s
>= 95% of none's; for full preemptions <= 5% of none's and tokens/s >= 90% of the capacity
run's; for shift, the level rose before the first preemption after the shift (or none
came). The machine may be shared (header: cores, load average): the lead's figures come
from a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import secrets
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    LengthPool,
    Proc,
    exact_prompt,
    free_port,
    machine_context,
    natural_length,
    percentile,
    print_table,
    seawall_env,
    sim_argv,
    wait_http,
)
from seawall.auth import hash_key

MODEL = "sim-model"
LOGS = REPO / "bench" / "results" / "admission-logs"
STORM_RATE_PER_REPLICA = 0.5  # the seed's alert: rate(vllm:num_preemptions_total[5m]) > 0.5
GOAL_TOKENS_REALISTIC = 0.95
GOAL_PREEMPT_FULL = 0.05
GOAL_CAPACITY_FULL = 0.90
GOAL_SHED_P99_S = 0.005
SAMPLE_S = 0.25
MODES: dict[str, dict[str, Any]] = {
    "none": {"enabled": False},
    "reserve": {"mode": "reserve"},
    "adaptive": {"mode": "adaptive"},
}

# ----------------------------------------------------------------------------- workloads

Classes = tuple[tuple[float, int, int], ...]  # (share, natural length lo, hi)
SHORT: Classes = ((1.0, 1, 120),)
LONG: Classes = ((1.0, 500, 1000),)
MIX: Classes = ((0.85, 1, 120), (0.15, 500, 1000))


@dataclass(frozen=True)
class Workload:
    name: str
    kv_blocks: int
    max_tokens: int
    ignore_eos: bool = False
    classes: Classes | None = None  # None: the natural (sampled) lengths
    after_shift: Classes | None = None  # the classes after `shift_at` of the run
    shift_at: float = 1 / 3  # share of the load's seconds
    seconds: float = 20.0


WORKLOADS = {
    "full": Workload("full", kv_blocks=100, max_tokens=200, ignore_eos=True),
    "eos": Workload("eos", kv_blocks=200, max_tokens=1000),
    "mix": Workload("mix", kv_blocks=200, max_tokens=1000, classes=MIX),
    "shift": Workload(
        "shift", kv_blocks=200, max_tokens=1000, classes=SHORT, after_shift=LONG, seconds=30.0
    ),
}


class Prompts:
    """The requests of one run: prompts of known natural length, drawn by class.

    `seed` draws the classes (the n-th request of the run is short or long) and, within a
    class, the n-th request's length; `pool_seed` the prompts. The runs of a round share
    `seed` and differ in `pool_seed`: every mode meets the same sequence of lengths (to
    within 2%, at least 2 tokens), while no prompt is sent twice to the same sims (their
    prefix cache would flatter the later run). Drawing the length from each mode's own
    prompts, as before, gave the modes of a round different long generations (one mode's
    round met at least five that ran to max_tokens, another's one), which moved tokens/s between
    modes by several percent in every run: more than the differences being measured."""

    def __init__(
        self, w: Workload, args: argparse.Namespace, seed: int, pool_seed: int | None = None
    ) -> None:
        self.w = w
        self.args = args
        self.rng = random.Random(seed)
        self.lengths = LengthPool(seed, args.prompt_tokens, w.max_tokens)  # the round's
        self.pool = LengthPool(
            seed if pool_seed is None else pool_seed, args.prompt_tokens, w.max_tokens
        )
        self.targets: dict[tuple[int, int], list[int]] = {}  # each class's lengths, in order
        self.ready: dict[tuple[int, int], list[tuple[str, int]]] = {}
        self.used: dict[tuple[int, int], int] = {}

    def _matched(self, lo: int, hi: int, k: int) -> tuple[str, int]:
        """A prompt of this run's pool for the k-th request of class [lo, hi]: of the
        length the round's sequence gives that request."""
        targets = self.targets.setdefault((lo, hi), [])
        while len(targets) <= k:
            targets.append(self.lengths.take(lo, hi)[1])
        n = targets[k]
        tol = max(2, n // 50)
        return self.pool.take(max(lo, n - tol), min(hi, n + tol))

    def prepare(self, counts: dict[tuple[int, int], int]) -> None:
        """Generate before the load (about 0.5 ms per candidate) so the load never waits."""
        for (lo, hi), n in counts.items():
            bucket = self.ready.setdefault((lo, hi), [])
            while len(bucket) < n:
                bucket.append(self._matched(lo, hi, len(bucket)))

    def next(self, shifted: bool) -> tuple[str, int]:
        w = self.w
        classes = w.after_shift if shifted and w.after_shift else w.classes
        if classes is None:
            prompt = exact_prompt(self.rng, self.args.prompt_tokens)
            return prompt, w.max_tokens if w.ignore_eos else -1  # -1: not computed
        roll = self.rng.random()
        lo, hi = classes[-1][1:]
        for share, a, b in classes:
            roll -= share
            if roll <= 0:
                lo, hi = a, b
                break
        k = self.used.get((lo, hi), 0)
        self.used[(lo, hi)] = k + 1
        bucket = self.ready.get((lo, hi), [])
        if k < len(bucket):
            return bucket[k]
        return self._matched(lo, hi, k)  # ran out of prepared ones: make one now


def mean_blocks(w: Workload, args: argparse.Namespace) -> float:
    """Mean KV blocks per request at its end, over the workload's (long-phase) lengths."""
    bs = args.block_size
    if w.ignore_eos:
        return float(-(-(args.prompt_tokens + w.max_tokens) // bs))
    rng = random.Random(7)
    classes = w.after_shift or w.classes
    if classes is None:
        lengths = [
            natural_length(exact_prompt(rng, args.prompt_tokens), w.max_tokens) for _ in range(600)
        ]
        return sum(-(-(args.prompt_tokens + n) // bs) for n in lengths) / len(lengths)
    pool = LengthPool(7, args.prompt_tokens, w.max_tokens)
    total = 0.0
    for share, lo, hi in classes:
        lengths = [pool.take(lo, hi)[1] for _ in range(60)]
        total += share * sum(-(-(args.prompt_tokens + n) // bs) for n in lengths) / len(lengths)
    return total


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


def start_sims(w: Workload, args: argparse.Namespace) -> list[Proc]:
    sims = []
    for i in range(args.replicas):
        port = free_port()
        argv = sim_argv(
            port, MODEL, "--seed", "0",
            "--kv-blocks", str(w.kv_blocks), "--block-size", str(args.block_size),
            "--max-model-len", str(args.prompt_tokens + w.max_tokens + 16),
        )  # fmt: skip
        log = LOGS / f"{w.name}-sim{i}.log"
        sims.append(Proc(f"sim{i}", argv, log, env=seawall_env(), cwd=REPO, port=port))
    for p in sims:
        wait_http(f"http://127.0.0.1:{p.port}/health", 60, p)
    return sims


# The admin API's token for this benchmark's gateways (loopback only, one run each).
ADMIN_TOKEN = "bench-admission-" + secrets.token_hex(8)


def gateway_config(
    port: int, sims: list[str], admission: dict[str, Any], args: argparse.Namespace
) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {
            "enabled": True,
            "port": free_port(),
            "token_hash": hash_key(ADMIN_TOKEN),
        },
        "replicas": [{"url": u, "model": MODEL, "id": f"r{i}"} for i, u in enumerate(sims)],
        "fleet": {"scrape_interval_s": args.scrape_interval, "ledger_path": ":memory:"},
        "tiers": {"default": {"priority": 1}},
        "admission": admission,
    }


def start_gateway(name: str, config: dict[str, Any]) -> tuple[Proc, str]:
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
    shed_why: dict[str, int] = field(default_factory=dict)  # 429s by the gateway's reason
    done: int = 0
    cut: int = 0
    starved: int = 0  # clients shed at least once and never served during the run
    other: dict[str, int] = field(default_factory=dict)  # errors other than 429
    # Per served request: when its served attempt was sent (s into the run), its TTFT,
    # its natural length (-1: not computed) and how many 429s it met first; dumped
    # beside the samples, so a TTFT tail can be matched to what the engines were doing.
    served: list[tuple[float, float, int, int]] = field(default_factory=list)

    def error(self, what: str) -> None:
        self.other[what] = self.other.get(what, 0) + 1


async def run_clients(
    url: str,
    clients: int,
    w: Workload,
    seconds: float,
    prompts: Prompts,
    args: argparse.Namespace,
    load: Load,
    started: float,
) -> None:
    """`clients` closed-loop clients for `seconds`; in-flight streams then get
    `args.grace` seconds to finish and are cut after that."""
    import aiohttp

    headers = {"Content-Type": "application/json"}
    deadline = started + seconds
    shift_at = started + w.shift_at * seconds
    max_attempts = 100_000  # a count bound on top of the time bound

    async def one_request(session: aiohttp.ClientSession, served: list[bool]) -> bool:
        prompt, natural = prompts.next(shifted=time.monotonic() >= shift_at)
        refused = 0
        body: dict[str, Any] = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": w.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        if w.ignore_eos:
            body["ignore_eos"] = True
        data = json.dumps(body).encode()
        first = time.perf_counter()
        while time.monotonic() < deadline:
            sent = time.perf_counter()
            async with session.post(url + "/v1/completions", data=data, headers=headers) as r:
                if r.status == 429:
                    load.shed_latency.append(time.perf_counter() - sent)
                    refused += 1
                    why = _shed_reason(await r.read())
                    load.shed_why[why] = load.shed_why.get(why, 0) + 1
                    try:  # retry-after-ms first, as the OpenAI SDKs read them
                        ms = r.headers.get("retry-after-ms")
                        retry_after = (
                            float(ms) / 1000
                            if ms is not None
                            else float(r.headers.get("Retry-After", args.backoff))
                        )
                    except ValueError:
                        retry_after = args.backoff
                    await asyncio.sleep(min(retry_after, args.backoff))
                    continue
                if r.status != 200:
                    load.error(f"http {r.status}")
                    await r.read()
                    await asyncio.sleep(args.backoff)
                    return refused > 0
                served[0] = True
                ttft = None
                async for line in r.content:
                    if ttft is None and line.startswith(b"data: {") and b'"text":"' in line:
                        now = time.perf_counter()
                        ttft = now - sent
                        load.ttft.append(ttft)
                        load.wait.append(now - first)
                        at = time.monotonic() - started - ttft
                        load.served.append((round(at, 4), round(ttft, 5), natural, refused))
                    if line.startswith(b"data: [DONE]"):
                        load.done += 1
                        return refused > 0
                load.error("stream ended without [DONE]")
                return refused > 0
        return refused > 0

    async def client(session: aiohttp.ClientSession) -> None:
        served = [False]
        shed_ever = False
        try:
            for _ in range(max_attempts):
                if time.monotonic() >= deadline:
                    return
                try:
                    shed_ever = await one_request(session, served) or shed_ever
                except (aiohttp.ClientError, ConnectionError) as e:
                    load.error(type(e).__name__)
                    await asyncio.sleep(args.backoff)
        finally:
            if shed_ever and not served[0]:
                load.starved += 1

    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=seconds + args.grace + 30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = [asyncio.ensure_future(client(session)) for _ in range(clients)]
        _, pending = await asyncio.wait(tasks, timeout=seconds + args.grace)
        for t in pending:
            t.cancel()
        load.cut = len(pending)
        await asyncio.gather(*pending, return_exceptions=True)


def _shed_reason(body: bytes) -> str:
    """A 429's code and the kind of its message (numbers dropped, so reasons group)."""
    try:
        error = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return "unreadable"
    message = str(error.get("message", ""))
    _, _, detail = message.partition("; ")
    kind = re.sub(r"[-+]?\d[\d.,%]*", "N", detail)[:60]
    return f"{error.get('code')}: {kind}"


@dataclass
class Sample:
    t: float  # seconds since the load started
    preemptions: list[float]  # per replica, cumulative
    running: list[float]
    level: float | None  # the gateway's reserve level, max over replicas
    # Per replica, from the admin API (adaptive mode): the controller's cause, its KV
    # blocks reserved / limit, requests, and why a request would be refused there now.
    control: list[dict[str, Any]] = field(default_factory=list)


async def admin_control(session: Any, admin: str) -> list[dict[str, Any]]:
    import aiohttp

    try:
        async with session.get(
            admin + "/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
        ) as resp:
            state = await resp.json()
    except (aiohttp.ClientError, ValueError):
        return []
    out = []
    for r in state.get("replicas", []):
        a = r.get("admission") or {}
        out.append(
            {
                "cause": a.get("cause"),
                "reserved": a.get("reserved_kv_blocks"),
                "limit": a.get("limit_kv_blocks"),
                "requests": a.get("requests"),
                "level": a.get("reserve_level"),
                "kv": a.get("kv_usage"),
                "trend": a.get("kv_trend_per_s"),
                "refuse": r.get("saturation_reason"),
            }
        )
    return out


async def sample(
    session: Any,
    sims: list[str],
    gateway: str,
    admin: str,
    until: asyncio.Future[None],
    started: float,
) -> list[Sample]:
    out: list[Sample] = []
    while not until.done():
        *got, control = await asyncio.gather(
            *(scrape(session, u) for u in [*sims, gateway]), admin_control(session, admin)
        )
        levels = [v for _, v in got[-1].get("seawall_admission_reserve_level", [])]
        out.append(
            Sample(
                time.monotonic() - started,
                [metric_sum(m, "vllm:num_preemptions_total") for m in got[:-1]],
                [metric_sum(m, "vllm:num_requests_running") for m in got[:-1]],
                max(levels) if levels else None,
                control,
            )
        )
        await asyncio.sleep(SAMPLE_S)
    return out


# ----------------------------------------------------------------------------- one run


@dataclass
class Result:
    workload: str
    mode: str
    clients: int
    preemptions: float
    busy_s: float  # load + drain
    tokens_per_s: float
    load: Load
    samples: list[Sample]
    replicas: int
    probe_shed: list[float] = field(default_factory=list)
    probe_health: list[float] = field(default_factory=list)  # the prober's GET /health
    rounds: list[Result] = field(default_factory=list)  # pooled: the runs it pools

    @property
    def rate_per_replica(self) -> float:
        return self.preemptions / self.replicas / self.busy_s if self.busy_s > 0 else math.nan

    def peak_rate_per_replica(self, window_s: float = 10.0) -> float:
        if self.rounds:
            return max(r.peak_rate_per_replica(window_s) for r in self.rounds)
        best = 0.0
        s = self.samples
        j = 0
        for i in range(len(s)):
            while s[i].t - s[j].t > window_s:
                j += 1
            if s[i].t - s[j].t >= window_s / 2:
                worst = max(a - b for a, b in zip(s[i].preemptions, s[j].preemptions, strict=True))
                best = max(best, worst / (s[i].t - s[j].t))
        return best

    @property
    def max_running(self) -> float:
        return max((max(x.running) for x in self.samples), default=math.nan)

    def level_end(self, seconds: float) -> float | None:
        if self.rounds:
            return self.rounds[-1].level_end(seconds)
        during = [x.level for x in self.samples if x.t <= seconds and x.level is not None]
        return during[-1] if during else None

    def level_peak(self) -> float | None:
        levels = [x.level for x in self.samples if x.level is not None]
        return max(levels) if levels else None


def pooled(runs: list[Result]) -> Result:
    """One mode's runs of a workload as one: every TTFT and shed sample, summed
    preemptions, busy time, starved clients and counts, the mean tokens/s."""
    if len(runs) == 1:
        return runs[0]
    first = runs[0]
    load = Load()
    for r in runs:
        load.ttft += r.load.ttft
        load.wait += r.load.wait
        load.shed_latency += r.load.shed_latency
        for k, v in r.load.shed_why.items():
            load.shed_why[k] = load.shed_why.get(k, 0) + v
        for k, v in r.load.other.items():
            load.other[k] = load.other.get(k, 0) + v
        load.done += r.load.done
        load.cut += r.load.cut
        load.starved += r.load.starved
    return Result(
        workload=first.workload,
        mode=first.mode,
        clients=first.clients,
        preemptions=sum(r.preemptions for r in runs),
        busy_s=sum(r.busy_s for r in runs),
        tokens_per_s=sum(r.tokens_per_s for r in runs) / len(runs),
        load=load,
        samples=[s for r in runs for s in r.samples],
        replicas=first.replicas,
        probe_shed=[x for r in runs for x in r.probe_shed],
        probe_health=[x for r in runs for x in r.probe_health],
        rounds=runs,
    )


async def run_one(
    w: Workload,
    mode: str,
    admission: dict[str, Any],
    clients: int,
    sims: list[str],
    args: argparse.Namespace,
    seed: int,
    pool_seed: int,
    probe: bool,
) -> Result:
    import aiohttp

    seconds = args.seconds or w.seconds
    prompts = Prompts(w, args, seed, pool_seed)
    if w.classes is not None:
        # Enough prepared for the run: each client's worth of short requests, long ones fewer.
        want: dict[tuple[int, int], int] = {}
        for classes in (w.classes, w.after_shift or ()):
            for share, lo, hi in classes:
                per_s = 4.0 if hi <= 200 else 0.3
                want[(lo, hi)] = want.get((lo, hi), 0) + int(clients * share * per_s * seconds)
        prompts.prepare({k: min(v, 3000) for k, v in want.items()})
    port = free_port()
    name = f"{w.name}-{mode}"
    config = gateway_config(port, sims, admission, args)
    proc, url = start_gateway(name, config)
    admin = f"http://127.0.0.1:{config['admin']['port']}"
    try:
        # /readyz needs a live replica; admission also needs a first scrape of each one.
        await asyncio.sleep(max(1.0, 3 * args.scrape_interval))
        async with aiohttp.ClientSession() as session:
            pre0, _ = await fleet_counters(session, sims)
            load = Load()
            started = time.monotonic()
            clients_task = asyncio.ensure_future(
                run_clients(url, clients, w, seconds, prompts, args, load, started)
            )
            sampler = asyncio.ensure_future(
                sample(session, sims, url, admin, clients_task, started)
            )
            await asyncio.sleep(args.warmup)
            _, gen0 = await fleet_counters(session, sims)
            t0 = time.monotonic()
            prober = None
            if probe:
                prober = await asyncio.create_subprocess_exec(
                    sys.executable, __file__, "--probe", url,
                    "--seconds", str(seconds - args.warmup - 1),
                    stdout=asyncio.subprocess.PIPE,
                )  # fmt: skip
            await asyncio.sleep(max(0.0, started + seconds - time.monotonic()))
            _, gen1 = await fleet_counters(session, sims)
            window = time.monotonic() - t0
            probed: dict[str, Any] = {}
            if prober is not None:
                out, _ = await asyncio.wait_for(prober.communicate(), timeout=30)
                probed = json.loads(out or b"{}")
            await clients_task
            busy = time.monotonic() - started
            samples = await sampler
            pre1, _ = await fleet_counters(session, sims)
    finally:
        proc.stop()
    await asyncio.sleep(0.5)  # let the engines finish anything aborted before the next run
    return Result(
        workload=w.name,
        mode=mode,
        clients=clients,
        preemptions=pre1 - pre0,
        busy_s=busy,
        tokens_per_s=(gen1 - gen0) / window,
        load=load,
        samples=samples,
        replicas=args.replicas,
        probe_shed=probed.get("shed_s", []),
        probe_health=probed.get("health_s", []),
    )


# ----------------------------------------------------------------------------- main


def _ms(v: float) -> float:
    return v * 1000.0 if not math.isnan(v) else math.nan


def verdict(ok: bool, known: bool = True) -> str:
    return "-" if not known else ("PASS" if ok else "MISS")


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """'{"adaptive": {"kv_high": 0.9}}' -> ("adaptive={...}", the admission overrides)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: not JSON: {e}") from None
    if not isinstance(value, dict) or not value:
        raise argparse.ArgumentTypeError(f"--variant {text!r}: expected a JSON object")
    return ",".join(f"{k}={json.dumps(v)}" for k, v in value.items()), value


def shift_timing(r: Result, w: Workload, seconds: float) -> tuple[float | None, float | None]:
    """(when the level first rose over 0.1 after the shift, when the first preemption after
    the shift came), in seconds since the load started."""
    at = w.shift_at * seconds
    tightened = next(
        (x.t for x in r.samples if x.t >= at and x.level is not None and x.level > 0.1), None
    )
    base = next((x for x in r.samples if x.t >= at), None)
    first = None
    if base is not None:
        first = next(
            (x.t for x in r.samples if x.t > base.t and sum(x.preemptions) > sum(base.preemptions)),
            None,
        )
    return tightened, first


def report(w: Workload, results: list[Result], seconds: float, capacity: int) -> list[list[Any]]:
    print(f"\n== {w.name}: per run")
    print_table(
        [
            "run", "clients", "preempt", "rate/replica", "peak 10s", "max run", "done", "cut",
            "starved", "tok/s", "TTFT p50 ms", "p99", "wait p99 ms", "shed", "shed p99 ms",
            "probe p99 ms", "/health p99", "level end", "peak",
        ],
        [
            [
                r.mode, r.clients, int(r.preemptions), r.rate_per_replica,
                r.peak_rate_per_replica(), r.max_running, r.load.done, r.load.cut,
                r.load.starved, r.tokens_per_s, _ms(percentile(r.load.ttft, 50)),
                _ms(percentile(r.load.ttft, 99)), _ms(percentile(r.load.wait, 99)),
                len(r.load.shed_latency), _ms(percentile(r.load.shed_latency, 99)),
                _ms(percentile(r.probe_shed, 99)), _ms(percentile(r.probe_health, 99)),
                "-" if r.level_end(seconds) is None else f"{r.level_end(seconds):+.2f}",
                "-" if r.level_peak() is None else f"{r.level_peak():+.2f}",
            ]
            for r in [*(x for r in results for x in r.rounds), *results]
        ],
    )  # fmt: skip
    if any(r.rounds for r in results):
        print(f"  (the last {len(results)} rows pool the rounds above them, mode by mode)")
    for r in results:
        if r.load.other:
            print(f"  {r.mode}: errors {r.load.other}")
        if r.load.shed_why:
            print(f"  {r.mode}: shed {r.load.shed_why}")
    by = {r.mode: r for r in results}
    none = by.get("none")
    rows: list[list[Any]] = []
    for r in results:
        if r.mode in ("none", "capacity"):
            continue
        rate_ok = r.rate_per_replica < STORM_RATE_PER_REPLICA
        goals: list[str] = [f"storm rate {r.rate_per_replica:.3f}/s {verdict(rate_ok)}"]
        if none is not None:
            p99, p99_none = percentile(r.load.ttft, 99), percentile(none.load.ttft, 99)
            goals.append(f"TTFT p99 {_ms(p99):.0f} vs {_ms(p99_none):.0f} ms "
                         f"{verdict(p99 <= p99_none, not math.isnan(p99))}")  # fmt: skip
            ratio = r.tokens_per_s / none.tokens_per_s if none.tokens_per_s else math.nan
            if w.ignore_eos:
                pre = r.preemptions / none.preemptions if none.preemptions else math.nan
                goals.append(
                    f"preemptions {pre:.1%} of none "
                    f"{verdict(pre <= GOAL_PREEMPT_FULL, not math.isnan(pre))}"
                )
            else:
                goals.append(f"tok/s {ratio:.1%} of none {verdict(ratio >= GOAL_TOKENS_REALISTIC)}")
        cap = by.get("capacity")
        if w.ignore_eos and cap is not None and cap.tokens_per_s:
            ratio = r.tokens_per_s / cap.tokens_per_s
            goals.append(f"tok/s {ratio:.1%} of capacity {verdict(ratio >= GOAL_CAPACITY_FULL)}")
        if w.ignore_eos and r.probe_shed:
            p = percentile(r.probe_shed, 99)
            floor = percentile(r.probe_health, 99)
            goals.append(
                f"probe shed p99 {_ms(p):.1f} ms {verdict(p < GOAL_SHED_P99_S)} "
                f"(its GET /health p99 {_ms(floor):.1f} ms)"
            )
        goals.append(f"starved {r.load.starved} {verdict(r.load.starved == 0)}")
        if w.after_shift is not None:
            for k, one in enumerate(r.rounds or [r]):
                tightened, first = shift_timing(one, w, seconds)
                ok = first is None or (tightened is not None and tightened <= first)
                goals.append(
                    f"shift at {w.shift_at * seconds:.0f}s"
                    + (f" (round {k + 1})" if r.rounds else "")
                    + f": tightened {'-' if tightened is None else f'{tightened:.1f}s'}, first "
                    f"preemption {'-' if first is None else f'{first:.1f}s'} {verdict(ok)}"
                )
        rows.append([f"{w.name} {r.mode}", "; ".join(goals)])
    return rows


async def amain(args: argparse.Namespace) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine_context()}")
    print(
        f"fleet: {args.replicas} sims; prompts {args.prompt_tokens} tokens; factor "
        f"{args.factor}x; 429 back-off min(Retry-After, {args.backoff:g}s); scrape interval "
        f"{args.scrape_interval:g}s; grace {args.grace:g}s; tokens/s after {args.warmup:g}s"
    )
    summary: list[list[Any]] = []
    for name in args.workloads:
        w = WORKLOADS[name]
        seconds = args.seconds or w.seconds
        blocks = mean_blocks(w, args)
        worst = -(-(args.prompt_tokens + w.max_tokens) // args.block_size)
        per_replica = max(1, (w.kv_blocks - 1) // worst)
        capacity = per_replica * args.replicas
        clients = args.clients or args.factor * capacity
        print(
            f"\n{w.name}: {w.kv_blocks} KV blocks of {args.block_size} tokens per sim, "
            f"max_tokens {w.max_tokens}{', ignore_eos' if w.ignore_eos else ', EOS sampled'}; "
            f"{worst} blocks per request at max_tokens -> capacity {per_replica} per replica "
            f"({blocks:.1f} blocks per request on average); {clients} clients for {seconds:g}s"
            + (f", shift to long outputs at {w.shift_at * seconds:.0f}s" if w.after_shift else "")
        )
        runs: list[tuple[str, dict[str, Any], int]] = []
        if w.ignore_eos and "none" in args.modes:
            runs.append(("capacity", MODES["none"], capacity))
        runs += [(m, MODES[m], clients) for m in args.modes]
        runs += [(label, {"mode": "adaptive", **ov}, clients) for label, ov in args.variant]
        sims = start_sims(w, args)
        urls = [f"http://127.0.0.1:{p.port}" for p in sims]
        by_mode: dict[str, list[Result]] = {mode: [] for mode, _, _ in runs}
        try:
            for k in range(args.rounds):
                # Interleaved: each round runs every mode once, starting one mode later.
                order = runs[k % len(runs) :] + runs[: k % len(runs)]
                for mode, admission, n in order:
                    t = time.monotonic()
                    probe = w.ignore_eos and mode != "none" and mode != "capacity"
                    i = [m for m, _, _ in runs].index(mode)
                    # The round's class sequence, each mode's own prompts (`Prompts`).
                    # By the workload's name, not its place in --workloads: a workload
                    # run alone meets the sequence it met in the full run.
                    seed = 1000 + 17 * list(WORKLOADS).index(w.name) + 100_003 * k
                    pool_seed = seed + 1000 * i
                    res = await run_one(w, mode, admission, n, urls, args, seed, pool_seed, probe)
                    by_mode[mode].append(res)
                    tag = f"{mode}" + (f" #{k + 1}" if args.rounds > 1 else "")
                    res.mode = tag
                    dump = (
                        LOGS
                        / f"{w.name}-{mode}{f'-{k + 1}' if args.rounds > 1 else ''}-samples.json"
                    )
                    dump.write_text(json.dumps([s.__dict__ for s in res.samples]))
                    requests = dump.with_name(dump.name.replace("-samples", "-requests"))
                    requests.write_text(json.dumps(res.load.served))
                    print(
                        f"  {tag}: {time.monotonic() - t:.0f}s, preemptions "
                        f"{int(res.preemptions)}, tok/s {res.tokens_per_s:.0f}, "
                        f"starved {res.load.starved}"
                    )
        finally:
            for p in sims:
                p.stop()
        results = []
        for mode, rs in by_mode.items():
            one = pooled(rs)
            one.mode = mode
            results.append(one)
        summary += report(w, results, seconds, capacity)
    print("\n== goals (adaptive and the other protected runs against none, same workload)")
    print_table(["run", "goals"], summary)
    print(f"\nlogs and gateway configs: {LOGS.relative_to(REPO)}/")
    return 0


def probe_main(url: str, seconds: float, interval: float = 0.02) -> int:
    """The quiet prober: one blocking client in its own process, one small request every
    `interval` s for `seconds`, each followed by a `GET /health` on the same connection
    (the floor: the gateway answering with no admission work, under the same load);
    prints {"shed_s": [429 latencies], "health_s": [/health latencies], "served": n}."""
    import http.client
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    body = json.dumps({"model": MODEL, "prompt": " of to in", "max_tokens": 1}).encode()
    headers = {"Content-Type": "application/json"}
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=10)
    shed: list[float] = []
    health: list[float] = []
    served = 0

    def timed(method: str, path: str, payload: bytes | None = None) -> tuple[int, float] | None:
        """(status, seconds to the response's headers), or None if the connection failed."""
        sent = time.perf_counter()
        try:
            conn.request(method, path, payload, headers if payload else {})
            r = conn.getresponse()
            elapsed = time.perf_counter() - sent
            r.read()
        except (OSError, http.client.HTTPException):
            conn.close()
            return None
        return r.status, elapsed

    deadline = time.monotonic() + seconds
    for _ in range(int(seconds / interval) + 1):
        if time.monotonic() >= deadline:
            break
        answer = timed("POST", "/v1/completions", body)
        if answer is not None:
            if answer[0] == 429:
                shed.append(answer[1])
            else:
                served += 1
            floor = timed("GET", "/health")
            if floor is not None and floor[0] == 200:
                health.append(floor[1])
        time.sleep(interval)
    conn.close()
    print(json.dumps({"shed_s": shed, "health_s": health, "served": served}))
    return 0


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--probe" and sys.argv[3] == "--seconds":
        return probe_main(sys.argv[2], float(sys.argv[4]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])

    def names(valid: dict[str, Any]) -> Any:
        def parse(text: str) -> list[str]:
            got = [x for x in text.split(",") if x]
            bad = [x for x in got if x not in valid]
            if bad or not got:
                raise argparse.ArgumentTypeError(f"choose from {', '.join(valid)}")
            return got

        return parse

    parser.add_argument("--workloads", type=names(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--modes", type=names(MODES), default=list(MODES))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=0.0, help="load per run (0: per workload)")
    parser.add_argument("--warmup", type=float, default=5.0, help="not counted in tok/s")
    parser.add_argument("--grace", type=float, default=15.0, help="drain bound per run")
    parser.add_argument("--factor", type=int, default=3, help="overload, x capacity")
    parser.add_argument("--clients", type=int, default=0, help="override factor x capacity")
    parser.add_argument("--backoff", type=float, default=0.5, help="cap on a 429's wait")
    parser.add_argument("--scrape-interval", type=float, default=0.2)
    parser.add_argument(
        "--rounds", type=int, default=1, help="runs of each mode, interleaved and pooled"
    )
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="JSON",
        help="an extra adaptive run with these admission overrides (repeatable)",
    )
    args = parser.parse_args()
    if args.seconds and not 0 <= args.warmup < args.seconds:
        parser.error("--warmup must be in [0, --seconds)")
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
