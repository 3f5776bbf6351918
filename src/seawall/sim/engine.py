"""The emulator's engine loop: runs scheduler steps in time and hands tokens to requests.

Owns: the asyncio task that calls `Scheduler.step()`, sleeps the step's cost (times the
`slow` factor) measured from `seawall.clock`, then delivers the step's tokens to each
request's `Stream`; request timestamps and every metric that vLLM records per step or per
finished request; faults that act on the engine (hang, slow, engine death, mid-stream
errors, crash after N tokens); abort and drain at shutdown.

Must not: speak HTTP or build response bodies (that is `server`), or decide scheduling
(that is `scheduler`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
from collections.abc import Callable

from seawall import clock
from seawall.errors import ApiError
from seawall.sim import faults as fl
from seawall.sim import textgen
from seawall.sim.metrics import SimMetrics
from seawall.sim.scheduler import FinishReason, Scheduler, SimRequest, StepResult

# EngineDeadError.CLIENT_MESSAGE in vLLM 0.33
ENGINE_DEAD_MESSAGE = "The server had an error while processing your request."
QUEUE_FULL_MESSAGE = (
    "The engine is currently busy and cannot accept new requests. Please try again later or "
    "on a different instance."
)
TOKEN_BACKLOG_MESSAGE = (
    "The engine has reached its prefill token backlog limit. Please try again later or on a "
    "different instance."
)
# GenerationError's text: what a request-level engine failure (a KV-load failure, an
# `errors` fault) gives, 500 before a response starts or as a stream's error event
INJECTED_ERROR_MESSAGE = "Internal server error"


def engine_dead_error() -> ApiError:
    return ApiError(500, ENGINE_DEAD_MESSAGE, type="InternalServerError", code=500)


class Stream:
    """One request as its HTTP handler sees it: tokens to send, and how it ended."""

    __slots__ = (
        "arrival_s",
        "error",
        "fail_after_tokens",
        "finish",
        "first_scheduled_s",
        "first_token_s",
        "last_token_s",
        "max_tokens",
        "params_n",
        "pending",
        "request",
        "stop",
        "stop_reason",
        "stop_text_len",
        "streaming",
        "text",
        "waiter",
    )

    def __init__(
        self,
        request: SimRequest,
        arrival_s: float,
        stop: tuple[str, ...] = (),
        fail_after_tokens: int | None = None,
        streaming: bool = True,
    ) -> None:
        self.request = request
        # a non-streaming handler is woken only at the end, not once per token
        self.streaming = streaming
        # the `n` of the request, on its first sequence only: vLLM observes it once
        self.params_n: int | None = 1
        self.arrival_s = arrival_s
        self.max_tokens = request.max_tokens
        self.stop = stop
        self.fail_after_tokens = fail_after_tokens
        self.pending: list[int] = []
        self.finish: FinishReason | None = None
        self.error: ApiError | None = None
        self.stop_reason: str | int | None = None
        self.stop_text_len: int | None = None
        self.text = ""  # kept only when there are stop strings to search
        self.first_scheduled_s: float | None = None
        self.first_token_s: float | None = None
        self.last_token_s: float | None = None
        self.waiter: asyncio.Future[None] | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.request.output_ids)

    def wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next_tokens(self) -> list[int]:
        """Wait for tokens or the end; returns the tokens not yet taken (maybe none)."""
        while not self.pending and self.finish is None:
            self.waiter = asyncio.get_running_loop().create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        taken = self.pending
        self.pending = []
        return taken


async def wait_any(streams: list[Stream]) -> None:
    """Wait until one of the streams has tokens or has ended (one waiter shared by all,
    so a step that feeds several wakes the writer once)."""
    if any(s.pending or s.finish is not None for s in streams):
        return
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    for s in streams:
        s.waiter = waiter
    try:
        await waiter
    finally:
        for s in streams:
            if s.waiter is waiter:
                s.waiter = None


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        metrics: SimMetrics,
        seed: int,
        on_crash: Callable[[], None],
        on_engine_dead: Callable[[float], None],
        max_num_queued_reqs: int | None = None,
        max_num_queued_tokens: int | None = None,
    ) -> None:
        self.max_num_queued_reqs = max_num_queued_reqs
        self.max_num_queued_tokens = max_num_queued_tokens
        self.scheduler = scheduler
        self.metrics = metrics
        self.seed = seed
        self.faults = fl.FaultState()
        self.streams: dict[str, Stream] = {}
        self.accepting = True
        self.dead = False
        self.steps = 0
        self.last_step_cost_s = 0.0
        self._on_crash = on_crash
        self._on_engine_dead = on_engine_dead
        self._work = asyncio.Event()
        self._fault_changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._log_task: asyncio.Task[None] | None = None
        self.prompt_tokens_total = 0
        self._error_ordinal = 0
        self._tokens_since_crash_armed = 0
        self._crash_timer: asyncio.TimerHandle | None = None
        self.generated_tokens_total = 0
        metrics.set_gauges(0, 0, 0.0)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run(), name="sim-engine")
        self._task.add_done_callback(self._engine_task_done)
        self._log_task = loop.create_task(self._log_stats(), name="sim-stat-logger")

    def _engine_task_done(self, task: asyncio.Task[None]) -> None:
        # a bug in the loop must look like what it is to clients: a dead engine
        if task.cancelled() or task.exception() is None:
            return
        print(f"seawall sim: engine loop failed: {task.exception()!r}", file=sys.stderr)
        self._die()
        self._on_engine_dead(5.0)

    async def _log_stats(self) -> None:
        """vLLM's LoggingStatLogger line, every 5 s while there is something to say."""
        interval_s = 5.0
        last_prompt = last_gen = 0.0
        last_preemptions = 0
        while True:
            await asyncio.sleep(interval_s)
            prompt = self.prompt_tokens_total
            gen = float(self.generated_tokens_total)
            s = self.scheduler
            if prompt == last_prompt and gen == last_gen and not s.has_work():
                continue
            preempted = s.num_preemptions_total - last_preemptions
            print(
                f"Engine 000: Avg prompt throughput: {(prompt - last_prompt) / interval_s:.1f} "
                f"tokens/s, Avg generation throughput: {(gen - last_gen) / interval_s:.1f} "
                f"tokens/s, Running: {len(s.running)} reqs, Waiting: {len(s.waiting)} reqs, "
                + (f"Preemptions: {preempted}, " if preempted else "")
                + f"GPU KV cache usage: {100 * s.kv_usage():.1f}%, Prefix cache hit rate: 0.0%",
                flush=True,
            )
            last_prompt, last_gen = prompt, gen
            last_preemptions = s.num_preemptions_total

    async def stop(self) -> None:
        if self._log_task is not None:
            self._log_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._log_task
            self._log_task = None
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def shutdown(self, timeout_s: float) -> None:
        """vLLM's shutdown: refuse new work; abort in-flight (timeout 0) or drain first."""
        self.accepting = False
        if timeout_s > 0:
            deadline = clock.monotonic() + timeout_s
            # The pure scheduler has no completion event to wait on; a 10 ms poll is
            # shorter than one engine step, so the drain ends within a step of its work.
            while self.scheduler.has_work() and clock.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        for request in self.scheduler.abort_all():
            self._finished(request, FinishReason.ABORT, clock.monotonic())
        self._update_gauges()

    # ------------------------------------------------------------------ requests

    def new_request_id(self, prefix: str) -> str:
        # random like vLLM's, so ids stay unique across replicas and restarts
        return f"{prefix}-{secrets.token_hex(16)}"

    def submit(
        self,
        request: SimRequest,
        arrival_s: float,
        stop: tuple[str, ...] = (),
        streaming: bool = True,
        params_n: int | None = 1,
    ) -> Stream:
        """Queue a request; raises the ApiError a client gets when the engine refuses it."""
        if self.dead:
            raise engine_dead_error()
        fail_after: int | None = None
        errors = self.faults.errors
        if errors is not None:
            self._error_ordinal += 1
            if fl.error_draw(self.seed, self._error_ordinal) < errors.rate:
                if errors.when == "before_first_token":
                    self.metrics.success["error"].inc()
                    raise ApiError(500, INJECTED_ERROR_MESSAGE, type="InternalServerError")
                fail_after = errors.after_tokens
        self._check_queue_limits(request)
        stream = Stream(request, arrival_s, stop, fail_after, streaming)
        stream.params_n = params_n
        if not self.accepting:
            # vLLM's _reject_add_in_shutdown: the request ends at once, as aborted
            stream.finish = FinishReason.ABORT
            return stream
        self.scheduler.add(request)
        self.streams[request.request_id] = stream
        self.metrics.waiting.set(len(self.scheduler.waiting))
        self._work.set()
        return stream

    def _check_queue_limits(self, request: SimRequest) -> None:
        """vLLM's optional queue limits: a full queue answers 503 and counts a rejection."""
        waiting = self.scheduler.waiting
        limit = self.max_num_queued_reqs
        if limit is not None and len(waiting) >= limit:
            self.metrics.admission_rejections["max_num_queued_reqs"].inc()
            raise ApiError(503, QUEUE_FULL_MESSAGE)
        limit = self.max_num_queued_tokens
        if limit is not None:
            queued = sum(len(r.prompt_ids) for r in waiting) + len(request.prompt_ids)
            if queued > limit:
                self.metrics.admission_rejections["max_num_queued_tokens"].inc()
                raise ApiError(503, TOKEN_BACKLOG_MESSAGE)

    def abort(self, stream: Stream) -> None:
        """The client went away: free the blocks now; not counted as a finished request."""
        if stream.finish is not None:
            return
        stream.finish = FinishReason.ABORT
        self.streams.pop(stream.request.request_id, None)
        self.scheduler.abort(stream.request.request_id)
        self._update_gauges()

    # ------------------------------------------------------------------ faults

    def apply_fault(self, fault: fl.Fault) -> None:
        self.faults.apply(fault)
        match fault:
            case fl.Clear():
                if self._crash_timer is not None:
                    self._crash_timer.cancel()
                    self._crash_timer = None
                self.dead = False
            case fl.Crash(after_tokens=None, after_s=None):
                self._on_crash()
            case fl.Crash(after_s=after_s) if after_s is not None:
                loop = asyncio.get_running_loop()
                self._crash_timer = loop.call_later(after_s, self._on_crash)
            case fl.Crash():
                self._tokens_since_crash_armed = 0
            case fl.EngineDead(grace_s=grace_s):
                self._die()
                self._on_engine_dead(grace_s)
            case _:
                pass
        self._fault_changed.set()
        self._update_gauges()

    def _die(self) -> None:
        self.dead = True
        now = clock.monotonic()
        for request in self.scheduler.abort_all():
            stream = self.streams.get(request.request_id)
            if stream is not None:
                stream.error = engine_dead_error()
            self._finished(request, FinishReason.ERROR, now, count=False)
        self._update_gauges()

    # ------------------------------------------------------------------ the loop

    async def _run(self) -> None:
        scheduler = self.scheduler
        while True:
            if self.faults.hang is not None or self.dead:
                self._fault_changed.clear()
                await self._fault_changed.wait()
                continue
            if not scheduler.has_work():
                self._work.clear()
                await self._work.wait()
                continue
            started_s = clock.monotonic()
            result = scheduler.step()
            self.steps += 1
            for request in result.first_scheduled:
                stream = self.streams.get(request.request_id)
                if stream is not None:
                    stream.first_scheduled_s = started_s
                    self.metrics.queue_time.observe(started_s - stream.arrival_s)
            self.last_step_cost_s = result.cost_s * self.faults.slow_factor
            delay_s = started_s + self.last_step_cost_s - clock.monotonic()
            if result.idle:
                # work is queued but nothing could run: do not spin the CPU
                delay_s = max(delay_s, 0.001)
            # always yield, so that handlers run between steps even at zero cost
            await asyncio.sleep(delay_s if delay_s > 0 else 0)
            if self._died_meanwhile():
                continue
            self._deliver(result, clock.monotonic())
            if self._crash_due():
                # let the handlers woken above write what they have, then die
                await asyncio.sleep(0)
                await asyncio.sleep(0)
                self._on_crash()

    def _died_meanwhile(self) -> bool:
        # a method, not the attribute: the fault route can flip it while we slept
        return self.dead

    def _crash_due(self) -> bool:
        crash = self.faults.crash
        return (
            crash is not None
            and crash.after_tokens is not None
            and self._tokens_since_crash_armed >= crash.after_tokens
        )

    def _deliver(self, result: StepResult, now: float) -> None:
        metrics = self.metrics
        streams = self.streams
        itl = metrics.observe_itl
        prompt_tokens = 0
        cached_tokens = 0
        for request, token in result.outputs:
            stream = streams.get(request.request_id)
            if stream is None:
                continue
            stream.pending.append(token)
            if stream.first_token_s is None:
                stream.first_token_s = now
                metrics.ttft.observe(now - stream.arrival_s)
                prompt_tokens += len(request.prompt_ids)
                cached_tokens += request.num_cached_tokens
            else:
                itl(now - (stream.last_token_s or now))
            stream.last_token_s = now
            if stream.stop and request.stop_reason is None:
                # a stop token is not part of the text (vLLM does not detokenize it)
                self._check_stop(stream, token)
            if (
                stream.fail_after_tokens is not None
                and request.num_output >= stream.fail_after_tokens
                and stream.finish is None
                and stream.stop_reason is None
            ):
                stream.error = ApiError(500, INJECTED_ERROR_MESSAGE, type="InternalServerError")
                self.scheduler.finish(request.request_id, FinishReason.ERROR)
                self._finished(request, FinishReason.ERROR, now)
            if stream.streaming:
                stream.wake()
        for request in result.finished:
            self._finished(request, request.finish_reason or FinishReason.STOP, now)
        num_tokens = result.num_prefill_tokens + result.num_decode_tokens
        if result.preempted:
            metrics.preemptions.inc(len(result.preempted))
        if prompt_tokens:
            self.prompt_tokens_total += prompt_tokens
            metrics.prompt_tokens.inc(prompt_tokens)
            metrics.prompt_tokens_local_compute.inc(prompt_tokens - cached_tokens)
        if cached_tokens:
            metrics.prompt_tokens_local_cache_hit.inc(cached_tokens)
            metrics.prompt_tokens_cached.inc(cached_tokens)
            metrics.prompt_tokens_cached_device.inc(cached_tokens)
        if result.prefix_queries:
            metrics.prefix_queries.inc(result.prefix_queries)
            metrics.prefix_hits.inc(result.prefix_hits)
        if result.num_decode_tokens:
            metrics.generation_tokens.inc(result.num_decode_tokens)
            self.generated_tokens_total += result.num_decode_tokens
            self._tokens_since_crash_armed += result.num_decode_tokens
        if num_tokens:
            metrics.iteration_tokens.observe(num_tokens)
        self._update_gauges()

    def _check_stop(self, stream: Stream, token: int) -> None:
        if stream.finish is not None or stream.stop_reason is not None:
            return
        before = len(stream.text)
        stream.text += textgen.token_text(token)
        longest = max(len(s) for s in stream.stop)
        window_start = max(0, before - longest + 1)
        for stop in stream.stop:
            at = stream.text.find(stop, window_start)
            if at >= 0:
                stream.stop_reason = stop
                stream.stop_text_len = at
                request = stream.request
                self.scheduler.finish(request.request_id, FinishReason.STOP)
                self._finished(request, FinishReason.STOP, clock.monotonic())
                return

    def _finished(
        self, request: SimRequest, reason: FinishReason, now: float, count: bool = True
    ) -> None:
        """Record vLLM's per-request stats (only for requests the engine still tracks)."""
        stream = self.streams.pop(request.request_id, None)
        if stream is None:
            return
        stream.finish = reason
        if request.stop_reason is not None and stream.stop_reason is None:
            stream.stop_reason = request.stop_reason
        stream.wake()
        if not count:
            return
        m = self.metrics
        m.success[reason.value].inc()
        m.e2e.observe(now - stream.arrival_s)
        m.request_prompt_tokens.observe(len(request.prompt_ids))
        m.request_generation_tokens.observe(request.num_output)
        m.request_max_num_generation_tokens.observe(stream.max_tokens)
        if stream.params_n is not None:
            m.request_params_n.observe(stream.params_n)
        m.request_params_max_tokens.observe(stream.max_tokens)
        m.request_num_preemptions.observe(request.num_preemptions)
        m.request_prefill_kv_computed_tokens.observe(
            len(request.prompt_ids) - request.num_cached_tokens
        )
        scheduled_s = stream.first_scheduled_s
        first_s = stream.first_token_s
        last_s = stream.last_token_s
        if scheduled_s is not None and first_s is not None and last_s is not None:
            m.prefill_time.observe(first_s - scheduled_s)
            m.decode_time.observe(last_s - first_s)
            m.inference_time.observe(last_s - scheduled_s)
            if request.num_output > 1:
                m.request_tpot.observe((last_s - first_s) / (request.num_output - 1))

    def _update_gauges(self) -> None:
        scheduler = self.scheduler
        hang = self.faults.hang
        running = 0 if hang is not None and hang.running == "zero" else len(scheduler.running)
        self.metrics.set_gauges(running, len(scheduler.waiting), scheduler.kv_usage())

    def snapshot(self) -> dict[str, object]:
        """Scheduler internals for `GET /sim/state` (tests and debugging)."""
        s = self.scheduler
        return {
            "free_blocks": s.free_blocks,
            "prefix_caching": s.config.enable_prefix_caching,
            "total_blocks": s.config.num_blocks,
            "usable_blocks": s.usable_blocks,
            "kv_usage": s.kv_usage(),
            "running": [r.request_id for r in s.running],
            "waiting": [r.request_id for r in s.waiting],
            "num_preemptions_total": s.num_preemptions_total,
            "steps": self.steps,
            "last_step_cost_s": self.last_step_cost_s,
            "generated_tokens_total": self.generated_tokens_total,
            "dead": self.dead,
            "accepting": self.accepting,
            "hang": self.faults.hang is not None,
            "slow_factor": self.faults.slow_factor,
        }
