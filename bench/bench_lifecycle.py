"""Lifecycle under load: a rolling restart of every replica, and a replica crashed
mid-stream, as a streaming client sees them.

    .venv/bin/python bench/bench_lifecycle.py [--replicas 3] [--concurrency 12]

Each scenario starts its own `seawall up` (`--replicas` `seawall sim` replicas with
`--enable-faults` under the local supervisor, the gateway in-process, the admin API on)
and drives a steady streaming load through the gateway from a client in a thread with
its own event loop (aiohttp; `--concurrency` workers, completions with `ignore_eos`, so a
whole answer has exactly `max_tokens` tokens). Every load is bounded in requests and
seconds, and every request to 60 s. The client sorts each request as
  ok         [DONE], no error event, all the tokens
  truncated  [DONE], no error event, but finish_reason "abort" or fewer tokens: a cut
             answer that looks finished (what a vLLM-style SIGTERM abort produces), which
             `seawall.loadgen` counts as ok and the gateway does not count at all
  dropped    the first token came, then an error event or no [DONE]
  failed     a non-200 answer, or an error before the first token

1. Rolling restart, side by side:
   surge-first  `POST /admin/rollout`: start the new replica next to the old one, warm
                it, route to it, drain the old one, stop it (Seawall's rollout);
   naive        SIGTERM each replica's process in turn (the sim's default SIGTERM aborts
                in-flight requests, as vLLM's does), let the supervisor restart it, wait
                until it is routable again, then the next.
   After a `--baseline-s` window of load, the restart runs under the same load. Printed:
   streams dropped, truncated and failed as the client saw them (over the whole load run)
   and as the gateway counted them over the restart (the rollout's own report for
   surge-first; the same counters read from /metrics for naive), client TTFT p50/p99 of
   requests started before vs during the restart, the restart's duration, and ready
   replicas before / at the minimum during (polled from /admin/state every 0.1 s, plus
   the rollout report's own figure).

2. Crash mid-stream, migration off vs on: long streams (`--crash-max-tokens`), then
   `POST /sim/fault {"kind":"crash"}` on the replica with the most streams in flight
   (read from /admin/state just before). Printed: the crashed replica's in-flight
   streams, the client streams in flight at the crash and how they ended, the fraction
   of the crashed replica's streams that completed (its in-flight count minus the client
   streams in flight at the crash that were dropped or truncated), and the gateway's
   migrations.

The machine may be shared: latencies include the wait for a core. Logs of every run go
to bench/results/lifecycle-logs/.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import shutil
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    Proc,
    descendants,
    free_port,
    machine_context,
    percentile,
    print_table,
    sim_argv,
    wait_http,
)
from seawall.auth import hash_key

MODEL = "sim-model"
TOKEN = "sk-sw-admin-bench-lifecycle-000000000000000000000"
OUTCOMES = ("ok", "truncated", "dropped", "failed")
LOG_ROOT = REPO / "bench" / "results" / "lifecycle-logs"


# ----------------------------------------------------------------------------- HTTP


def _http(
    method: str, url: str, body: Any = None, auth: bool = False, timeout: float = 10.0
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = f"Bearer {TOKEN}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _wait(cond: Any, timeout: float, what: str, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(every)
    raise RuntimeError(f"timed out after {timeout:g}s waiting for {what}")


# ----------------------------------------------------------------------------- the fleet


def sim_command(step_ms: float) -> list[str]:
    return sim_argv("{port}", "{model}", "--enable-faults", "--step-base-ms", f"{step_ms:g}")


class Fleet:
    """One `seawall up` run with the admin API; `close()` stops it (SIGTERM to its group:
    the gateway drains and the supervisor stops every replica)."""

    def __init__(
        self, name: str, replicas: int, step_ms: float, migrate: bool, seconds: float
    ) -> None:
        self.replicas = replicas
        log_dir = LOG_ROOT / name
        shutil.rmtree(log_dir, ignore_errors=True)  # a reused dir keeps its restart ledger
        log_dir.mkdir(parents=True)
        api_port, admin_port = free_port(), free_port()
        cfg: dict[str, Any] = {
            "fleet": {
                "replicas": replicas,
                "model": MODEL,
                "command": sim_command(step_ms),
                "stop_grace_s": 5,
            },
            "gateway": {
                "admin": {"enabled": True, "port": admin_port, "token_hash": hash_key(TOKEN)},
                "fleet": {
                    "liveness_interval_s": 0.25,
                    "scrape_interval_s": 0.25,
                    "deep_probe_interval_s": 1.0,
                    "deep_probe_idle_interval_s": 1.0,
                    # All replicas share one node here, and the default (3 restarts in
                    # an hour) cordons it at the naive run's third restart, which takes
                    # every replica out of routing: a different failure than measured.
                    "restart_limit": 100,
                },
                "drain": {"timeout_s": 20},
            },
        }
        if migrate:
            cfg["gateway"]["tiers"] = {"default": {"migrate": True}}
        path = log_dir / "up.yaml"
        path.write_text(yaml.safe_dump(cfg))
        argv = [
            sys.executable, "-m", "seawall", "up", "--config", str(path),
            "--gateway-port", str(api_port), "--plain", "--seconds", f"{seconds:g}",
            "--log-dir", str(log_dir / "up"),
        ]  # fmt: skip
        self.api = f"http://127.0.0.1:{api_port}"
        self.admin = f"http://127.0.0.1:{admin_port}"
        self.proc = Proc(name, argv, log_dir / "up.log", cwd=REPO, port=api_port)
        try:
            wait_http(self.api + "/readyz", timeout=60, proc=self.proc)
            _wait(lambda: len(self.ready()) == replicas, 30, f"{replicas} routable replicas")
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.proc.stop(timeout=20)

    def state(self) -> dict[str, Any]:
        status, body = _http("GET", self.admin + "/admin/state", auth=True)
        if status != 200:
            raise RuntimeError(f"/admin/state: HTTP {status}")
        out: dict[str, Any] = json.loads(body)
        return out

    def ready(self, state: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Replicas that take new requests: routable and not draining."""
        st = state if state is not None else self.state()
        return [r for r in st["replicas"] if r["routable"] and not r.get("draining")]

    def metrics(self) -> dict[str, float]:
        """The gateway counters this benchmark reads, summed over their labels."""
        status, body = _http("GET", self.api + "/metrics")
        if status != 200:
            raise RuntimeError(f"/metrics: HTTP {status}")
        out = {
            "failed": 0.0,
            "dropped": 0.0,
            "ttft_count": 0.0,
            "ttft_sum": 0.0,
            "migrations_ok": 0.0,
            "migrations_failed": 0.0,
            "migrations_refused": 0.0,
        }
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                if s.name == "seawall_requests_total":
                    code = s.labels.get("status", "")
                    if code.startswith("5") or code == "429":
                        out["failed"] += s.value
                elif s.name == "seawall_stream_errors_total":
                    out["dropped"] += s.value
                elif s.name == "seawall_ttft_seconds_count":
                    out["ttft_count"] += s.value
                elif s.name == "seawall_ttft_seconds_sum":
                    out["ttft_sum"] += s.value
                elif s.name == "seawall_migrations_total":
                    key = f"migrations_{s.labels.get('outcome', '')}"
                    if key in out:
                        out[key] += s.value
        return out

    def replica_pid(self, url: str) -> int:
        """The pid of the `seawall sim` serving `url` (a descendant of `seawall up`)."""
        port = url.rsplit(":", 1)[1]
        found = []
        for pid in descendants(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"sim" in argv and b"--port" in argv:
                i = argv.index(b"--port")
                if i + 1 < len(argv) and argv[i + 1].decode() == port:
                    found.append(pid)
        if not found:
            raise RuntimeError(f"no sim process found for {url}")
        return min(found)


class ReadyPoller:
    """Polls /admin/state every `every` s in a thread: the fewest ready replicas seen."""

    def __init__(self, fleet: Fleet, every: float = 0.1) -> None:
        self.fleet, self.every = fleet, every
        self.min_ready: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                n = len(self.fleet.ready())
            except (OSError, RuntimeError, ValueError):
                n = None
            if n is not None:
                self.min_ready = n if self.min_ready is None else min(self.min_ready, n)
            self._stop.wait(self.every)

    def stop(self) -> int | None:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.min_ready


# ----------------------------------------------------------------------------- the load


@dataclass(frozen=True, slots=True)
class Result:
    """One request as the client saw it.

    ok         [DONE], no error event, all `max_tokens` tokens (ignore_eos is set)
    truncated  [DONE] and no error event, but finish_reason "abort" or fewer tokens: the
               user got a silently cut answer (a vLLM-style SIGTERM abort looks like this)
    dropped    the first token arrived, then an error event or no [DONE]
    failed     a non-200 answer, or an error before the first token
    """

    outcome: str
    started_at: float  # time.monotonic()
    ended_at: float
    ttft_s: float | None
    tokens: int
    finish: str | None
    error: str = ""
    tail: bytes = b""  # the stream's last bytes, kept for failed and dropped requests


async def _one(session: Any, url: str, body: bytes, max_tokens: int) -> Result:
    import aiohttp

    started = time.monotonic()
    ttft: float | None = None
    chunks = 0
    usage: int | None = None
    finish: str | None = None
    done = False
    error = ""
    tail = b""
    try:
        async with (
            asyncio.timeout(60),
            session.post(url, data=body, headers={"Content-Type": "application/json"}) as r,
        ):
            if r.status != 200:
                text = (await r.read())[:120].decode(errors="replace")
                return Result(
                    "failed", started, time.monotonic(), None, 0, None, f"HTTP {r.status}: {text}"
                )
            async for line in r.content:
                tail = (tail + line)[-400:]
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    done = True
                    continue
                obj = json.loads(payload)
                if "error" in obj:
                    err = obj["error"]
                    error = error or str(err.get("message") if isinstance(err, dict) else err)
                    continue
                if isinstance(obj.get("usage"), dict):
                    usage = obj["usage"].get("completion_tokens", usage)
                for c in obj.get("choices") or ():
                    if c.get("text") or (c.get("delta") or {}).get("content"):
                        chunks += 1
                        if ttft is None:
                            ttft = time.monotonic() - started
                    finish = c.get("finish_reason") or finish
    except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
        error = error or f"{type(e).__name__}: {e}"[:120]
    ended = time.monotonic()
    tokens = usage if usage is not None else chunks
    if done and not error:
        whole = finish != "abort" and tokens >= max_tokens
        return Result("ok" if whole else "truncated", started, ended, ttft, tokens, finish)
    error = error or "no [DONE]"
    outcome = "dropped" if ttft is not None else "failed"
    return Result(outcome, started, ended, ttft, tokens, finish, error, tail)


@dataclass
class Load:
    """A steady streaming load in a thread with its own event loop: `concurrency`
    workers, each sending its next request when the last ends, until `stop()`, the
    `duration_s` or `max_requests`, whichever comes first. Every result is kept."""

    api: str
    concurrency: int
    max_tokens: int
    duration_s: float
    max_requests: int = 20_000
    results: list[Result] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> Load:
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self._thread.start()
        return self

    async def _main(self) -> None:
        import aiohttp

        url = self.api + "/v1/completions"
        deadline = time.monotonic() + self.duration_s
        issued = 0

        async def worker(session: aiohttp.ClientSession, n: int) -> None:
            nonlocal issued
            while (
                not self._stop.is_set()
                and time.monotonic() < deadline
                and issued < self.max_requests
            ):
                issued += 1
                body = {
                    "model": MODEL,
                    "prompt": f"{n}-{issued} the sea wall holds the tide at dawn",
                    "max_tokens": self.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                self.results.append(
                    await _one(session, url, json.dumps(body).encode(), self.max_tokens)
                )

        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            await asyncio.gather(*(worker(session, n) for n in range(self.concurrency)))

    def stop(self) -> list[Result]:
        """Stop opening requests; wait for those in flight (each is bounded to 60 s)."""
        self._stop.set()
        assert self._thread is not None
        self._thread.join(timeout=90)
        if self._thread.is_alive():
            raise RuntimeError("the load thread did not finish")
        return self.results


def count(results: list[Result], outcome: str) -> int:
    return sum(1 for r in results if r.outcome == outcome)


def summary(results: list[Result]) -> str:
    ttfts = [r.ttft_s * 1000 for r in results if r.ttft_s is not None]
    outcomes = ", ".join(f"{o} {count(results, o)}" for o in OUTCOMES)
    return (
        f"requests {len(results)}: {outcomes} | TTFT p50 {percentile(ttfts, 50):.0f}ms "
        f"p99 {percentile(ttfts, 99):.0f}ms"
    )


def errors_of(results: list[Result]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        if r.outcome != "ok":
            key = f"{r.outcome}: {r.error or f'finish_reason={r.finish}'}"
            out[key] = out.get(key, 0) + 1
    return out


def ttft_ms(results: list[Result], q: float) -> float:
    return percentile([r.ttft_s * 1000 for r in results if r.ttft_s is not None], q)


def pair(a: float | None, b: float | None, fmt: str = "{:.0f}") -> str:
    def one(v: float | None) -> str:
        return "-" if v is None or v != v else fmt.format(v)

    return f"{one(a)} / {one(b)}"


# ----------------------------------------------------------------------------- 1. restarts


def surge_first(fleet: Fleet) -> dict[str, Any]:
    status, body = _http(
        "POST",
        fleet.admin + "/admin/rollout",
        {"warmup_requests": 3, "drain_timeout_s": 30, "stop_grace_s": 5},
        auth=True,
    )
    if status != 202:
        raise RuntimeError(f"POST /admin/rollout: HTTP {status} {body[:200]!r}")
    report: dict[str, Any] = {}

    def finished() -> bool:
        nonlocal report
        code, raw = _http("GET", fleet.admin + "/admin/rollout", auth=True)
        report = json.loads(raw) if code == 200 else {}
        return report.get("state") not in (None, "running")

    _wait(finished, 150, "the rollout to finish", every=0.2)
    return report


def naive(fleet: Fleet) -> dict[str, Any]:
    """SIGTERM each replica in turn; wait until the supervisor's restart is routable."""
    restarted = 0
    for rep in sorted(fleet.ready(), key=lambda r: r["id"]):
        rid, url = rep["id"], rep["url"]
        old_pid = fleet.replica_pid(url)
        os.kill(old_pid, signal.SIGTERM)  # a grandchild this benchmark started, by pid

        def back(rid: str = rid, url: str = url, old_pid: int = old_pid) -> bool:
            try:
                if fleet.replica_pid(url) == old_pid:
                    return False
            except RuntimeError:
                return False  # not restarted yet
            return any(r["id"] == rid for r in fleet.ready())

        _wait(back, 60, f"{rid} to be restarted and routable", every=0.1)
        restarted += 1
    return {"state": "done", "replaced": restarted}


def run_restart(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    seconds = args.baseline_s + 200
    fleet = Fleet(f"restart-{mode}", args.replicas, args.step_ms, False, seconds)
    try:
        load = Load(fleet.api, args.concurrency, args.max_tokens, args.baseline_s + 170).start()
        time.sleep(args.baseline_s)
        ready_before = len(fleet.ready())
        m0 = fleet.metrics()
        poller = ReadyPoller(fleet)
        t0 = time.monotonic()
        report = surge_first(fleet) if mode == "surge-first" else naive(fleet)
        t1 = time.monotonic()
        min_ready = poller.stop()
        m1 = fleet.metrics()
        time.sleep(1.0)  # a moment of load after, so streams cut at the end are counted
        res = load.stop()
        m2 = fleet.metrics()
    finally:
        fleet.close()
    before = [r for r in res if r.ended_at < t0]
    during = [r for r in res if t0 <= r.started_at <= t1]
    out: dict[str, Any] = {
        "mode": mode,
        "report": report,
        "load": res,
        "restarted": len(report["replaced"])
        if isinstance(report.get("replaced"), list)
        else report.get("replaced"),
        "state": report.get("state"),
        "duration_s": t1 - t0,
        "n_before": len(before),
        "n_during": len(during),
        "p50_before": ttft_ms(before, 50),
        "p99_before": ttft_ms(before, 99),
        "p50_during": ttft_ms(during, 50),
        "p99_during": ttft_ms(during, 99),
        "ready_before": ready_before,
        "ready_min_polled": min_ready,
        "gw_dropped_metrics": int(m1["dropped"] - m0["dropped"]),
        "gw_failed_metrics": int(m1["failed"] - m0["failed"]),
    }
    dc = m1["ttft_count"] - m0["ttft_count"]
    out["gw_ttft_mean_during_ms"] = (m1["ttft_sum"] - m0["ttft_sum"]) / dc * 1000 if dc else None
    out["gw_ttft_mean_before_ms"] = (
        m0["ttft_sum"] / m0["ttft_count"] * 1000 if m0["ttft_count"] else None
    )
    out["gw_dropped_run"] = int(m2["dropped"])
    out["gw_failed_run"] = int(m2["failed"])
    print(f"  {mode}: {summary(res)}", flush=True)
    if errs := errors_of(res):
        print(f"  {mode}: not ok {errs}", flush=True)
    if sample := next((r for r in res if r.outcome == "failed" and r.tail), None):
        print(f"  {mode}: a failed request's stream ended with: {sample.tail!r}", flush=True)
    bad = [r for r in res if r.outcome != "ok"]
    if bad:
        when = ", ".join(
            f"{r.started_at - t0:+.2f}s..{r.ended_at - t0:+.2f}s"
            f" {r.outcome} ttft={'-' if r.ttft_s is None else f'{r.ttft_s * 1000:.0f}ms'}"
            for r in bad[:8]
        )
        print(f"  {mode}: not ok (start..end from the restart's start): {when}", flush=True)
    return out


def print_restarts(rows: list[dict[str, Any]]) -> None:
    by = {r["mode"]: r for r in rows}
    cols = [by.get("surge-first", {}), by.get("naive", {})]
    rep = cols[0].get("report", {})

    def each(fn: Any) -> list[Any]:
        return [fn(r) if r else "-" for r in cols]

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1000

    table = [
        ["replicas restarted (state)", *each(lambda r: f"{r['restarted']} ({r['state']})")],
        ["client: requests (whole run)", *each(lambda r: len(r["load"]))],
        ["client: streams dropped (error event)", *each(lambda r: count(r["load"], "dropped"))],
        ["client: streams truncated (abort, [DONE])",
         *each(lambda r: count(r["load"], "truncated"))],
        ["client: requests failed (no token)", *each(lambda r: count(r["load"], "failed"))],
        ["gateway: streams dropped", rep.get("streams_dropped", "-"), *each(
            lambda r: r["gw_dropped_metrics"])[1:]],
        ["gateway: requests failed (5xx/429)", rep.get("requests_failed", "-"), *each(
            lambda r: r["gw_failed_metrics"])[1:]],
        ["gateway: dropped / failed, whole run",
         *each(lambda r: f"{r['gw_dropped_run']} / {r['gw_failed_run']}")],
        ["gateway: streams cut by drains", rep.get("streams_cut_by_drains", "-"), "-"],
        ["client TTFT p50 before / during (ms)",
         *each(lambda r: pair(r["p50_before"], r["p50_during"]))],
        ["client TTFT p99 before / during (ms)",
         *each(lambda r: pair(r["p99_before"], r["p99_during"]))],
        ["client requests started before / during",
         *each(lambda r: f"{r['n_before']} / {r['n_during']}")],
        ["gateway TTFT mean before / during (ms)",
         pair(ms(rep.get("ttft_mean_before_s")), ms(rep.get("ttft_mean_during_s"))),
         *each(lambda r: pair(r["gw_ttft_mean_before_ms"], r["gw_ttft_mean_during_ms"]))[1:]],
        ["restart duration (s)", *each(lambda r: f"{r['duration_s']:.1f}")],
        ["ready before / min during (polled)",
         *each(lambda r: f"{r['ready_before']} / {r['ready_min_polled']}")],
        ["ready before / min during (rollout report)",
         f"{rep.get('ready_before', '-')} / {rep.get('ready_min_during', '-')}", "-"],
    ]  # fmt: skip
    print_table(["rolling restart of every replica", "surge-first", "naive SIGTERM"], table)


# ----------------------------------------------------------------------------- 2. crash


def run_crash(migrate: bool, args: argparse.Namespace) -> dict[str, Any]:
    name = "crash-migrate" if migrate else "crash-no-migrate"
    fleet = Fleet(name, args.replicas, args.step_ms, migrate, 120)
    try:
        load = Load(fleet.api, args.concurrency, args.crash_max_tokens, 60).start()
        time.sleep(args.crash_warm_s)
        victim: dict[str, Any] = {}

        def busy() -> bool:
            nonlocal victim
            reps = fleet.ready()
            victim = max(reps, key=lambda r: r["inflight"]) if reps else {}
            return bool(victim) and victim["inflight"] >= 2

        _wait(busy, 20, "a replica with streams in flight", every=0.02)
        m0 = fleet.metrics()
        t_crash = time.monotonic()
        try:
            code, body = _http("POST", victim["url"] + "/sim/fault", {"kind": "crash"}, timeout=5)
        except (OSError, http.client.HTTPException):
            code, body = 200, b""  # the replica died before it answered: that is the crash
        if code != 200:
            raise RuntimeError(f"crash fault: HTTP {code} {body[:200]!r}")
        time.sleep(args.crash_after_s)
        res = load.stop()
        m1 = fleet.metrics()
    finally:
        fleet.close()
    at_crash = [r for r in res if r.started_at <= t_crash < r.ended_at]
    dropped = count(at_crash, "dropped") + count(at_crash, "truncated")
    on_victim = int(victim["inflight"])
    out = {
        "migrate": migrate,
        "victim": victim["id"],
        "on_victim": on_victim,
        "at_crash": len(at_crash),
        "ok": count(at_crash, "ok"),
        "truncated": count(at_crash, "truncated"),
        "dropped": count(at_crash, "dropped"),
        "failed": count(at_crash, "failed"),
        "fraction": max(0, on_victim - dropped) / on_victim if on_victim else float("nan"),
        "mig_ok": m1["migrations_ok"] - m0["migrations_ok"],
        "mig_failed": m1["migrations_failed"] - m0["migrations_failed"],
        "mig_refused": m1["migrations_refused"] - m0["migrations_refused"],
        "gw_dropped": int(m1["dropped"] - m0["dropped"]),
        "load": res,
    }
    print(f"  {name}: crashed {victim['id']} | {summary(res)}", flush=True)
    if errs := errors_of(res):
        print(f"  {name}: not ok {errs}", flush=True)
    return out


def print_crash(rows: list[dict[str, Any]]) -> None:
    off = next((r for r in rows if not r["migrate"]), {})
    on = next((r for r in rows if r["migrate"]), {})

    def g(r: dict[str, Any], k: str) -> Any:
        return r.get(k, "-")

    def load(r: dict[str, Any]) -> str:
        res = r.get("load")
        if res is None:
            return "-"
        return " / ".join(str(x) for x in (len(res), *(count(res, o) for o in OUTCOMES)))

    table = [
        ["streams in flight on the crashed replica", g(off, "on_victim"), g(on, "on_victim")],
        ["client streams in flight at the crash", g(off, "at_crash"), g(on, "at_crash")],
        ["  completed cleanly", g(off, "ok"), g(on, "ok")],
        ["  dropped (started, then error)", g(off, "dropped"), g(on, "dropped")],
        ["  truncated (abort, [DONE])", g(off, "truncated"), g(on, "truncated")],
        ["  failed (no token)", g(off, "failed"), g(on, "failed")],
        ["crashed replica's streams completed", g(off, "fraction"), g(on, "fraction")],
        ["gateway: streams dropped", g(off, "gw_dropped"), g(on, "gw_dropped")],
        [
            "gateway: migrations ok / failed / refused",
            *(f"{g(r, 'mig_ok'):g} / {g(r, 'mig_failed'):g} / {g(r, 'mig_refused'):g}"
              if r else "-" for r in (off, on)),
        ],
        ["client run: requests / ok / trunc. / dropped / failed", load(off), load(on)],
    ]  # fmt: skip
    print_table(["replica crashed mid-stream", "no migration", "migration"], table)


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--max-tokens", type=int, default=60, help="per request, restart runs")
    p.add_argument("--crash-max-tokens", type=int, default=200, help="per request, crash runs")
    p.add_argument("--step-ms", type=float, default=10.0, help="sim --step-base-ms")
    p.add_argument("--baseline-s", type=float, default=10.0, help="load before the restart")
    p.add_argument("--crash-warm-s", type=float, default=4.0, help="load before the crash")
    p.add_argument("--crash-after-s", type=float, default=6.0, help="load after the crash")
    p.add_argument("--only", choices=("restart", "crash"), help="run one part (default: both)")
    p.add_argument("--mode", choices=("surge-first", "naive"), help="one restart mode only")
    args = p.parse_args(argv)
    started = time.monotonic()
    print(f"machine: {machine_context()}", flush=True)
    print(
        f"fleet: {args.replicas} x seawall sim (--step-base-ms {args.step_ms:g}); load: "
        f"{args.concurrency} concurrent streams from a client thread; logs: {LOG_ROOT}",
        flush=True,
    )
    if args.only in (None, "restart"):
        print(
            f"\n[1] rolling restart: {args.baseline_s:g}s baseline, then the restart, "
            f"max_tokens {args.max_tokens}",
            flush=True,
        )
        modes = [m for m in ("surge-first", "naive") if args.mode in (None, m)]
        rows = [run_restart(m, args) for m in modes]
        print()
        print_restarts(rows)
    if args.only in (None, "crash"):
        print(
            f"\n[2] crash mid-stream: max_tokens {args.crash_max_tokens}, crash after "
            f"{args.crash_warm_s:g}s of load, load kept {args.crash_after_s:g}s after",
            flush=True,
        )
        rows = [run_crash(m, args) for m in (False, True)]
        print()
        print_crash(rows)
    print(f"\ntotal {time.monotonic() - started:.0f}s; machine after: {machine_context()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
