"""Many gateways, one fleet (issue 15): 1 vs 3 instances and 1 process vs 2 workers, side by
side in one run, over the same small-KV sims at 3x capacity; then leader fail-over.

    python bench/bench_cluster.py [--seconds 30] [--factor 3] [--replicas 2]
        [--only overload,failover,throughput] [--store redis|local]

About 4 minutes with the defaults. What it answers:

- overload: does admission before preemption hold when the same load is split over
  several gateways? Each setup gets fresh small-KV sims (`--kv-blocks` 100, prompts of
  a few tokens, `max_tokens` 200 with `ignore_eos`: 13 blocks a request, 7 per replica
  run to the end without preemption) and `--factor` x capacity closed-loop streaming
  clients, spread over the gateways request by request as an L4 balancer spreads
  connections (with workers, over one port: the kernel spreads them). Setups:
  `1 instance` (`seawall serve`, no cluster), `3 instances` (three `seawall serve`
  sharing `--store`: a real redis-server, or the local store server) and `2 workers`
  (`seawall serve --workers 2`). Columns: preemptions over the load (the engines'
  `vllm:num_preemptions_total`), shed (429s and 503s, each waited
  min(Retry-After, `--backoff`) and sent again), streams ok, goodput (content tokens
  per second of the streams that finished), TTFT p50/p99 of the served attempt, deep
  probes and scrapes per replica per second (counted at the sims: deep probes are the
  one-token requests in the sims' own `vllm:request_params_max_tokens` histogram,
  scrapes and liveness probes the `GET /metrics` and `GET /health` request lines a
  counting proxy in front of each sim sees), and the hot-path cost of sharing: the
  gateways' CPU-ms per served stream and per request answered (streams + sheds;
  utime+stime of every gateway process and its workers, over the load) and TTFT
  p50/p99 added over `1 instance`. Probe rates need windows of tens of seconds (a deep
  probe every 5 s per busy replica): short smoke runs only say the columns work.
  Leader-issued KV quotas (`gateway/fleet_admission.py`) are measured as built on the
  branch that runs this: without them, each instance reserves against the whole cache.
- failover: three instances (and 2 workers); SIGKILL the leader and time until another
  instance reports itself leader (polled every 20 ms), against the bound the defaults
  promise (lease_ttl_s + renew_interval_s); with workers the parent also starts a new
  worker in the dead one's place.
- throughput: does one host serve more with two workers? Large-KV sims with low step
  costs, `--throughput-concurrency` (200) streams, 1 process vs 2 workers: streams per
  second, tokens per second and CPU-ms per stream. On 2 cores the sims and the client
  share the machine with the gateway, so scaling is bounded by what is left.

Every load is bounded (count and time) and talks only to 127.0.0.1. The machine may be
shared (the header prints cores and load average): the lead's figures come from a quiet
machine. Logs: `bench/results/cluster-logs/`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    Proc,
    cpu_seconds,
    free_port,
    machine_context,
    percentile,
    print_table,
    seawall_env,
    sim_argv,
    wait_http,
)

MODEL = "sim-model"
LOGS = REPO / "bench" / "results" / "cluster-logs"
ADMIN_TOKEN = "sk-sw-admin-bench-cluster-00000000000000000000000"
PROMPT = "Benchmark prompt."
_LISTENING = re.compile(r"seawall gateway listening on http://127\.0\.0\.1:(\d+)")
_ADMIN = re.compile(r"seawall admin API listening on http://127\.0\.0\.1:(\d+)")
_WORKER = re.compile(r"worker (\d+) \((\S+), pid (\d+)\) listening")


# ----------------------------------------------------------------------------- counting


class CountingProxy:
    """A TCP proxy in front of one sim, counting the request lines that pass (a thread
    with its own event loop; the load driver runs in another process)."""

    _LINE = re.compile(rb"(GET|POST) (/[^ ?]*)[^ ]* HTTP/1\.[01]\r\n")

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self.counts: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._ready = threading.Event()

    def snapshot(self) -> Counter[tuple[str, str]]:
        with self._lock:
            return Counter(self.counts)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, count: bool) -> None:
        tail = b""
        try:
            while data := await r.read(65536):
                if count:
                    window = tail + data
                    found = self._LINE.findall(window)
                    if found:
                        with self._lock:
                            for method, path in found:
                                self.counts[(method.decode(), path.decode())] += 1
                    cut = window.rfind(b"\r\n")
                    tail = window[cut + 2 :][-256:] if cut >= 0 else window[-256:]
                w.write(data)
                await w.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            w.close()

    async def _serve(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            w.close()
            return
        await asyncio.gather(self._pipe(r, uw, True), self._pipe(ur, w, False))

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start() -> asyncio.AbstractServer:
            server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
            self.port = server.sockets[0].getsockname()[1]
            return server

        server = self._loop.run_until_complete(start())
        self._ready.set()
        self._loop.run_forever()
        server.close()

    def start(self) -> CountingProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


# ----------------------------------------------------------------------------- metrics


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value, from a sim's /metrics (read straight from the sim)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + json.dumps(dict(sorted(s.labels.items())))
            out[key] = float(s.value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in samples.items():
        if not key.startswith(name + "{"):
            continue
        have = json.loads(key[len(name) :])
        if all(have.get(k) == v for k, v in labels.items()):
            total += value
    return total


@dataclass
class SimFigures:
    preemptions: float = 0.0
    deep_probes: float = 0.0  # one-token requests (the fleet monitor's deep probes)
    peak_kv: float = 0.0


def sim_counters(urls: Sequence[str]) -> SimFigures:
    out = SimFigures()
    for u in urls:
        m = scrape(u)
        out.preemptions += metric(m, "vllm:num_preemptions_total")
        out.deep_probes += metric(m, "vllm:request_params_max_tokens_bucket", le="1.0")
    return out


class KvSampler:
    """The highest KV usage any sim showed, sampled every 0.5 s (a thread)."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = list(urls)
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for u in self.urls:
                try:
                    self.peak = max(self.peak, metric(scrape(u), "vllm:kv_cache_usage_perc"))
                except OSError:
                    pass

    def __enter__(self) -> KvSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# ----------------------------------------------------------------------------- processes


def wait_log(proc: Proc, pattern: re.Pattern[str], timeout: float) -> re.Match[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern.search(proc.log_path.read_text(errors="replace"))
        if found:
            return found
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail(30)}")
        time.sleep(0.05)
    raise RuntimeError(f"{proc.name}: no {pattern.pattern!r} after {timeout:g}s\n{proc.tail()}")


@dataclass
class Sims:
    procs: list[Proc]
    proxies: list[CountingProxy]

    @property
    def direct(self) -> list[str]:
        return [f"http://127.0.0.1:{p.port}" for p in self.procs]

    @property
    def proxied(self) -> list[str]:
        return [f"http://127.0.0.1:{p.port}" for p in self.proxies]

    def requests(self) -> Counter[tuple[str, str]]:
        total: Counter[tuple[str, str]] = Counter()
        for p in self.proxies:
            total += p.snapshot()
        return total

    def stop(self) -> None:
        for p in self.proxies:
            p.stop()
        for s in self.procs:
            s.stop()


def start_sims(name: str, args: argparse.Namespace, *extra: str) -> Sims:
    procs = []
    for i in range(args.replicas):
        port = free_port()
        argv = sim_argv(port, MODEL, *extra)
        procs.append(
            Proc(f"{name}-sim{i}", argv, LOGS / f"{name}-sim{i}.log", env=seawall_env(), port=port)
        )
    try:
        for p in procs:
            wait_http(f"http://127.0.0.1:{p.port}/health", 60, p)
    except BaseException:
        for p in procs:
            p.stop()
        raise
    return Sims(procs, [CountingProxy(p.port or 0).start() for p in procs])


def small_kv(args: argparse.Namespace) -> tuple[str, ...]:
    return ("--kv-blocks", str(args.kv_blocks), "--max-model-len", str(args.max_tokens + 64))


def gateway_config(sims: Sims, cluster: dict[str, Any] | None = None) -> dict[str, Any]:
    from seawall.auth import hash_key

    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "replicas": [
            {"url": u, "model": MODEL, "id": f"r{i}", "node": f"node-{i}"}
            for i, u in enumerate(sims.proxied)
        ],
        "admin": {"enabled": True, "port": 0, "token_hash": hash_key(ADMIN_TOKEN)},
        "fleet": {"ledger_path": ":memory:"},
        "tiers": {"default": {"priority": 1}},  # above lowest_priority_to_queue: shed, not queue
    }
    if cluster is not None:
        config["cluster"] = cluster
    return config


@dataclass
class Gateway:
    proc: Proc
    url: str
    admin: str

    def cluster(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.url + "/readyz", timeout=2) as r:
            out: dict[str, Any] = json.loads(r.read())["cluster"]
        return out


def start_gateway(name: str, config: dict[str, Any], *args: str) -> Gateway:
    path = LOGS / f"{name}.yaml"
    path.write_text(json.dumps(config, indent=2) + "\n")  # JSON is YAML
    argv = [sys.executable, "-m", "seawall", "serve", "--config", str(path)]
    argv += ["--no-access-log", "--log-level", "WARNING", *args]
    proc = Proc(name, argv, LOGS / f"{name}.log", env=seawall_env(), cwd=REPO)
    try:
        port = int(wait_log(proc, _LISTENING, 90).group(1))
        admin = int(wait_log(proc, _ADMIN, 10).group(1))
        gw = Gateway(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}")
        wait_http(gw.url + "/readyz?fleet=1", 60, proc)
    except BaseException:
        proc.stop()  # a gateway that did not come up is not left behind
        raise
    return gw


def admin_state(admin: str) -> dict[str, Any]:
    req = urllib.request.Request(
        admin + "/admin/state", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    )
    with urllib.request.urlopen(req, timeout=2) as r:
        out: dict[str, Any] = json.loads(r.read())
    return out


class Store:
    """What several instances share: a real redis-server, or the local store server
    (`none`: nothing)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.proc: Proc | None = None
        self._dir: str | None = None
        self.cluster: dict[str, Any] = {}

    def __enter__(self) -> Store:
        if self.kind == "none":
            return self
        if self.kind == "redis":
            binary = shutil.which("redis-server") or "/usr/bin/redis-server"
            port = free_port()
            argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
            argv += ["--appendonly", "no"]
            self.proc = Proc("redis", argv, LOGS / "redis.log", port=port)
            deadline = time.monotonic() + 20
            import socket

            while time.monotonic() < deadline:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                    break
                except OSError:
                    time.sleep(0.05)
            self.cluster = {"store": "redis", "redis_url": f"redis://127.0.0.1:{port}/0"}
        else:
            self._dir = tempfile.mkdtemp(prefix="bench-cluster-")
            path = f"{self._dir}/cluster.sock"
            argv = [sys.executable, "-m", "seawall.cluster.local", "--socket", path]
            self.proc = Proc("store", argv, LOGS / "store.log", env=seawall_env())
            wait_log(self.proc, re.compile("listening on unix:"), 30)
            self.cluster = {"store": "local", "local_socket": path}
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.stop()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


@dataclass
class Setup:
    """One way of running the gateway(s): their client URLs and every process to charge."""

    name: str
    urls: list[str]
    pids: list[int]
    gateways: list[Gateway] = field(default_factory=list)

    def cpu_s(self) -> float:
        return sum(cpu_seconds(pid, tree=True) for pid in self.pids)


@contextmanager
def setup(kind: str, sims: Sims, store_kind: str, log_level: str = "WARNING") -> Iterator[Setup]:
    started: list[Gateway] = []
    # A fresh store for every fleet of instances: a fleet view left by an earlier setup
    # (other sims at other addresses) is not this one's.
    store = Store(store_kind if kind == "3 instances" else "none")
    try:
        store.__enter__()
        if kind == "1 instance":
            started.append(start_gateway("single", gateway_config(sims)))
        elif kind == "3 instances":
            for i in range(3):
                cluster = {**store.cluster, "instance_id": f"gw-{i}"}
                started.append(start_gateway(f"gw-{i}", gateway_config(sims, cluster)))
        elif kind == "2 workers":
            started.append(
                start_gateway(
                    "workers", gateway_config(sims), "--workers", "2", "--log-level", log_level
                )
            )
        else:
            raise ValueError(kind)
        yield Setup(kind, [g.url for g in started], [g.proc.pid for g in started], started)
    finally:
        for g in started:
            g.proc.stop(timeout=40)
        store.__exit__()


# ----------------------------------------------------------------------------- the load


async def _drive(
    urls: Sequence[str],
    clients: int,
    seconds: float,
    max_tokens: int,
    backoff_s: float,
    grace_s: float,
) -> dict[str, Any]:
    import aiohttp

    body = json.dumps(
        {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
    ).encode()
    headers = {"Content-Type": "application/json"}
    out: dict[str, Any] = {"ok": 0, "shed": 0, "failed": 0, "cut": 0, "tokens": 0, "ttft": []}
    errors: Counter[str] = Counter()
    started = time.monotonic()
    deadline = started + seconds
    turn = 0
    max_requests = 200_000  # a count bound on top of the time bound

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal turn
        url = urls[turn % len(urls)]  # request by request, as connections are spread
        turn += 1
        sent = time.perf_counter()
        ttft: float | None = None
        tokens = 0
        async with session.post(url + "/v1/completions", data=body, headers=headers) as r:
            if r.status in (429, 503):
                await r.read()
                out["shed"] += 1
                retry_after = float(r.headers.get("Retry-After", backoff_s))
                await asyncio.sleep(min(retry_after, backoff_s))
                return
            if r.status != 200:
                errors[f"http {r.status}"] += 1
                out["failed"] += 1
                await r.read()
                return
            done = False
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: {") and b'"text":"' in line:
                    if b'"text":""' not in line:
                        tokens += 1
                        if ttft is None:
                            ttft = time.perf_counter() - sent
                    if b'"error"' in line:
                        errors["stream error"] += 1
        if done and ttft is not None:
            out["ok"] += 1
            out["tokens"] += tokens
            out["ttft"].append(ttft)
        else:
            out["failed"] += 1
            errors["no [DONE]"] += 1

    async def client(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline and turn < max_requests:
            try:
                await one(session)
            except (aiohttp.ClientError, ConnectionError, TimeoutError) as e:
                out["failed"] += 1
                errors[type(e).__name__] += 1

    timeout = aiohttp.ClientTimeout(total=seconds + grace_s + 60)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        tasks = [asyncio.create_task(client(session)) for _ in range(clients)]
        _, late = await asyncio.wait(tasks, timeout=seconds + grace_s)
        for t in late:  # still streaming past the grace: cut, counted
            t.cancel()
        out["cut"] = len(late)
        await asyncio.gather(*tasks, return_exceptions=True)
    out["elapsed_s"] = time.monotonic() - started
    out["errors"] = dict(errors)
    return out


def run_load(urls: Sequence[str], clients: int, seconds: float, args: argparse.Namespace) -> Any:
    """The load in a separate Python process (its CPU and GIL are not the gateway's or
    the counting proxies')."""
    import subprocess

    fd, out_path = tempfile.mkstemp(prefix="bench-cluster-", suffix=".json")
    os.close(fd)
    argv = [sys.executable, __file__, "drive", "--out", out_path, "--clients", str(clients)]
    argv += ["--seconds", str(seconds), "--max-tokens", str(args.max_tokens)]
    argv += ["--backoff", str(args.backoff), "--grace", str(args.grace)]
    for u in urls:
        argv += ["--url", u]
    try:
        subprocess.run(argv, check=True, timeout=seconds + args.grace + 120, env=seawall_env())
        return json.loads(Path(out_path).read_text())
    finally:
        Path(out_path).unlink(missing_ok=True)


# ----------------------------------------------------------------------------- overload


def overload(args: argparse.Namespace, store: str) -> list[dict[str, Any]]:
    bs = 16
    blocks = -(-(4 + args.max_tokens) // bs)  # the prompt is a few tokens
    capacity = (args.kv_blocks - 1) // blocks
    clients = args.factor * capacity * args.replicas
    print(
        f"\noverload: {args.replicas} sims x {args.kv_blocks - 1} usable KV blocks, "
        f"{blocks} blocks a request -> capacity {capacity} per replica; {clients} clients "
        f"({args.factor}x), {args.seconds:g} s each"
    )
    rows = []
    for kind in args.setups:
        sims = start_sims(kind.replace(" ", "-"), args, *small_kv(args))
        try:
            with setup(kind, sims, store) as s:
                run_load(s.urls, max(2, clients // 4), 2.0, args)  # warm-up
                time.sleep(1.0)  # the sims drain the warm-up (a settle, not a condition)
                before, req0, cpu0 = sim_counters(sims.direct), sims.requests(), s.cpu_s()
                with KvSampler(sims.direct) as kv:
                    load = run_load(s.urls, clients, args.seconds, args)
                cpu = s.cpu_s() - cpu0
                after, req = sim_counters(sims.direct), sims.requests() - req0
        finally:
            sims.stop()
        window = load["elapsed_s"]
        per = window * args.replicas
        ttft = load["ttft"]
        rows.append(
            {
                "setup": kind,
                "preemptions": after.preemptions - before.preemptions,
                "peak_kv": kv.peak,
                "shed": load["shed"],
                "ok": load["ok"],
                "failed": load["failed"] + load["cut"],
                "goodput": load["tokens"] / window,
                "ttft_p50": percentile(ttft, 50),
                "ttft_p99": percentile(ttft, 99),
                "deep_per_s": (after.deep_probes - before.deep_probes) / per,
                "scrapes_per_s": req[("GET", "/metrics")] / per,
                "liveness_per_s": req[("GET", "/health")] / per,
                "cpu_ms_per_ok": 1000 * cpu / max(1, load["ok"]),
                "cpu_ms_per_request": 1000 * cpu / max(1, load["ok"] + load["shed"]),
                "errors": load["errors"],
            }
        )
    base = next((r for r in rows if r["setup"] == "1 instance"), None)
    print_table(
        ["setup", "preempt", "peak KV", "shed", "ok", "failed", "goodput tok/s", "TTFT p50",
         "TTFT p99", "deep/s/rep", "scrape/s/rep", "health/s/rep", "CPU-ms/stream",
         "CPU-ms/req", "+TTFT p50", "+TTFT p99"],
        [
            [r["setup"], int(r["preemptions"]), f"{r['peak_kv']:.0%}", r["shed"], r["ok"],
             r["failed"], r["goodput"], r["ttft_p50"], r["ttft_p99"], r["deep_per_s"],
             r["scrapes_per_s"], r["liveness_per_s"], r["cpu_ms_per_ok"],
             r["cpu_ms_per_request"], r["ttft_p50"] - base["ttft_p50"] if base else math.nan,
             r["ttft_p99"] - base["ttft_p99"] if base else math.nan]
            for r in rows
        ],
    )  # fmt: skip
    if base:
        for r in rows:
            if r is not base:
                ratio = r["cpu_ms_per_ok"] / base["cpu_ms_per_ok"] if base["cpu_ms_per_ok"] else 0
                print(
                    f"  {r['setup']} vs 1 instance: CPU per stream x{ratio:.2f}, "
                    f"deep probes per replica x{_ratio(r['deep_per_s'], base['deep_per_s'])}, "
                    f"scrapes x{_ratio(r['scrapes_per_s'], base['scrapes_per_s'])}, "
                    f"preemptions {int(r['preemptions'])} vs {int(base['preemptions'])}"
                )
    for r in rows:
        if r["errors"]:
            print(f"  {r['setup']} errors: {r['errors']}")
    return rows


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b else "-"


# ----------------------------------------------------------------------------- fail-over


def _leader_elsewhere(gateways: Sequence[Gateway], old: str) -> str | None:
    for g in gateways:
        try:
            c = g.cluster()
        except OSError:
            continue
        if c["role"] == "leader" and c["instance"] != old:
            return str(c["instance"])
    return None


def failover(args: argparse.Namespace, store: str) -> list[dict[str, Any]]:
    from seawall.config import ClusterConfig
    from seawall.policy.leadership import failover_bound_s

    cc = ClusterConfig()
    bound = failover_bound_s(cc.lease_ttl_s, cc.renew_interval_s)
    rows = []
    sims = start_sims("failover", args)
    try:
        for kind in ("3 instances", "2 workers"):
            if kind not in args.setups:
                continue
            for run in range(args.failover_runs):
                # INFO: the parent logs each worker's PID as it starts.
                with setup(kind, sims, store, log_level="INFO") as s:
                    took = _kill_leader(s, kind)
                rows.append({"setup": kind, "run": run, "took_s": took})
    finally:
        sims.stop()
    print(f"\nfail-over: SIGKILL the leader, until another instance reports leading "
          f"(promised bound {bound:g} s)")  # fmt: skip
    table = []
    for kind in ("3 instances", "2 workers"):
        times = [r["took_s"] for r in rows if r["setup"] == kind]
        if times:
            table.append([kind, len(times), percentile(times, 50), max(times), bound])
    print_table(["setup", "runs", "median s", "max s", "bound s"], table)
    return rows


def _kill_leader(s: Setup, kind: str) -> float:
    deadline = time.monotonic() + 30
    if kind == "3 instances":
        while time.monotonic() < deadline:
            leaders = [g for g in s.gateways if g.cluster()["role"] == "leader"]
            if len(leaders) == 1 and all(g.cluster()["instances"] == 3 for g in s.gateways):
                break
            time.sleep(0.05)
        [leader] = [g for g in s.gateways if g.cluster()["role"] == "leader"]
        old = leader.cluster()["instance"]
        os.kill(leader.proc.pid, signal.SIGKILL)
        killed = time.monotonic()
        survivors = [g for g in s.gateways if g is not leader]
        while time.monotonic() < killed + 30:
            if _leader_elsewhere(survivors, old):
                return time.monotonic() - killed
            time.sleep(0.02)
        return math.nan
    # Workers: the parent's one admin API shows the leader's state; the kill is of its PID.
    [parent] = s.gateways
    while time.monotonic() < deadline:
        state = admin_state(parent.admin)["cluster"]
        if state["role"] == "leader" and state["instances"] == 2:
            break
        time.sleep(0.05)
    old = state["instance"]
    pids = {m.group(2): int(m.group(3)) for m in _WORKER.finditer(parent.proc.log_path.read_text())}
    os.kill(pids[old], signal.SIGKILL)
    killed = time.monotonic()
    while time.monotonic() < killed + 30:
        try:
            c = admin_state(parent.admin)["cluster"]
        except OSError:
            c = {}
        if c.get("leader") not in (None, old) and c.get("role") == "leader":
            return time.monotonic() - killed
        time.sleep(0.02)
    return math.nan


# ----------------------------------------------------------------------------- throughput


def throughput(args: argparse.Namespace, store: str) -> list[dict[str, Any]]:
    fast = ("--step-base-ms", "2", "--step-per-seq-ms", "0.005", "--step-per-prefill-token-ms",
            "0.001")  # fmt: skip
    rows = []
    for kind in ("1 instance", "2 workers"):
        sims = start_sims(f"tp-{kind.replace(' ', '-')}", args, *fast)
        try:
            with setup(kind, sims, store) as s:
                run_load(s.urls, 20, 2.0, args)
                cpu0 = s.cpu_s()
                load = run_load(s.urls, args.throughput_concurrency, args.seconds, args)
                cpu = s.cpu_s() - cpu0
        finally:
            sims.stop()
        window = load["elapsed_s"]
        rows.append(
            {
                "setup": kind,
                "ok": load["ok"],
                "failed": load["failed"] + load["cut"] + load["shed"],
                "streams_per_s": load["ok"] / window,
                "tokens_per_s": load["tokens"] / window,
                "cpu_ms_per_ok": 1000 * cpu / max(1, load["ok"]),
                "gateway_cores": cpu / window,
                "ttft_p99": percentile(load["ttft"], 99),
            }
        )
    print(f"\nthroughput: {args.throughput_concurrency} streams, fast large-KV sims")
    print_table(
        ["setup", "ok", "failed", "streams/s", "tokens/s", "CPU-ms/stream", "gateway cores",
         "TTFT p99"],
        [[r["setup"], r["ok"], r["failed"], r["streams_per_s"], r["tokens_per_s"],
          r["cpu_ms_per_ok"], r["gateway_cores"], r["ttft_p99"]] for r in rows],
    )  # fmt: skip
    if len(rows) == 2 and rows[0]["tokens_per_s"]:
        print(
            f"  2 workers vs 1: tokens/s x{rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.2f}, "
            f"CPU per stream x{_ratio(rows[1]['cpu_ms_per_ok'], rows[0]['cpu_ms_per_ok'])}"
        )
    return rows


# ----------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    d = sub.add_parser("drive", help="(internal) one bounded load; JSON to --out")
    d.add_argument("--url", action="append", required=True)
    d.add_argument("--clients", type=int, required=True)
    d.add_argument("--seconds", type=float, required=True)
    d.add_argument("--max-tokens", type=int, default=200)
    d.add_argument("--backoff", type=float, default=0.2)
    d.add_argument("--grace", type=float, default=30.0)
    d.add_argument("--out", required=True)
    parser.add_argument("--seconds", type=float, default=30.0, help="each load's length")
    parser.add_argument("--factor", type=int, default=3, help="clients = factor x capacity")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--backoff", type=float, default=0.2, help="most a client waits on a 429")
    parser.add_argument("--grace", type=float, default=30.0, help="after the load, then cut")
    parser.add_argument("--store", choices=("redis", "local"), default=None)
    parser.add_argument("--setups", default="1 instance,3 instances,2 workers")
    parser.add_argument("--only", default="overload,failover,throughput")
    parser.add_argument("--failover-runs", type=int, default=3)
    parser.add_argument("--throughput-concurrency", type=int, default=200)
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args(argv)
    if args.cmd == "drive":
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        result = asyncio.run(
            _drive(args.url, args.clients, args.seconds, args.max_tokens, args.backoff, args.grace)
        )
        Path(args.out).write_text(json.dumps(result))
        return 0
    args.setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    store_kind = args.store or ("redis" if shutil.which("redis-server") else "local")
    LOGS.mkdir(parents=True, exist_ok=True)
    print(f"bench_cluster: {machine_context()}; shared store for 3 instances: {store_kind}")
    results: dict[str, Any] = {}
    only = set(args.only.split(","))
    if "overload" in only:
        results["overload"] = overload(args, store_kind)
    if "failover" in only:
        results["failover"] = failover(args, store_kind)
    if "throughput" in only:
        results["throughput"] = throughput(args, store_kind)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
