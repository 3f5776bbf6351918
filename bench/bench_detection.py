"""How long the gateway takes to notice each fault, and what clients lose meanwhile.

    python bench/bench_detection.py [--runs 3]
        [--faults engine_dead,hang_keep,hang_zero,slow,crash,xid79]
        [--concurrency 8] [--max-tokens 32] [--time-limit 600]

Starts 3 `seawall sim --enable-faults` replicas (one per node, each node's DCGM endpoint
is its sim's `/dcgm/metrics`) and one `seawall serve` gateway with the admin API and
quick fleet intervals (printed; detection times scale with them: the defaults are 1 s
liveness, 1 s scrape, 5 s deep probe, 60 s watchdog, 5 s DCGM). For each fault and run:

1. a steady, bounded streaming load through the gateway (`seawall.loadgen`, in this
   process: closed loop, `--concurrency` workers, `--max-tokens` tokens each);
2. after `BASELINE_S` plus a random 0..1 s (seeded; so that the injection falls at a
   uniformly random point of the 1 s probe cycles rather than locked to them: the
   previous run's recovery ends on a probe), the fault is injected on one replica
   (`POST /sim/fault`; the target rotates r0, r1, r2 over the runs);
3. detection: the first `/admin/state` answer (polled every 50 ms) that shows the
   replica not routable. For `slow` (nothing breaks; routing should shift work away)
   detection is the replica's share of new upstream attempts (gateway counter
   `seawall_upstream_attempts_total`, sampled every 250 ms over a trailing 1 s window)
   falling below half its fair share (1/6 of 3) at two samples in a row; the time is the
   first of the two (or the replica leaving routing, whichever is first);
4. at detection the load stops opening requests; the fault stays on until every request
   already sent has ended (so a stream stuck on a hung replica fails as it would), then
   it is cleared (`{"kind": "clear"}`, and an uncordon for the Xid), or the replica's
   process is restarted when the fault killed it, and the next run waits until every
   replica is ready and routable again. The sims are reused; the gateway is restarted
   when a replica's routing score has not come back to `SCORE_OK` within a few seconds
   (its latency and error averages only recover with traffic, and a replica still
   scored down would skew the next run's routing, which `slow` measures).

Requests during detection: every request in flight at some point between injection and
detection (started before detection, ended after injection). Failed: of those, the ones
the client saw fail: a non-200, an error event or a stream without `[DONE]` (loadgen's
`failed` + `dropped`), or still running when the load's grace ran out (`cut`).

The gateway runs with its defaults otherwise (no tenancy, so no mid-stream migration;
actuator `none`, so a "restart" only takes the replica out of routing until its
/health passes again) except: timeouts ttft/itl 8 s (defaults 30 s / 15 s: shorter so a
stream stuck on a hung replica ends sooner, still above the 5 s watchdog window so that
the watchdog, not a client timeout, is what notices), `restart_limit` 1000 and an
in-memory ledger (so the benchmark's own repeated faults never cordon a node).

The machine may be shared (2 cores here, with other people's tests): the header prints
the load average; detection times include the wait for a core.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import re
import statistics
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    Proc,
    free_port,
    machine_context,
    print_table,
    seawall_env,
    sim_argv,
    wait_http,
)

sys.path.insert(0, str(REPO / "src"))

import aiohttp

from seawall.auth import hash_key
from seawall.loadgen import RequestResult, run_load
from seawall.metrics import UPSTREAM_ATTEMPTS

LOGS = REPO / "bench" / "results" / "detection-logs"
MODEL = "sim-model"
REPLICAS = 3
ADMIN_TOKEN = "sk-sw-bench-detection-admin-token-0000000000000000"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

FAULTS: dict[str, dict[str, Any]] = {
    "engine_dead": {"kind": "engine_dead", "grace_s": 5.0},  # vLLM's watchdog: 5 s
    "hang_keep": {"kind": "hang", "running": "keep"},
    "hang_zero": {"kind": "hang", "running": "zero"},
    "slow": {"kind": "slow", "factor": 4.0},
    "crash": {"kind": "crash"},
    "xid79": {"kind": "dcgm", "xid": 79},
}

# Realistic but quick: the production defaults are the same for liveness and scrape and
# 5 s / 60 s / 5 s for deep probe / watchdog / DCGM; detection scales with these.
FLEET: dict[str, Any] = {
    "liveness_interval_s": 1.0,
    "liveness_timeout_s": 1.0,
    "scrape_interval_s": 1.0,
    "scrape_timeout_s": 1.0,
    "deep_probe_interval_s": 2.0,
    "deep_probe_idle_interval_s": 2.0,
    "deep_probe_timeout_s": 2.0,
    "watchdog_window_s": 5.0,
    "dcgm_interval_s": 1.0,
    "dcgm_timeout_s": 1.0,
    "restart_limit": 1000,
    "ledger_path": ":memory:",
}
TIMEOUTS = {"ttft_s": 8.0, "itl_s": 8.0, "total_s": 60.0}

BASELINE_S = 2.0  # steady load before the fault (plus a random 0..1 s)
PHASE_JITTER_S = 1.0  # the probe and DCGM intervals
SCORE_OK = 0.8  # every replica's routing_score before a run, or a fresh gateway
SCORE_WAIT_S = 4.0
POLL_S = 0.05  # /admin/state
SHARE_SAMPLE_S = 0.25  # gateway /metrics, for `slow`
SHARE_WINDOW_S = 1.0
LATE_TTFT_S = 1.0  # a success this late still hurt (a retry after a TTFT timeout)
DETECT_TIMEOUT_S = 20.0  # a fault not noticed by then counts as not detected
LOAD_GRACE_S = 20.0  # in-flight requests after the load stops (hung: ttft/itl 8 s)
RECOVER_TIMEOUT_S = 30.0


# ----------------------------------------------------------------------------- HTTP


def http_json(url: str, body: dict[str, Any] | None = None, timeout: float = 5.0) -> Any:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    if "/admin/" in url:
        req.add_header("Authorization", AUTH["Authorization"])
    if body is not None:
        req.method = "POST"
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"null")


def set_fault(sim_url: str, fault: dict[str, Any]) -> bool:
    """POST the fault; False when the replica did not answer (a crash takes it down)."""
    try:
        http_json(f"{sim_url}/sim/fault", fault)
        return True
    except (OSError, urllib.error.URLError, ValueError):
        return False


# ----------------------------------------------------------------------------- fleet


class Fleet:
    """3 sims and a gateway; restarts what a fault killed."""

    def __init__(self) -> None:
        self.sim_ports = [free_port() for _ in range(REPLICAS)]
        self.sims: list[Proc | None] = [None] * REPLICAS
        self.gateway: Proc | None = None
        self.api_port = 0
        self.admin_port = 0
        self.starts = 0
        self.gateways = 0

    def sim_url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.sim_ports[i]}"

    @property
    def api(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start_sim(self, i: int) -> None:
        old = self.sims[i]
        if old is not None:
            old.stop()
        self.starts += 1
        port = self.sim_ports[i]
        argv = sim_argv(port, MODEL, "--seed", str(i), "--enable-faults")
        log = LOGS / f"sim-r{i}-{self.starts}.log"
        self.sims[i] = Proc(f"r{i}", argv, log, env=seawall_env(), cwd=REPO, port=port)

    def config(self) -> dict[str, Any]:
        dcgm = {f"node-{i}": f"{self.sim_url(i)}/dcgm/metrics" for i in range(REPLICAS)}
        return {
            "listen": {"host": "127.0.0.1", "port": self.api_port},
            "admin": {
                "enabled": True,
                "port": self.admin_port,
                "token_hash": hash_key(ADMIN_TOKEN),
            },
            "timeouts": TIMEOUTS,
            "replicas": [
                {"url": self.sim_url(i), "id": f"r{i}", "node": f"node-{i}", "model": MODEL}
                for i in range(REPLICAS)
            ],
            "fleet": {**FLEET, "dcgm": dcgm},
        }

    def start(self) -> None:
        LOGS.mkdir(parents=True, exist_ok=True)
        for i in range(REPLICAS):
            self.start_sim(i)
        for i, sim in enumerate(self.sims):
            assert sim is not None
            wait_http(f"{self.sim_url(i)}/health", 60, sim)
        self.start_gateway()

    def start_gateway(self) -> None:
        if self.gateway is not None:
            self.gateway.stop()
        self.gateways += 1
        self.api_port, self.admin_port = free_port(), free_port()
        path = LOGS / "gateway.yaml"
        path.write_text(json.dumps(self.config(), indent=2))  # JSON is YAML
        argv = [sys.executable, "-m", "seawall", "serve", "--config", str(path)]
        argv += ["--no-access-log", "--log-level", "INFO"]
        log = LOGS / f"gateway-{self.gateways}.log"
        self.gateway = Proc("gateway", argv, log, env=seawall_env(), cwd=REPO)
        wait_http(f"{self.api}/readyz", 60, self.gateway)
        _wait(self.all_ready, RECOVER_TIMEOUT_S, "every replica ready and routable")

    def stop(self) -> None:
        for p in [self.gateway, *self.sims]:
            if p is not None:
                p.stop()

    def state(self) -> dict[str, Any]:
        out: dict[str, Any] = http_json(f"{self.admin}/admin/state")
        return out

    def replicas(self) -> dict[str, dict[str, Any]]:
        return {r["id"]: r for r in self.state()["replicas"]}

    def recover(self, i: int, fault: str) -> str:
        """Clear the fault on replica i (restart its process if the fault killed it) and
        wait until every replica is ready and routable. Returns what was done."""
        did = []
        sim = self.sims[i]
        if sim is None or not sim.alive() or not set_fault(self.sim_url(i), {"kind": "clear"}):
            self.start_sim(i)
            sim = self.sims[i]
            assert sim is not None
            wait_http(f"{self.sim_url(i)}/health", 60, sim)
            did.append("process restarted")
        else:
            did.append("cleared")
        if fault == "xid79":
            node = f"node-{i}"
            _wait(lambda: not _node(self.state(), node)["gpu"]["fatal"], 10, f"{node} gpu ok")
            http_json(f"{self.admin}/admin/nodes/{node}/uncordon", {})
            did.append("uncordoned")
        _wait(self.all_ready, RECOVER_TIMEOUT_S, "every replica ready and routable")
        try:
            _wait(self.scores_ok, SCORE_WAIT_S, "scored back")
        except TimeoutError:
            scores = {k: round(v["routing_score"], 2) for k, v in self.replicas().items()}
            self.start_gateway()
            did.append(f"gateway restarted (routing scores {scores})")
        return ", ".join(did)

    def scores_ok(self) -> bool:
        return all(r["routing_score"] >= SCORE_OK for r in self.replicas().values())

    def all_ready(self) -> bool:
        reps = self.replicas()
        return len(reps) == REPLICAS and all(
            r["routable"] and r["state"] == "ready" for r in reps.values()
        )


def _node(state: dict[str, Any], name: str) -> dict[str, Any]:
    return next(n for n in state["nodes"] if n["node"] == name)


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, StopIteration):
            if predicate():
                return
        time.sleep(0.1)
    raise TimeoutError(f"not {what} after {timeout:g} s")


# ----------------------------------------------------------------------------- one run


@dataclass
class RunResult:
    fault: str
    target: str
    detection_s: float | None
    detected_as: str
    window: int  # requests in flight between injection and detection
    failed: int  # of those, failed / dropped / cut
    kinds: dict[str, int] = field(default_factory=dict)
    late: int = 0  # of the window's requests that succeeded, those with TTFT > LATE_TTFT_S
    before_failed: dict[str, int] = field(default_factory=dict)  # ended before injection
    before_total: int = 0
    baseline_share: float | None = None  # slow: the target's share before the fault
    score_at_detection: float | None = None
    recovered: str = ""


def attempts_by_replica(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    pattern = re.compile(rf"^{UPSTREAM_ATTEMPTS}\{{([^}}]*)\}} (\S+)", re.M)
    for labels, value in pattern.findall(text):
        m = re.search(r'replica="([^"]*)"', labels)
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(value)
    return out


class Watcher:
    """Polls /admin/state (and, for `slow`, the gateway's attempt counters)."""

    def __init__(self, session: aiohttp.ClientSession, fleet: Fleet, target: str) -> None:
        self.session = session
        self.fleet = fleet
        self.target = target
        self.shares: list[tuple[float, float | None]] = []  # (t, trailing-window share)
        self._counts: list[tuple[float, dict[str, float]]] = []
        self.last_state: dict[str, Any] = {}

    async def target_view(self) -> dict[str, Any] | None:
        try:
            async with self.session.get(
                f"{self.fleet.admin}/admin/state", headers=AUTH, timeout=_timeout(2)
            ) as r:
                state = await r.json()
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        view: dict[str, Any] | None = next(
            (x for x in state["replicas"] if x["id"] == self.target), None
        )
        self.last_state = view or {}
        return view

    async def sample_shares(self, until: asyncio.Event) -> None:
        """Every SHARE_SAMPLE_S: the target's share of upstream attempts over the
        trailing SHARE_WINDOW_S (None when there were no attempts at all)."""
        while not until.is_set():
            t = time.monotonic()
            try:
                async with self.session.get(f"{self.fleet.api}/metrics", timeout=_timeout(2)) as r:
                    counts = attempts_by_replica(await r.text())
            except (aiohttp.ClientError, TimeoutError):
                counts = None
            if counts is not None:
                self._counts.append((t, counts))
                old = next((c for s, c in reversed(self._counts) if t - s >= SHARE_WINDOW_S), None)
                if old is not None:
                    delta = {k: v - old.get(k, 0.0) for k, v in counts.items()}
                    total = sum(delta.values())
                    share = delta.get(self.target, 0.0) / total if total > 0 else None
                    self.shares.append((t, share))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(until.wait(), SHARE_SAMPLE_S)

    def share_detected(self, since: float) -> float | None:
        """The time of the first of two samples in a row below half the fair share."""
        threshold = 0.5 / REPLICAS
        after = [(t, s) for t, s in self.shares if t >= since]
        for (t1, s1), (_, s2) in itertools.pairwise(after):
            if s1 is not None and s2 is not None and s1 < threshold and s2 < threshold:
                return t1
        return None


def why_unroutable(view: dict[str, Any]) -> str:
    """The state, or the failed liveness probe that stops routing before a state change."""
    live = view.get("liveness") or {}
    if view.get("state") in ("ready", "degraded") and live.get("consecutive_failures"):
        return f"{view['state']}, liveness failed: {str(live.get('last_error'))[:50]}"
    if view.get("cordoned") and view.get("state") != "cordoned":
        return f"{view['state']}, node cordoned"
    return f"{view.get('state')}: {str(view.get('reason') or '-')[:80]}"


def _timeout(s: float) -> aiohttp.ClientTimeout:
    return aiohttp.ClientTimeout(total=s)


def _kinds(results: list[RequestResult]) -> dict[str, int]:
    kinds: dict[str, int] = {}
    for r in results:
        key = f"{r.outcome}: {r.error[:60]}" if r.error else r.outcome
        kinds[key] = kinds.get(key, 0) + 1
    return kinds


async def one_run(
    fleet: Fleet, fault: str, i: int, args: argparse.Namespace, jitter_s: float
) -> RunResult:
    target = f"r{i}"
    results: list[RequestResult] = []
    stop = asyncio.Event()
    stop_sampling = asyncio.Event()
    slow = fault == "slow"
    run_s = BASELINE_S + jitter_s + DETECT_TIMEOUT_S + 1.0
    async with aiohttp.ClientSession() as session:
        watcher = Watcher(session, fleet, target)
        sampler = asyncio.create_task(watcher.sample_shares(stop_sampling)) if slow else None
        load = asyncio.create_task(
            run_load(
                fleet.api,
                MODEL,
                concurrency=args.concurrency,
                duration_s=run_s,
                max_requests=int(args.concurrency * run_s * 50),  # the time bound ends it
                prompt_tokens=16,
                max_tokens=args.max_tokens,
                on_result=results.append,
                grace_s=LOAD_GRACE_S,
                stop=stop,
            )
        )
        detected_at: float | None = None
        detected_as = "not detected"
        baseline_share: float | None = None
        t0 = time.monotonic()
        try:
            await asyncio.sleep(BASELINE_S + jitter_s)
            if slow:
                shares = [s for _, s in watcher.shares if s is not None]
                baseline_share = statistics.fmean(shares) if shares else None
            t0 = time.monotonic()
            await asyncio.to_thread(set_fault, fleet.sim_url(i), FAULTS[fault])
            deadline = t0 + DETECT_TIMEOUT_S
            while time.monotonic() < deadline and not load.done():
                view = await watcher.target_view()
                now = time.monotonic()
                if view is not None and not view["routable"]:
                    detected_at = now
                    detected_as = why_unroutable(view)
                    break
                if slow:
                    t = watcher.share_detected(t0)
                    if t is not None:
                        detected_at = t
                        detected_as = f"share < {0.5 / REPLICAS:.3f}"
                        break
                await asyncio.sleep(max(0.0, POLL_S - (time.monotonic() - now)))
        finally:
            stop.set()
            stop_sampling.set()
            await asyncio.wait_for(load, LOAD_GRACE_S + 10)
            if sampler is not None:
                await sampler
        score = None
        if slow:
            view = await watcher.target_view()
            score = view.get("routing_score") if view else None

    end = detected_at if detected_at is not None else t0 + DETECT_TIMEOUT_S
    window = [r for r in results if r.started_at < end and r.started_at + r.total_s > t0]
    bad = [r for r in window if r.outcome != "ok"]
    late = [r for r in window if r.outcome == "ok" and (r.ttft_s or 0.0) > LATE_TTFT_S]
    before = [r for r in results if r.started_at + r.total_s <= t0]
    recovered = await asyncio.to_thread(fleet.recover, i, fault)
    return RunResult(
        fault=fault,
        target=target,
        detection_s=None if detected_at is None else detected_at - t0,
        detected_as=detected_as,
        window=len(window),
        failed=len(bad),
        kinds=_kinds(bad),
        late=len(late),
        before_failed=_kinds([r for r in before if r.outcome != "ok"]),
        before_total=len(before),
        baseline_share=baseline_share,
        score_at_detection=score,
        recovered=recovered,
    )


# ----------------------------------------------------------------------------- main


def describe_config(args: argparse.Namespace) -> None:
    print(
        "fleet: liveness {liveness_interval_s:g} s, scrape {scrape_interval_s:g} s, deep probe "
        "{deep_probe_interval_s:g} s (timeout {deep_probe_timeout_s:g} s, 3 failures -> "
        "degraded), watchdog window {watchdog_window_s:g} s, DCGM {dcgm_interval_s:g} s, "
        "restart_limit {restart_limit}, ledger {ledger_path}".format(**FLEET)
    )
    print(
        "  (defaults: liveness 1 s, scrape 1 s, deep probe 5 s busy / 2.5 s idle, watchdog "
        "60 s, DCGM 5 s; detection times scale with these intervals)"
    )
    print(
        f"gateway: timeouts ttft {TIMEOUTS['ttft_s']:g} s, itl {TIMEOUTS['itl_s']:g} s; "
        "retries, admission, score and balance at their defaults; actuator none"
    )
    print(
        f"load: {args.concurrency} concurrent streamed completions, {args.max_tokens} tokens "
        f"each, 16-token prompts; {BASELINE_S:g} s + uniform(0, {PHASE_JITTER_S:g}) s (seed "
        f"{args.seed}) of load before each fault"
    )
    print("faults: " + "; ".join(f"{k} {json.dumps(FAULTS[k])}" for k in args.faults))
    print(
        "detection: injection -> first /admin/state (polled every 50 ms) showing the replica "
        "not routable;\n  slow: -> its share of upstream attempts (trailing "
        f"{SHARE_WINDOW_S:g} s, sampled every {SHARE_SAMPLE_S:g} s) below half its fair share "
        f"({0.5 / REPLICAS:.3f}) at 2 samples in a row (or not routable)"
    )
    print(
        "during detection: requests in flight between injection and detection; failed: "
        "non-200, error event, stream without [DONE], or cut;\n  ok, TTFT>1s: of those, "
        "successes whose first token took over 1 s; failed before fault: failed/all requests "
        "that ended before the injection (the background failure rate)"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1, help="for the injection phase")
    parser.add_argument(
        "--time-limit", type=float, default=600.0, help="start no new run after this many s"
    )
    args = parser.parse_args(argv)
    args.faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    unknown = [f for f in args.faults if f not in FAULTS]
    if unknown or args.runs < 1:
        parser.error(f"unknown fault(s) {unknown}; choose from {', '.join(FAULTS)}")

    print(f"machine: {machine_context()}")
    describe_config(args)
    started = time.monotonic()
    fleet = Fleet()
    rng = random.Random(args.seed)
    runs: list[RunResult] = []
    n = 0
    try:
        fleet.start()
        for fault in args.faults:
            for run in range(args.runs):
                if time.monotonic() - started > args.time_limit:
                    print(f"time limit {args.time_limit:g} s reached: no more runs")
                    break
                i = n % REPLICAS
                n += 1
                jitter_s = rng.uniform(0.0, PHASE_JITTER_S)
                r = asyncio.run(one_run(fleet, fault, i, args, jitter_s))
                runs.append(r)
                det = "never" if r.detection_s is None else f"{r.detection_s:.2f} s"
                extra = ""
                if r.fault == "slow":
                    base = "-" if r.baseline_share is None else f"{r.baseline_share:.2f}"
                    score = "-" if r.score_at_detection is None else f"{r.score_at_detection:.2f}"
                    extra = f" [baseline share {base}, routing_score after {score}]"
                print(
                    f"{fault} run {run + 1}/{args.runs} on {r.target}: detected {det} "
                    f"({r.detected_as}){extra}; {r.window} requests during detection, "
                    f"{r.failed} failed {r.kinds or ''}; failures before the fault: "
                    f"{r.before_failed or 0}; then {r.recovered}",
                    flush=True,
                )
    finally:
        fleet.stop()

    rows = []
    for fault in args.faults:
        rs = [r for r in runs if r.fault == fault]
        if not rs:
            continue
        ds = [r.detection_s for r in rs if r.detection_s is not None]
        window = sum(r.window for r in rs)
        failed = sum(r.failed for r in rs)
        base_failed = sum(sum(r.before_failed.values()) for r in rs)
        rows.append(
            [
                fault,
                len(rs),
                f"{len(ds)}/{len(rs)}",
                statistics.median(ds) if ds else float("nan"),
                min(ds) if ds else float("nan"),
                max(ds) if ds else float("nan"),
                window,
                failed,
                failed / window if window else float("nan"),
                sum(r.late for r in rs),
                f"{base_failed}/{sum(r.before_total for r in rs)}",
            ]
        )
    print()
    print(f"machine after: {machine_context()}; whole benchmark {time.monotonic() - started:.0f} s")
    print_table(
        [
            "fault",
            "runs",
            "detected",
            "median s",
            "min s",
            "max s",
            "requests during",
            "failed",
            "failed frac",
            f"ok, TTFT>{LATE_TTFT_S:g}s",
            "failed before fault",
        ],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
