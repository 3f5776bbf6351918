"""What a gateway adds to streamed completions: Seawall against direct and against peers.

    python bench/bench_gateway.py [--peers] [--concurrency 100[,10]] [--requests 2000]
        [--max-tokens 64] [--replicas 2] [--profile]

One run, side by side, in front of the same `seawall sim` replicas (low step costs, so
the emulator is not the bottleneck; its CPU is printed too):

- direct: the client round-robins over the replicas itself (the reference),
- seawall: `python -m seawall serve --replica ... --no-access-log` (its defaults),
- seawall-noadm: the same with `admission: {enabled: false}`: the proxy's own cost,
  without fleet admission queueing or shedding when it reads the engines as saturated,
- with `--peers`: vllm-router (Rust, PyPI `vllm-router`) and the LiteLLM proxy (PyPI
  `litellm[proxy]`), each installed on first use in its own venv under bench/.peers/.

For each system and concurrency: start the proxy, warm it up, then a load driver in a
separate process (`bench/_common.py drive`: aiohttp, its own GIL and CPU) sends
`--requests` streamed chat completions, `--concurrency` at a time, and records per
request the time to the first content token and to `[DONE]`. The proxy's CPU time is
utime+stime from /proc/<pid>/stat of the proxy and its descendants, read before and after
the load. Printed: requests ok/failed, TTFT p50/p99, added TTFT p50/p99 over direct,
streamed tokens/s, proxy CPU-seconds per 1,000 streamed requests, its peak RSS, for
Seawall its cycle-collector runs and the objects they found per 1,000 requests (each run
stops the event loop), the machine's CPU busy share during the load, then the
Seawall/peer ratios and the issue's two goals.

The machine may be shared: the header prints cores and load average, and each row the
whole machine's CPU busy share during that load (near 100% means saturated, and
latencies then measure the queue for a core, not the proxy).

`--profile` adds one more Seawall load under py-spy (installed in bench/.peers/tools) and
prints the top functions by own time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    PEERS,
    REPO,
    Proc,
    baseline_src,
    cpu_seconds,
    free_port,
    machine_context,
    peak_rss_mib,
    peer_venv,
    peer_version,
    percentile,
    print_table,
    run_driver,
    seawall_env,
    sim_argv,
    start_vllm_router,
    wait_http,
)
from seawall.fleet.adapters import parse_samples

LOGS = REPO / "bench" / "results" / "gateway-logs"
MODEL = "sim-model"
# prometheus_client's cycle-collector counters (one child per generation).
GC_RUNS, GC_FOUND = "python_gc_collections_total", "python_gc_objects_collected_total"
SYSTEMS = ("direct", "seawall", "seawall-noadm", "vllm-router", "litellm")
# seawall-noadm: fleet admission (saturation queue/shed) off, the rest as configured: the
# proxy's own cost, without the admission policy deciding to queue or shed.
NOADM_CONFIG = "admission:\n  enabled: false\n"

# LiteLLM proxy, made as lean as it goes: no database (no DATABASE_URL), no spend or
# error logs, no telemetry, no callbacks, errors-only logging, one uvicorn worker, and
# the default simple-shuffle router over one deployment per replica. It refuses to start
# without a master key, so it has one (the load driver sends it as its bearer token).
LITELLM_CONFIG = """\
model_list:
{deployments}
litellm_settings:
  telemetry: false
  set_verbose: false
  drop_params: true
  callbacks: []
  success_callback: []
  failure_callback: []
  request_timeout: 600
general_settings:
  master_key: sk-bench
  disable_spend_logs: true
  disable_error_logs: true
  disable_adding_master_key_hash_to_db: true
  allow_requests_on_db_unavailable: true
router_settings:
  routing_strategy: simple-shuffle
"""
LITELLM_ENV = {
    "LITELLM_TELEMETRY": "False",
    "LITELLM_LOG": "ERROR",
    "LITELLM_MODE": "PRODUCTION",
    "DISABLE_ADMIN_UI": "True",
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # do not fetch the cost map from the internet
    "NO_DOCS": "True",
    "NO_REDOC": "True",
}


# ----------------------------------------------------------------------------- peers


# ----------------------------------------------------------------------------- systems


@dataclass
class System:
    name: str
    url: str | None  # None: direct
    proc: Proc | None
    notes: str = ""


def start_sims(args: argparse.Namespace) -> list[Proc]:
    sims = []
    for i in range(args.replicas):
        port = free_port()
        argv = sim_argv(
            port, MODEL, "--seed", str(i),
            "--step-base-ms", str(args.step_base_ms),
            "--step-per-seq-ms", str(args.step_per_seq_ms),
            "--step-per-prefill-token-ms", str(args.step_per_prefill_token_ms),
            "--max-num-seqs", str(max(256, max(args.concurrency))),
            "--kv-blocks", "65536",
        )  # fmt: skip
        p = Proc(f"sim{i}", argv, LOGS / f"sim{i}.log", env=seawall_env(), cwd=REPO, port=port)
        sims.append(p)
    for p in sims:
        wait_http(f"http://127.0.0.1:{p.port}/health", 60, p)
    return sims


def start_system(name: str, upstreams: list[str], args: argparse.Namespace) -> System:
    if name == "direct":
        return System(name, None, None, "client round-robins over the replicas")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = LOGS / f"{name.replace('@', '-')}.log"
    if name.startswith("seawall@"):
        # An earlier Seawall, with its own defaults, in front of the same replicas.
        src = baseline_src(name.removeprefix("seawall@"))
        argv = [sys.executable, "-m", "seawall", "serve", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--no-access-log", "--log-level", "WARNING"]
        for u in upstreams:
            argv += ["--replica", u]
        env = seawall_env({"PYTHONPATH": str(src)})
        proc = Proc(name, argv, log, env=env, cwd=src.parent)
        wait_http(url + "/readyz", 60, proc)
        return System(name, url, proc, f"defaults at {name.removeprefix('seawall@')}")
    if name in ("seawall", "seawall-noadm"):
        argv = [sys.executable, "-m", "seawall", "serve", "--host", "127.0.0.1"]
        argv += ["--port", str(port), "--no-access-log", "--log-level", "WARNING"]
        notes = "defaults, no access log"
        config = args.seawall_config
        if name == "seawall-noadm":
            config = LOGS / "seawall-noadm.yaml"
            config.write_text(NOADM_CONFIG)
            notes = "admission.enabled=false, no access log"
        if config:
            argv += ["--config", str(config)]
            notes += f", --config {config}"
        for u in upstreams:
            argv += ["--replica", u]
        proc = Proc(name, argv, log, env=seawall_env(), cwd=REPO)
        wait_http(url + "/readyz", 60, proc)
        return System(name, url, proc, notes)
    if name == "vllm-router":
        proc, version = start_vllm_router(upstreams, port, log, args.router_policy)
        return System(name, url, proc, f"{version}, policy {args.router_policy}, log level warning")
    if name == "litellm":
        exe = peer_venv("litellm", "litellm[proxy]", "litellm")
        deployments = "".join(
            f"  - model_name: {MODEL}\n"
            f"    litellm_params:\n"
            f"      model: hosted_vllm/{MODEL}\n"
            f"      api_base: {u}/v1\n"
            f"      api_key: none\n"
            for u in upstreams
        )
        cfg = LOGS / "litellm.yaml"
        cfg.write_text(LITELLM_CONFIG.format(deployments=deployments))
        argv = [str(exe), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port)]
        argv += ["--num_workers", "1"]
        env = {k: v for k, v in seawall_env(LITELLM_ENV).items() if k != "DATABASE_URL"}
        env.pop("PYTHONPATH", None)
        proc = Proc(name, argv, log, env=env, cwd=PEERS)
        wait_http(url + "/health/liveliness", 180, proc)
        version = peer_version("litellm", "litellm")
        return System(
            name, url, proc, f"{version}, hosted_vllm, simple-shuffle, no DB/telemetry/logs"
        )
    raise ValueError(name)


# ----------------------------------------------------------------------------- measuring


def _cpu_busy() -> tuple[int, int]:
    """(busy, total) jiffies over all cores, from /proc/stat."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = f[3] + f[4]
    return sum(f) - idle, sum(f)


@dataclass
class Row:
    system: str
    concurrency: int
    ok: int = 0
    failed: int = 0
    ttft: list[float] = field(default_factory=list)
    elapsed_s: float = math.nan
    tokens: int = 0
    proxy_cpu_s: float = math.nan
    sim_cpu_s: float = math.nan
    client_cpu_s: float = math.nan
    proxy_rss_mib: float = math.nan  # the proxy's peak RSS so far (VmHWM, process tree)
    gc_runs: float = math.nan  # the proxy's cycle-collector runs (Seawall: its /metrics)
    gc_objects: float = math.nan  # and the objects those runs found in cycles
    machine_busy: float = math.nan
    errors: dict[str, int] = field(default_factory=dict)

    def p(self, q: float) -> float:
        return percentile(self.ttft, q) * 1000.0

    @property
    def cpu_per_1k(self) -> float:
        return self.proxy_cpu_s / self.ok * 1000.0 if self.ok else math.nan


def gc_counts(system: System) -> tuple[float, float]:
    """A Seawall's cycle-collector runs and the objects they collected so far, all
    generations (prometheus_client's `python_gc_*` on its /metrics); NaN for the others.
    Each run stops the event loop, every stream with it."""
    if system.url is None or not system.name.startswith("seawall"):
        return math.nan, math.nan
    with urllib.request.urlopen(system.url + "/metrics", timeout=10) as r:
        got = parse_samples(r.read().decode(), frozenset({GC_RUNS, GC_FOUND}))
    return sum(got.get(GC_RUNS, [math.nan])), sum(got.get(GC_FOUND, [math.nan]))


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def measure(
    system: System,
    sims: list[Proc],
    urls: list[str],
    conc: int,
    args: argparse.Namespace,
    warm_up: bool,
) -> Row:
    target = [system.url] if system.url else urls
    if warm_up:
        warm = max(conc, min(args.requests // 5, 2 * conc))
        run_driver(target, MODEL, args.route, conc, warm, args.max_tokens, 60.0, 30.0)
    time.sleep(0.5)
    pid = system.proc.pid if system.proc else None
    proxy0 = cpu_seconds(pid) if pid else 0.0
    sims0 = sum(cpu_seconds(s.pid) for s in sims)
    client0 = _children_cpu()
    busy0 = _cpu_busy()
    gc0 = gc_counts(system)
    out = run_driver(
        target, MODEL, args.route, conc, args.requests, args.max_tokens, args.time_limit
    )
    busy1 = _cpu_busy()
    gc1 = gc_counts(system)
    row = Row(system.name, conc)
    row.gc_runs, row.gc_objects = gc1[0] - gc0[0], gc1[1] - gc0[1]
    row.proxy_cpu_s = cpu_seconds(pid) - proxy0 if pid else math.nan
    row.proxy_rss_mib = peak_rss_mib(pid) if pid else math.nan
    row.sim_cpu_s = sum(cpu_seconds(s.pid) for s in sims) - sims0
    row.client_cpu_s = _children_cpu() - client0
    row.machine_busy = (busy1[0] - busy0[0]) / max(1, busy1[1] - busy0[1])
    row.ok, row.failed, row.errors = out["ok"], out["failed"], out["errors"]
    row.ttft, row.elapsed_s, row.tokens = out["ttft_s"], out["elapsed_s"], out["chunks"]
    return row


def run_rounds(
    systems: list[System],
    sims: list[Proc],
    urls: list[str],
    args: argparse.Namespace,
    runs: list[Row],
) -> None:
    """Interleaved: every round runs each system once per concurrency, starting from a
    different system each round, so a burst of load from elsewhere on a shared machine
    does not land on one system only."""
    for rnd in range(args.rounds):
        for conc in args.concurrency:
            order = systems[rnd % len(systems) :] + systems[: rnd % len(systems)]
            for system in order:
                try:
                    row = measure(system, sims, urls, conc, args, warm_up=rnd == 0)
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as e:
                    print(f"  round {rnd + 1} {system.name} c={conc}: load failed: {e}")
                    continue
                runs.append(row)
                print(
                    f"  round {rnd + 1} {system.name:<12} c={conc:<4} ok={row.ok:<5} "
                    f"failed={row.failed:<4} TTFT p50 {row.p(50):7.2f} ms  "
                    f"CPU-s/1k {row.cpu_per_1k:6.2f}  "
                    f"machine busy {100 * row.machine_busy:3.0f}%",
                    flush=True,
                )


def pool(runs: list[Row]) -> list[Row]:
    """One row per (system, concurrency): TTFTs pooled, counts, CPU and time summed."""
    out: dict[tuple[str, int], Row] = {}
    for r in runs:
        p = out.setdefault((r.system, r.concurrency), Row(r.system, r.concurrency))
        first = math.isnan(p.elapsed_s)
        p.ok += r.ok
        p.failed += r.failed
        p.ttft = p.ttft + r.ttft
        p.tokens += r.tokens
        for name in ("proxy_cpu_s", "sim_cpu_s", "client_cpu_s", "gc_runs", "gc_objects"):
            setattr(p, name, (0.0 if first else getattr(p, name)) + getattr(r, name))
        p.proxy_rss_mib = r.proxy_rss_mib if first else max(p.proxy_rss_mib, r.proxy_rss_mib)
        busy = 0.0 if first else p.machine_busy * p.elapsed_s
        p.elapsed_s = (0.0 if first else p.elapsed_s) + r.elapsed_s
        p.machine_busy = (busy + r.machine_busy * r.elapsed_s) / p.elapsed_s
        for k, v in r.errors.items():
            p.errors[k] = p.errors.get(k, 0) + v
    return list(out.values())


def profile_seawall(name: str, upstreams: list[str], conc: int, args: argparse.Namespace) -> None:
    pyspy = peer_venv("tools", "py-spy", "py-spy")
    system = start_system(name, upstreams, args)
    assert system.proc is not None and system.url is not None
    raw = LOGS / f"{name.replace('@', '-')}-profile.txt"
    try:
        run_driver([system.url], MODEL, args.route, conc, conc, args.max_tokens, 60.0, 30.0)
        spy = subprocess.Popen(
            [
                str(pyspy),
                "record",
                "--pid",
                str(system.proc.pid),
                "--rate",
                "250",
                "--gil",
                "--format",
                "raw",
                "--nolineno",
                "--output",
                str(raw),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        time.sleep(1.0)
        run_driver(
            [system.url], MODEL, args.route, conc, args.requests, args.max_tokens, args.time_limit
        )
        spy.send_signal(signal.SIGINT)
        try:
            _, err = spy.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            spy.kill()
            _, err = spy.communicate()
    finally:
        system.proc.stop()
    if not raw.exists():
        print(f"py-spy wrote no profile: {err.decode(errors='replace')[-500:]}")
        return
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        own[frames[-1]] += n
        for f in set(frames):
            inclusive[f] += n
        total += n
    print(f"\n{name} profile under the same load (py-spy --gil, {total} samples at 250 Hz;")
    print(f"raw stacks in {raw.relative_to(REPO)}). Top 15 by own time:")
    print_table(
        ["function (file)", "own %", "incl %"],
        [[f, 100.0 * n / total, 100.0 * inclusive[f] / total] for f, n in own.most_common(15)],
    )


# ----------------------------------------------------------------------------- report


def report(rows: list[Row], args: argparse.Namespace) -> None:
    direct = {r.concurrency: r for r in rows if r.system == "direct"}
    table = []
    for r in rows:
        d = direct.get(r.concurrency)
        rate = r.tokens / r.elapsed_s if r.elapsed_s else math.nan
        table.append(
            [
                r.system,
                r.concurrency,
                r.ok,
                r.failed,
                r.p(50),
                r.p(99),
                r.p(50) - d.p(50) if d else math.nan,
                r.p(99) - d.p(99) if d else math.nan,
                rate,
                r.cpu_per_1k,
                r.proxy_cpu_s,
                r.sim_cpu_s,
                r.client_cpu_s,
                r.proxy_rss_mib,
                r.gc_runs / r.ok * 1000.0 if r.ok else math.nan,
                r.gc_objects / r.ok * 1000.0 if r.ok else math.nan,
                100.0 * r.machine_busy,
            ]
        )
    print()
    print_table(
        [
            "system", "conc", "ok", "failed", "TTFT p50 ms", "TTFT p99 ms", "added p50 ms",
            "added p99 ms", "tokens/s", "proxy CPU-s/1k req", "proxy CPU-s", "sim CPU-s",
            "client CPU-s", "proxy peak RSS MiB", "GC runs/1k req", "GC objects/1k req",
            "machine busy %",
        ],
        table,
    )  # fmt: skip
    for r in rows:
        if r.errors:
            print(f"  {r.system} c={r.concurrency} errors: {r.errors}")

    ratios = []
    # This Seawall against the peers and against the earlier Seawalls (--baseline).
    for s, r in (
        (s, r)
        for s in rows
        if s.system in ("seawall", "seawall-noadm")
        for r in rows
        if r.concurrency == s.concurrency
        and (r.system in ("vllm-router", "litellm") or r.system.startswith("seawall@"))
    ):
        d = direct.get(r.concurrency)
        if d is None:
            continue
        s50, r50 = s.p(50) - d.p(50), r.p(50) - d.p(50)
        s99, r99 = s.p(99) - d.p(99), r.p(99) - d.p(99)
        ratios.append(
            [
                f"{s.system}/{r.system}",
                r.concurrency,
                s.cpu_per_1k / r.cpu_per_1k if r.cpu_per_1k else math.nan,
                s50 / r50 if r50 > 0.05 else math.nan,
                s99 / r99 if r99 > 0.05 else math.nan,
                s50 - r50,
                s99 - r99,
                (s.tokens / s.elapsed_s) / (r.tokens / r.elapsed_s) if r.tokens else math.nan,
            ]
        )
    if ratios:
        print()
        print_table(
            [
                "ratio", "conc", "CPU/req", "added p50", "added p99",
                "added p50 diff ms", "added p99 diff ms", "tokens/s",
            ],
            ratios,
        )  # fmt: skip

    print()
    for s in rows:
        if not s.system.startswith("seawall"):
            continue
        c = s.concurrency
        d = direct.get(c)
        if d is not None and c == 100:
            added = s.p(50) - d.p(50)
            sat = "saturated" if s.machine_busy > 0.9 else "not saturated"
            verdict = "met" if added < 1.0 else "NOT met"
            print(
                f"goal: {s.system} added p50 TTFT < 1 ms at 100 streams: {verdict} "
                f"({added:.3f} ms; machine {100 * s.machine_busy:.0f}% busy, {sat})"
            )
        router = next((r for r in rows if r.system == "vllm-router" and r.concurrency == c), None)
        if router is not None and router.cpu_per_1k:
            ratio = s.cpu_per_1k / router.cpu_per_1k
            verdict = "met" if ratio <= 1.5 else "NOT met"
            print(
                f"goal: {s.system} CPU per streamed request <= 1.5x vllm-router's (c={c}): "
                f"{verdict} ({ratio:.2f}x)"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", action="store_true", help="also vllm-router and LiteLLM")
    parser.add_argument(
        "--concurrency",
        default="100",
        help="concurrent streams; a comma list runs each (default 100)",
    )
    parser.add_argument("--requests", type=int, default=2000, help="streamed requests per load")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--route", choices=("chat", "completions"), default="chat")
    parser.add_argument("--systems", help="comma list, a subset of " + ",".join(SYSTEMS))
    parser.add_argument("--seawall-config", metavar="FILE", help="seawall serve --config")
    parser.add_argument("--router-policy", default="round_robin", help="vllm-router --policy")
    parser.add_argument("--step-base-ms", type=float, default=10.0)
    parser.add_argument("--step-per-seq-ms", type=float, default=0.01)
    parser.add_argument("--step-per-prefill-token-ms", type=float, default=0.001)
    parser.add_argument(
        "--time-limit", type=float, default=120.0, help="seconds: a load stops opening streams"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="interleaved rounds, pooled (default 1)"
    )
    parser.add_argument(
        "--profile",
        nargs="?",
        const="seawall",
        metavar="SYSTEM",
        help="py-spy one more load through this Seawall variant: seawall (the default), "
        "seawall-noadm or seawall@REV",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the raw rows as JSON")
    parser.add_argument(
        "--baseline",
        metavar="REV",
        action="append",
        default=[],
        help="also Seawall at this git revision (its own source, exported), beside this one",
    )
    args = parser.parse_args()
    args.concurrency = [int(c) for c in str(args.concurrency).split(",") if c]
    if args.profile and not (
        args.profile in ("seawall", "seawall-noadm") or args.profile.startswith("seawall@")
    ):
        parser.error("--profile takes seawall, seawall-noadm or seawall@REV")
    names = [s for s in SYSTEMS if s.startswith(("direct", "seawall")) or args.peers]
    if args.systems:
        wanted = set(args.systems.split(","))
        names = [s for s in names if s in wanted or s == "direct"]
    names[1:1] = [f"seawall@{rev}" for rev in args.baseline]
    if shutil.which("git"):
        rev = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    else:
        rev = "?"

    print(f"machine: {machine_context()}; python {sys.version.split()[0]}; seawall @ {rev}")
    print(
        f"load: {args.requests} streamed {args.route} requests per system and concurrency, "
        f"max_tokens={args.max_tokens} (ignore_eos), {args.replicas} sim replicas with "
        f"step {args.step_base_ms} ms + {args.step_per_seq_ms} ms/seq + "
        f"{args.step_per_prefill_token_ms} ms/prefill token"
    )
    LOGS.mkdir(parents=True, exist_ok=True)
    sims = start_sims(args)
    urls = [f"http://127.0.0.1:{s.port}" for s in sims]
    systems: list[System] = []
    runs: list[Row] = []
    try:
        try:
            for name in names:
                try:
                    systems.append(start_system(name, urls, args))
                except (RuntimeError, subprocess.CalledProcessError) as e:
                    print(f"{name}: could not start: {e}", file=sys.stderr)
            run_rounds(systems, sims, urls, args, runs)
        finally:
            for system in systems:
                if system.proc is not None:
                    system.proc.stop()
        print("\nsystems: " + "; ".join(f"{s.name}: {s.notes}" for s in systems))
        print(f"after the loads: load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        rows = pool(runs)
        if args.rounds > 1:
            print(f"(pooled over {args.rounds} rounds: all TTFT samples, summed CPU and time)")
        report(rows, args)
        if args.json:
            Path(args.json).write_text(json.dumps([r.__dict__ for r in rows]))
        if args.profile:
            profile_seawall(args.profile, urls, max(args.concurrency), args)
    finally:
        for s in sims:
            s.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
