"""Drills: a scripted, bounded fault against a running fleet, measured as users see it.

Owns: one drill run. It reads the gateway's admin API (`/admin/state`) for where the
OpenAI API listens and which replicas serve which model, drives a steady streaming
load through the gateway (`seawall.loadgen`), injects one fault (through the emulator's
`POST /sim/fault`, or extra load, or the gateway's rollout endpoint), watches the admin
API until the fleet notices, clears the fault and reports what the load generator saw:
streams dropped, requests failed, detection time, retry amplification and time to first
token before and during the fault.

Must not: run unbounded (every loop stops by itself, the whole drill at `duration_s`
plus a short grace for the final scrape and clean-up), fake a capability the fleet lacks
(a gateway without `/admin/rollout`, or one that cannot start and stop replicas, ends
the rolling-restart drill with EXIT_UNAVAILABLE),
or talk to anything but the admin URL, the API URL and the replica URLs the admin API
names. It never restarts a process: a crashed replica stays down until its supervisor
(or the operator) brings it back, and the report says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

import aiohttp
import orjson
from prometheus_client.parser import text_string_to_metric_families

from seawall import clock
from seawall.loadgen import RequestResult, run_load, summarise
from seawall.metrics import REQUESTS, RETRIES, SHED, UPSTREAM_ATTEMPTS

Scenario = Literal[
    "crash-mid-stream", "hang", "preemption-storm", "overload", "rolling-restart", "pool-loss"
]
SCENARIOS: tuple[Scenario, ...] = (
    "crash-mid-stream",
    "hang",
    "preemption-storm",
    "overload",
    "rolling-restart",
    "pool-loss",
)

EXIT_OK = 0
EXIT_ERROR = 2  # the admin API, the token or a replica's fault endpoint is not usable
EXIT_UNAVAILABLE = 3  # the gateway lacks what the drill needs (rollouts)

# The watcher's cadence: detection time is measured to within this much. Fast enough to
# catch a crash between two samples of the crashed replica's in-flight count.
WATCH_INTERVAL_S = 0.05
HTTP_TIMEOUT_S = 2.0
# The baseline is this share of the drill; the load stops issuing at LOAD_SHARE and
# in-flight requests then get the rest to finish, so the drill ends at `duration_s`.
BASELINE_SHARE = 0.3
LOAD_SHARE = 0.85
MIN_BASELINE_S = 1.0
# Load shapes of the scenarios that are extra load rather than a fault.
OVERLOAD_FACTOR = 8  # concurrency multiple: well over what a small fleet serves
STORM_FACTOR = 4
# Long prompts and answers fill the KV cache and preempt, but each must still fit the
# model's context, or the engine refuses it (400) and nothing is stored at all.
STORM_CONTEXT_SHARE = 0.6  # of max_model_len, prompt and answer together
DEFAULT_MAX_MODEL_LEN = 4096  # when the replica does not say (vLLM's /v1/models does)
ROLLOUT_POLL_S = 0.5
ROLLOUT_MISSING = (
    "rolling-restart: the rollout endpoint (POST /admin/rollout) is not available on this "
    "gateway; nothing was restarted"
)
CRASH_AFTER_TOKENS = 8  # tokens generated after the fault is armed: streams have begun
# pool-loss: the pool's engines die (their /health answers 503, requests 500) for this
# share of the time between injection and the end of the load, then come back, so the
# drill sees the failover and, if the failback hold fits, the failback.
POOL_LOSS_SHARE = 0.4


class DrillError(Exception):
    """The drill cannot run; `code` is the process exit code."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class PhaseFigures:
    """What clients saw in one phase (results are placed by when they ended)."""

    requests: int
    ok: int
    failed: int
    dropped: int
    cut: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None


@dataclass
class DrillReport:
    scenario: str
    target: str | None  # replica the fault went to; None for fleet-wide load scenarios
    model: str
    api_url: str
    fault: dict[str, Any] | None
    baseline_s: float
    fault_s: float
    baseline: PhaseFigures  # the steady load, before the fault
    during: PhaseFigures  # the steady load, from the fault on
    burst: PhaseFigures | None  # overload and storm: the extra load itself
    errors: dict[str, int]  # what failed or dropped requests said, most common first
    streams_dropped: int
    requests_failed: int
    requests: int
    detection_s: float | None  # injection -> the admin API shows it; None: never seen
    detected_as: str | None
    # The crashed replica's in-flight streams (the gateway's count) in the last sample
    # before its /health stopped answering: the streams a crash can drop at most.
    target_inflight_at_fault: int | None
    retry_amplification: float | None  # upstream attempts / requests, from /metrics
    upstream_attempts: float
    shed_per_s: float  # requests refused by admission or limits, per second of fault
    preemptions: dict[str, float] = field(default_factory=dict)  # replica -> count
    health_during_fault: int | None = None  # the target's /health status while faulted
    # Times the fleet put the faulted replica back in routing while the fault was still
    # in force (before the drill cleared it): each one sends users to a broken engine.
    readmitted: int = 0
    rollout: dict[str, Any] | None = None  # rolling-restart: the gateway's own report
    # pool-loss: how long until the model's traffic moved to another pool, and back after
    # the pool returned; requests that failed before their first token; retries.
    pool: str | None = None
    failover_s: float | None = None
    failback_s: float | None = None
    failed_before_first_token: int = 0
    retries: float = 0.0
    cleared: bool = False
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class Sample:
    """One look at the fleet during the drill."""

    t: float  # monotonic
    replicas: dict[str, dict[str, Any]]
    target_health: int | None  # status of the target's /health; 0: no answer
    serving: dict[str, str] = field(default_factory=dict)  # model -> its serving pool


def serving_pools(state: dict[str, Any]) -> dict[str, str]:
    """model -> the pool serving it, from the admin state's `pools`."""
    out: dict[str, str] = {}
    for p in state.get("pools") or ():
        for model in p.get("serving") or ():
            out[str(model)] = str(p.get("pool"))
    return out


def phase_figures(results: list[RequestResult]) -> PhaseFigures:
    """The load generator's own summary, cut to what a phase reports."""
    r = summarise(results, duration_s=0.0)
    return PhaseFigures(r.requests, r.ok, r.failed, r.dropped, r.cut, r.ttft_p50_s, r.ttft_p99_s)


def metric_totals(text: str) -> dict[str, float]:
    """Sums of the counter families the report needs, from a gateway's /metrics."""
    wanted = {REQUESTS, SHED, UPSTREAM_ATTEMPTS, RETRIES}
    out = dict.fromkeys(wanted, 0.0)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in wanted:
                out[s.name] += s.value
    return out


def pick_target(state: dict[str, Any], wanted: str | None) -> dict[str, Any]:
    replicas: list[dict[str, Any]] = list(state.get("replicas") or [])
    if not replicas:
        raise DrillError("the gateway lists no replicas")
    if wanted is not None:
        for r in replicas:
            if r.get("id") == wanted:
                return r
        raise DrillError(f"no replica {wanted!r} (have: {', '.join(r['id'] for r in replicas)})")
    routable = sorted((r for r in replicas if r.get("routable")), key=lambda r: str(r["id"]))
    if not routable:
        raise DrillError("no replica is routable now: a drill needs a healthy fleet to start")
    # A fault on the only replica of a model measures an outage, not a failover.
    peers = {
        r["id"]: sum(1 for o in routable if o.get("model") == r.get("model")) for r in routable
    }
    return max(routable, key=lambda r: peers[r["id"]])


def busiest(state: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The routable replica of `model` with the most streams in flight now. The balancer
    may send all of a light load to one replica; a fault on an idle one measures nothing."""
    routable = [
        r for r in state.get("replicas") or () if r.get("routable") and r.get("model") == model
    ]
    routable.sort(key=lambda r: str(r["id"]))
    return max(routable, key=lambda r: int(r.get("inflight") or 0), default=None)


def noticed(scenario: Scenario, before: dict[str, Any], now: dict[str, Any]) -> str | None:
    """What the admin API shows that a replica has changed, or None."""
    if now.get("state") != before.get("state") or (
        before.get("routable") and not now.get("routable")
    ):
        where = "in routing" if now.get("routable") else "out of routing"
        why = now.get("reason") or "-"
        return f"{where}, state {now.get('state')} (the monitor's last why: {why})"
    if scenario == "preemption-storm":
        if now.get("storm") not in (None, "calm"):
            return f"storm: {now.get('preemption_rate_per_s')} preemptions/s"
        rate = now.get("preemption_rate_per_s") or 0.0
        if rate > 0:
            return f"preempting: {rate:.2f}/s (storm state {now.get('storm')})"
    if scenario == "overload" and now.get("saturated") and not before.get("saturated"):
        return f"saturated: {now.get('saturation_reason') or '-'}"
    return None


class Drill:
    """One drill against one gateway. `run()` returns the report or raises DrillError."""

    def __init__(
        self,
        admin_url: str,
        admin_token: str | None,
        scenario: Scenario,
        *,
        duration_s: float = 20.0,
        concurrency: int = 8,
        api_key: str | None = None,
        target: str | None = None,
        max_tokens: int = 32,
        prompt_tokens: int = 64,
        crash_after_tokens: int = CRASH_AFTER_TOKENS,
        rollout_options: dict[str, Any] | None = None,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if duration_s <= 0 or concurrency < 1:
            raise DrillError("--duration must be > 0 and --concurrency >= 1")
        self.admin_url = admin_url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.scenario = scenario
        self.duration_s = duration_s
        self.concurrency = concurrency
        self.api_key = api_key
        self.wanted_target = target
        self.max_tokens = max_tokens
        self.prompt_tokens = prompt_tokens
        self.crash_after_tokens = crash_after_tokens
        self.log = log or (lambda _line: None)
        self.samples: list[Sample] = []
        self.rollout: dict[str, Any] | None = None  # the gateway's rollout report
        self.rollout_options: dict[str, Any] = dict(rollout_options or {})
        self.health_url: str | None = None  # the faulted replica, watched from injection
        self.burst: list[RequestResult] = []  # the extra load of overload and storm
        self.notes: list[str] = []
        self._state_at_start: dict[str, Any] = {}  # pool-loss: the pool's replicas
        self._pool_back_at: float | None = None  # pool-loss: when its engines came back

    # -- HTTP -------------------------------------------------------------------------

    async def _get_json(self, session: aiohttp.ClientSession, path: str) -> dict[str, Any]:
        try:
            async with session.get(self.admin_url + path, headers=self.headers) as r:
                if r.status == 401:
                    raise DrillError("the admin API refused the token (--admin-token)")
                if r.status != 200:
                    raise DrillError(f"GET {path} answered {r.status}")
                body: dict[str, Any] = orjson.loads(await r.read())
                return body
        except (aiohttp.ClientError, TimeoutError) as e:
            raise DrillError(f"cannot read {self.admin_url}{path}: {e}") from None

    async def _metrics(self, session: aiohttp.ClientSession, api_url: str) -> dict[str, float]:
        try:
            async with session.get(api_url + "/metrics") as r:
                return metric_totals(await r.text())
        except (aiohttp.ClientError, TimeoutError) as e:
            raise DrillError(f"cannot scrape {api_url}/metrics: {e}") from None

    async def _post_fault(
        self, session: aiohttp.ClientSession, replica_url: str, fault: dict[str, Any]
    ) -> bool:
        """True when the replica took the fault; False when it did not answer."""
        try:
            async with session.post(f"{replica_url}/sim/fault", json=fault) as r:
                if r.status != 200:
                    raise DrillError(f"{replica_url}/sim/fault answered {r.status}")
                return True
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def _max_model_len(self, session: aiohttp.ClientSession, replica_url: str) -> int:
        try:
            async with session.get(f"{replica_url}/v1/models") as r:
                body = orjson.loads(await r.read())
            return int(body["data"][0]["max_model_len"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, IndexError, TypeError):
            return DEFAULT_MAX_MODEL_LEN

    async def _health(self, session: aiohttp.ClientSession, replica_url: str) -> int:
        try:
            async with session.get(f"{replica_url}/health") as r:
                return r.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    # -- the drill ----------------------------------------------------------------------

    async def run(self) -> DrillReport:
        timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await self._run(session)

    async def _preflight(
        self, session: aiohttp.ClientSession, state: dict[str, Any], target: dict[str, Any]
    ) -> None:
        if self.scenario == "rolling-restart":
            # GET is harmless: it reports the last rollout (404 `no_rollout` when none has
            # run) where the endpoint exists, and is a plain 404 where it does not.
            status, body = await self._admin_call(session, "GET", "/admin/rollout")
            if status == 404 and _error_code(body) != "no_rollout":
                raise DrillError(ROLLOUT_MISSING, EXIT_UNAVAILABLE)
            if status == 200 and isinstance(body, dict) and body.get("state") == "running":
                raise DrillError("a rollout is already running on this gateway: drill after it")
            if status not in (200, 404):
                raise DrillError(f"GET /admin/rollout answered {status}: {_error_message(body)}")
            return
        if self.scenario == "pool-loss":
            pools = [p for p in state.get("pools") or () if p.get("replicas")]
            if len(pools) < 2:
                raise DrillError(
                    "pool-loss needs two pools or more (gateway `pools:`): with one, losing it "
                    "is an outage to measure with a fleet, not a failover to drill"
                )
            for replica in self._pool_replicas(state, str(target["id"])):
                await self._takes_faults(session, replica)
            return
        if self.scenario in ("crash-mid-stream", "hang"):
            # Without --target the fault goes to the busiest replica at injection time,
            # so every candidate must take faults.
            candidates = (
                [target]
                if self.wanted_target is not None
                else [
                    r
                    for r in state["replicas"]
                    if r.get("routable") and r.get("model") == target.get("model")
                ]
            )
            for replica in candidates:
                await self._takes_faults(session, replica)

    async def _takes_faults(self, session: aiohttp.ClientSession, replica: dict[str, Any]) -> None:
        url = replica["url"]
        try:
            async with session.get(f"{url}/sim/state") as r:
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise DrillError(f"cannot reach replica {replica['id']} at {url}: {e}") from None
        if status != 200:
            raise DrillError(
                f"replica {replica['id']} ({url}) takes no faults: this drill needs "
                "`seawall sim --enable-faults` replicas"
            )

    @staticmethod
    def _pool_replicas(state: dict[str, Any], pool: str) -> list[dict[str, Any]]:
        return [r for r in state.get("replicas") or () if r.get("pool") == pool]

    async def _run(self, session: aiohttp.ClientSession) -> DrillReport:
        started = clock.monotonic()
        deadline = started + self.duration_s
        state = await self._get_json(session, "/admin/state")
        api_url = str(state.get("api_url") or "").rstrip("/")
        if not api_url:
            raise DrillError("the admin API does not say where the OpenAI API listens (api_url)")
        if self.scenario == "pool-loss":
            target = self._pool_target(state)
        else:
            target = pick_target(state, self.wanted_target)
        model = str(target.get("model") or "")
        await self._preflight(session, state, target)
        fleet_wide = self.scenario in ("preemption-storm", "overload", "rolling-restart")
        before_replicas = {r["id"]: r for r in state["replicas"]}
        metrics_before = await self._metrics(session, api_url)

        results: list[RequestResult] = []
        load_s = self.duration_s * LOAD_SHARE
        grace_s = max(0.5, self.duration_s - load_s)
        baseline_s = max(MIN_BASELINE_S, self.duration_s * BASELINE_SHARE)
        if baseline_s >= load_s:
            raise DrillError(f"--duration {self.duration_s:g} s is too short for a drill")
        stop = asyncio.Event()
        load = asyncio.create_task(
            run_load(
                api_url,
                model,
                concurrency=self.concurrency,
                duration_s=load_s,
                max_requests=self._max_requests(self.concurrency, load_s),
                prompt_tokens=self.prompt_tokens,
                max_tokens=self.max_tokens,
                api_key=self.api_key,
                on_result=results.append,
                grace_s=grace_s,
                stop=stop,
            )
        )
        watcher = asyncio.create_task(self._watch(session, deadline))
        extra: asyncio.Task[Any] | None = None
        fault: dict[str, Any] | None = None
        inject_at = started
        health_during: int | None = None
        try:
            self.log(
                f"baseline: {baseline_s:.1f} s of steady load at concurrency {self.concurrency}"
            )
            await _sleep_until(started + baseline_s, load)
            if self.scenario in ("crash-mid-stream", "hang"):
                if self.wanted_target is None:
                    now_state = await self._get_json(session, "/admin/state")
                    target = busiest(now_state, model) or target
                    before_replicas = {r["id"]: r for r in now_state["replicas"]}
                self.health_url = target["url"]
            inject_at = clock.monotonic()
            fault, extra = await self._inject(session, api_url, model, target, deadline)
            self.log(f"injected {self.scenario} at +{inject_at - started:.1f} s")
            if self.scenario == "pool-loss":
                back_at = inject_at + POOL_LOSS_SHARE * (started + load_s - inject_at)
                extra = asyncio.create_task(self._pool_returns(session, state, target, back_at))
            if self.scenario == "hang":
                health_during = await self._health(session, target["url"])
            await _sleep_until(deadline, load)
        finally:
            # Bounded either way: the load stops by itself at load_s + grace_s.
            loads = [load] + ([extra] if extra is not None else [])
            await asyncio.wait(loads, timeout=grace_s + 1.0)  # never raises
            stop.set()
            tasks = [watcher, load] + ([extra] if extra is not None else [])
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # Cleared even when the drill failed: a drill must not leave a fault behind.
            faulted = fault is not None and self.scenario in ("crash-mid-stream", "hang")
            cleared = await self._clear(session, target) if faulted else False
            if self.scenario == "pool-loss" and fault is not None:
                cleared = await self._clear_pool(session, state, target)
        for task in loads:
            failure = None if task.cancelled() else task.exception()
            if failure is not None:
                raise DrillError(f"the load generator failed: {failure!r}")
        pool_figures = self._pool_figures(model, target, inject_at, results)
        end = clock.monotonic()
        metrics_after = await self._metrics(session, api_url)
        final = await self._get_json(session, "/admin/state")

        # A client notices a fault when its request ends, so each result counts in the
        # phase in which it ended; a stream cut by a crash started in the baseline.
        before = [r for r in results if r.started_at + r.total_s < inject_at]
        during = [r for r in results if r.started_at + r.total_s >= inject_at]
        if self.scenario == "rolling-restart":
            detection_s, detected_as = None, None  # a rollout is announced, not detected
        elif self.scenario == "pool-loss":
            detection_s = pool_figures["failover_s"]
            detected_as = f"{model} served from another pool" if detection_s is not None else None
        else:
            detection_s, detected_as = self._detection(
                before_replicas, None if fleet_wide else target["id"], inject_at
            )
        inflight_at_fault = self._inflight_at_crash(target["id"], inject_at)
        readmitted = self._readmitted(target["id"], inject_at) if faulted else 0
        if readmitted:
            self.notes.append(
                f"the fleet put {target['id']} back in routing {readmitted} time(s) while the "
                "fault was in force: a restart that does nothing (actuator `none`) followed "
                "by a passing /health readmits a broken engine"
            )
        d_requests = metrics_after[REQUESTS] - metrics_before[REQUESTS]
        d_attempts = metrics_after[UPSTREAM_ATTEMPTS] - metrics_before[UPSTREAM_ATTEMPTS]
        fault_s = max(1e-9, end - inject_at)
        preemptions = {
            r["id"]: _preemptions(r) - _preemptions(before_replicas.get(r["id"], {}))
            for r in final.get("replicas", [])
        }
        self._explain(target, final, preemptions, detection_s, cleared)
        all_results = before + during + self.burst
        errors = Counter(r.error for r in all_results if r.error)
        return DrillReport(
            scenario=self.scenario,
            target=None if fleet_wide else str(target["id"]),
            model=model,
            api_url=api_url,
            fault=fault,
            baseline_s=inject_at - started,
            fault_s=end - inject_at,
            baseline=phase_figures(before),
            during=phase_figures(during),
            burst=phase_figures(self.burst) if self.burst else None,
            errors=dict(errors.most_common(5)),
            streams_dropped=sum(1 for r in all_results if r.outcome == "dropped"),
            requests_failed=sum(1 for r in all_results if r.outcome == "failed"),
            requests=len(all_results),
            detection_s=detection_s,
            detected_as=detected_as,
            target_inflight_at_fault=inflight_at_fault,
            retry_amplification=d_attempts / d_requests if d_requests > 0 else None,
            upstream_attempts=d_attempts,
            shed_per_s=(metrics_after[SHED] - metrics_before[SHED]) / fault_s,
            preemptions=preemptions,
            health_during_fault=health_during,
            readmitted=readmitted,
            rollout=self.rollout,
            pool=str(target["id"]) if self.scenario == "pool-loss" else None,
            failover_s=pool_figures["failover_s"],
            failback_s=pool_figures["failback_s"],
            failed_before_first_token=sum(
                1 for r in all_results if r.outcome == "failed" and r.ttft_s is None
            ),
            retries=metrics_after[RETRIES] - metrics_before[RETRIES],
            cleared=cleared,
            notes=self.notes,
        )

    @staticmethod
    def _max_requests(concurrency: int, seconds: float) -> int:
        # A ceiling far above what a worker can finish (one request per ~5 ms), so the
        # time bound ends the load, while the count bound still exists.
        return concurrency * max(1, math.ceil(seconds)) * 200

    async def _inject(
        self,
        session: aiohttp.ClientSession,
        api_url: str,
        model: str,
        target: dict[str, Any],
        deadline: float,
    ) -> tuple[dict[str, Any] | None, asyncio.Task[Any] | None]:
        remaining_s = max(0.1, (deadline - clock.monotonic()) - self.duration_s * (1 - LOAD_SHARE))
        match self.scenario:
            case "crash-mid-stream":
                fault = {"kind": "crash", "after_tokens": self.crash_after_tokens}
                if not await self._post_fault(session, target["url"], fault):
                    raise DrillError(f"replica {target['id']} did not answer the fault")
                return fault, None
            case "hang":
                fault = {"kind": "hang", "running": "keep"}
                if not await self._post_fault(session, target["url"], fault):
                    raise DrillError(f"replica {target['id']} did not answer the fault")
                return fault, None
            case "preemption-storm" | "overload":
                storm = self.scenario == "preemption-storm"
                prompt_tokens, max_tokens = self.prompt_tokens, self.max_tokens * 2
                if storm:
                    context = await self._max_model_len(session, target["url"])
                    # make_prompt's words are about two tokens each in the sim's tokenizer
                    prompt_tokens = int(context * STORM_CONTEXT_SHARE / 2 / 2)
                    max_tokens = int(context * STORM_CONTEXT_SHARE / 2)
                concurrency = self.concurrency * (STORM_FACTOR if storm else OVERLOAD_FACTOR)
                extra = asyncio.create_task(
                    run_load(
                        api_url,
                        model,
                        concurrency=concurrency,
                        duration_s=remaining_s,
                        max_requests=self._max_requests(concurrency, remaining_s),
                        prompt_tokens=prompt_tokens,
                        max_tokens=max_tokens,
                        api_key=self.api_key,
                        on_result=self.burst.append,
                        grace_s=0.5,
                    )
                )
                return None, extra
            case "pool-loss":
                # The pool's engines die together: /health answers 503 and every request a
                # 500, the processes stay up (the drill never restarts one) until cleared.
                fault = {"kind": "engine_dead", "grace_s": 24 * 3600}
                for replica in self._pool_replicas(self._state_at_start, str(target["id"])):
                    if not await self._post_fault(session, replica["url"], fault):
                        raise DrillError(f"replica {replica['id']} did not answer the fault")
                return fault, None
            case "rolling-restart":
                options = dict(self.rollout_options)
                status, body = await self._admin_call(session, "POST", "/admin/rollout", options)
                if status == 404 and _error_code(body) is None:
                    raise DrillError(ROLLOUT_MISSING, EXIT_UNAVAILABLE)
                if status == 409 and _error_code(body) == "no_local_actuator":
                    # The endpoint exists, but this gateway has nothing that can start
                    # and stop replicas: not a failed drill, a capability it lacks.
                    raise DrillError(
                        f"rolling-restart: this gateway cannot roll out: {_error_message(body)}",
                        EXIT_UNAVAILABLE,
                    )
                if status >= 300:
                    raise DrillError(
                        f"POST /admin/rollout answered {status}: {_error_message(body)}"
                    )
                return {"rollout": options}, asyncio.create_task(
                    self._follow_rollout(session, deadline)
                )
        raise DrillError(f"unknown scenario {self.scenario!r}")

    async def _admin_call(
        self,
        session: aiohttp.ClientSession,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
    ) -> tuple[int, Any]:
        """(status, JSON body or None) of one admin API call; 401 is always an error."""
        try:
            async with session.request(
                method, self.admin_url + path, headers=self.headers, json=body
            ) as r:
                raw = await r.read()
                status = r.status
        except (aiohttp.ClientError, TimeoutError) as e:
            raise DrillError(f"{method} {self.admin_url}{path} failed: {e}") from None
        if status == 401:
            raise DrillError("the admin API refused the token (--admin-token)")
        try:
            return status, orjson.loads(raw)
        except orjson.JSONDecodeError:
            return status, None

    async def _follow_rollout(self, session: aiohttp.ClientSession, deadline: float) -> None:
        """Keep the gateway's rollout report until it is no longer running, or the
        deadline; the rollout itself is the gateway's, and goes on after the drill."""
        while clock.monotonic() < deadline:
            with contextlib.suppress(DrillError):
                status, body = await self._admin_call(session, "GET", "/admin/rollout")
                if status == 200 and isinstance(body, dict):
                    self.rollout = body
                    if body.get("state") != "running":
                        return
            await asyncio.sleep(ROLLOUT_POLL_S)
        if self.rollout is None or self.rollout.get("state") == "running":
            self.notes.append(
                "the rollout was still running when the drill ended: the figures cover only "
                "its start (it goes on); run with a longer --duration to see it whole"
            )

    async def _watch(self, session: aiohttp.ClientSession, deadline: float) -> None:
        """Sample the admin API (and, once chosen, the target's /health) until the
        deadline."""
        while clock.monotonic() < deadline:
            t = clock.monotonic()
            url = self.health_url
            # The gateway's state first, then the target's /health: a sample whose /health
            # answered then holds a state from before any crash (`_inflight_at_crash`).
            # The other order can pair a /health answer from just before the crash with a
            # state that already counted the dropped streams out.
            try:
                state = await self._get_json(session, "/admin/state")
            except DrillError:
                state = None
            health = await self._health(session, url) if url is not None else None
            if state is not None:
                replicas = {r["id"]: r for r in state["replicas"]}
                self.samples.append(Sample(t, replicas, health, serving_pools(state)))
            await asyncio.sleep(max(0.0, WATCH_INTERVAL_S - (clock.monotonic() - t)))

    def _detection(
        self, before: dict[str, dict[str, Any]], target_id: str | None, inject_at: float
    ) -> tuple[float | None, str | None]:
        for s in self.samples:
            if s.t < inject_at:
                continue
            ids = [target_id] if target_id is not None else sorted(s.replicas)
            for rid in ids:
                now = s.replicas.get(rid)
                if now is None:
                    continue
                why = noticed(self.scenario, before.get(rid, {}), now)
                if why is not None:
                    return s.t - inject_at, f"{rid} {why}"
        return None, None

    def _readmitted(self, target_id: str, inject_at: float) -> int:
        # The watcher stops before the drill clears the fault, so every sample counts.
        count, out = 0, False
        for s in self.samples:
            replica = s.replicas.get(target_id)
            if s.t < inject_at or replica is None:
                continue
            if not replica.get("routable"):
                out = True
            elif out:
                count, out = count + 1, False
        return count

    def _inflight_at_crash(self, target_id: str, inject_at: float) -> int | None:
        """The gateway's in-flight count for the target in the last sample before its
        /health stopped answering (the crash), or None when no crash was seen."""
        if self.scenario != "crash-mid-stream":
            return None
        last: int | None = None
        for s in self.samples:
            if s.t >= inject_at and s.target_health == 0:
                return last
            replica = s.replicas.get(target_id)
            if replica is not None:
                last = int(replica.get("inflight") or 0)
        return None

    def _pool_target(self, state: dict[str, Any]) -> dict[str, Any]:
        """pool-loss: the pool serving the drill's model (or --target, a pool's name)."""
        self._state_at_start = state
        replicas = [r for r in state.get("replicas") or () if r.get("routable")]
        if not replicas:
            raise DrillError("no replica is routable now: a drill needs a healthy fleet to start")
        model = str(sorted(replicas, key=lambda r: str(r["id"]))[0].get("model") or "")
        pool = self.wanted_target or serving_pools(state).get(model)
        if pool is None or not self._pool_replicas(state, pool):
            known = sorted(str(p.get("pool")) for p in state.get("pools") or ())
            raise DrillError(f"no pool {pool!r} with replicas to take down (pools: {known})")
        return {"id": pool, "model": model, "url": None}

    async def _pool_returns(
        self,
        session: aiohttp.ClientSession,
        state: dict[str, Any],
        target: dict[str, Any],
        at: float,
    ) -> None:
        """Bring the pool's engines back at `at`, so the failback can be seen."""
        await asyncio.sleep(max(0.0, at - clock.monotonic()))
        self._pool_back_at = clock.monotonic()
        await self._clear_pool(session, state, target)
        self.log(f"pool {target['id']} back")

    async def _clear_pool(
        self, session: aiohttp.ClientSession, state: dict[str, Any], target: dict[str, Any]
    ) -> bool:
        cleared = True
        for replica in self._pool_replicas(state, str(target["id"])):
            if not await self._post_fault(session, replica["url"], {"kind": "clear"}):
                cleared = False
                self.notes.append(f"could not clear the fault on {replica['id']}")
        return cleared

    def _pool_figures(
        self, model: str, target: dict[str, Any], inject_at: float, results: list[RequestResult]
    ) -> dict[str, float | None]:
        """pool-loss: when the model left the pool, and when it came back."""
        out: dict[str, float | None] = {"failover_s": None, "failback_s": None}
        if self.scenario != "pool-loss":
            return out
        pool = str(target["id"])
        moved_at: float | None = None
        for sample in self.samples:
            if sample.t < inject_at:
                continue
            where = sample.serving.get(model)
            if moved_at is None and where is not None and where != pool:
                moved_at = sample.t
                out["failover_s"] = sample.t - inject_at
            back = self._pool_back_at
            if moved_at is not None and back is not None and sample.t >= back and where == pool:
                out["failback_s"] = sample.t - back
                break
        if out["failover_s"] is None:
            self.notes.append(f"the admin API never showed {model} leave pool {pool}")
        elif out["failback_s"] is None:
            self.notes.append(
                f"{model} had not failed back to {pool} when the drill ended: the failback "
                "hold (gateway `failover.failback_after_s`) is longer than the rest of the "
                "drill; run it with a longer --duration"
            )
        return out

    async def _clear(self, session: aiohttp.ClientSession, target: dict[str, Any]) -> bool:
        cleared = await self._post_fault(session, target["url"], {"kind": "clear"})
        if self.scenario == "crash-mid-stream" and not cleared:
            self.notes.append(
                f"replica {target['id']} crashed and its process is gone: restart it (or let "
                "its supervisor) before the next drill"
            )
        elif not cleared:
            self.notes.append(f"could not clear the fault on {target['id']} ({target['url']})")
        return cleared

    def _explain(
        self,
        target: dict[str, Any],
        final: dict[str, Any],
        preemptions: dict[str, float],
        detection_s: float | None,
        cleared: bool,
    ) -> None:
        if detection_s is None and self.scenario in ("crash-mid-stream", "hang"):
            self.notes.append(
                f"the admin API never showed {target['id']} leave `ready` within the drill: "
                "check the fleet intervals (liveness, deep probe, watchdog)"
            )
        if self.scenario == "preemption-storm" and not any(v > 0 for v in preemptions.values()):
            self.notes.append(
                "no preemptions happened: the KV cache never filled. Start the sims with a "
                "small KV cache (e.g. `seawall sim --kv-blocks 160 --max-model-len 2048`) "
                "to drill a storm"
            )
        if self.scenario == "crash-mid-stream" and cleared:
            self.notes.append(
                f"replica {target['id']} still answered after the drill: the crash fault "
                "did not fire (no tokens generated on it?)"
            )


async def _sleep_until(at: float, load: asyncio.Task[Any]) -> None:
    """Sleep until monotonic `at`, or less if the load ends first."""
    remaining = at - clock.monotonic()
    if remaining > 0:
        await asyncio.wait([load], timeout=remaining)


def _error_code(body: Any) -> str | None:
    """The `error.code` of an OpenAI-style error body, or None (not one of ours)."""
    err = body.get("error") if isinstance(body, dict) else None
    code = err.get("code") if isinstance(err, dict) else None
    return code if isinstance(code, str) else None


def _error_message(body: Any) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    message = err.get("message") if isinstance(err, dict) else None
    return message if isinstance(message, str) else "(no message)"


def _preemptions(replica: dict[str, Any]) -> float:
    load = replica.get("load") or {}
    return float(load.get("preemptions_total") or 0.0)
