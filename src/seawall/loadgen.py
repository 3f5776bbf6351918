"""A bounded streaming load generator for the demo, drills, rollouts and benchmarks.

Owns: sending OpenAI-style completion or chat requests at a fixed concurrency, reading
each SSE stream to the end, recording per request what a client would notice (status,
TTFT, total time, tokens, whether the stream ended cleanly), and the summary.

Must not: run unbounded. Every run stops by itself at `max_requests` OR `duration_s`,
whichever comes first; requests still in flight get `grace_s` to finish and are then cut
(and reported as `cut`, not as failures of the system under test).

Outcomes, as a client sees them:
  ok       200, and the stream ended with `data: [DONE]` and no error event
  failed   a non-200 answer, or an error before the first token (nothing reached the user)
  dropped  the stream started (first token arrived) but did not finish cleanly: the
           user saw a half-written answer; this is the failure Seawall exists to prevent
  cut      still running when the load generator's own time ran out
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from seawall import clock

Outcome = Literal["ok", "failed", "dropped", "cut"]


@dataclass(frozen=True, slots=True)
class RequestResult:
    outcome: Outcome
    status: int  # HTTP status; 0 when no response arrived
    ttft_s: float | None  # None when no token arrived (or not streaming)
    total_s: float
    tokens: int  # completion tokens (usage when reported, else content chunks)
    clean_end: bool  # `[DONE]` seen and no error event
    error: str = ""
    started_at: float = 0.0  # monotonic seconds


@dataclass(frozen=True, slots=True)
class LoadReport:
    requests: int
    ok: int
    failed: int
    dropped: int
    cut: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    tokens: int
    duration_s: float
    tokens_per_s: float
    statuses: dict[int, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # most common first, at most 5

    def line(self) -> str:
        """One line for a terminal or a log."""
        return (
            f"requests {self.requests}: ok {self.ok}, failed {self.failed}, "
            f"dropped {self.dropped}, cut {self.cut} | TTFT p50 {_ms(self.ttft_p50_s)} "
            f"p99 {_ms(self.ttft_p99_s)} | {self.tokens_per_s:.1f} tokens/s"
        )


def _ms(value_s: float | None) -> str:
    return "-" if value_s is None else f"{value_s * 1000:.0f}ms"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def summarise(results: Sequence[RequestResult], duration_s: float) -> LoadReport:
    """The report for a set of results over `duration_s` seconds of load."""
    outcomes = Counter(r.outcome for r in results)
    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    tokens = sum(r.tokens for r in results)
    errors = Counter(r.error for r in results if r.error)
    return LoadReport(
        requests=len(results),
        ok=outcomes["ok"],
        failed=outcomes["failed"],
        dropped=outcomes["dropped"],
        cut=outcomes["cut"],
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p99_s=percentile(ttfts, 99),
        tokens=tokens,
        duration_s=duration_s,
        tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        statuses=dict(Counter(r.status for r in results)),
        errors=dict(errors.most_common(5)),
    )


def make_prompt(prompt_tokens: int) -> str:
    """About `prompt_tokens` tokens of plain words (one short word is one token in
    common tokenizers); varied so prefix caches do not turn every request into a hit."""
    words = ("ocean", "wall", "tide", "stone", "harbor", "light", "wave", "sand")
    return " ".join(words[i % len(words)] for i in range(max(1, prompt_tokens)))


def request_body(
    model: str, prompt: str, max_tokens: int, *, stream: bool, chat: bool
) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class _StreamState:
    """What one SSE stream has shown so far; `feed` is pure over the event data."""

    first_token: bool = False
    chunks_with_text: int = 0
    usage_tokens: int | None = None
    done: bool = False
    error: str = ""

    def feed(self, data: bytes) -> bool:
        """Take one `data:` payload; returns True when it carried the first token."""
        if data == b"[DONE]":
            self.done = True
            return False
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            self.error = self.error or "malformed SSE event"
            return False
        if not isinstance(event, dict):
            return False
        if "error" in event:
            err = event["error"]
            message = err.get("message", "") if isinstance(err, dict) else str(err)
            self.error = self.error or f"error event: {message}"[:200]
            return False
        usage = event.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.usage_tokens = usage["completion_tokens"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            if choice.get("finish_reason") == "abort":
                # vLLM ends in-flight streams this way when it shuts down: the answer
                # is cut short even though [DONE] follows.
                self.error = self.error or "finish_reason abort"
            delta = choice.get("delta")
            text = choice.get("text") or (delta.get("content") if isinstance(delta, dict) else "")
            if text:
                self.chunks_with_text += 1
                if not self.first_token:
                    self.first_token = True
                    return True
        return False


async def _one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    stream: bool,
) -> RequestResult:
    started = clock.monotonic()
    state = _StreamState()
    ttft_s: float | None = None
    status = 0
    try:
        async with session.post(url, data=orjson.dumps(body), headers=headers) as resp:
            status = resp.status
            if status != 200:
                text = (await resp.text())[:200]
                return RequestResult(
                    "failed", status, None, clock.monotonic() - started, 0, False,
                    f"HTTP {status}: {text}", started,
                )  # fmt: skip
            if not stream:
                payload = orjson.loads(await resp.read())
                usage = payload.get("usage") or {}
                tokens = int(usage.get("completion_tokens") or 0)
                return RequestResult(
                    "ok", status, None, clock.monotonic() - started, tokens, True, "", started
                )
            buffer = b""
            # Read on after [DONE] to the end of the body, as the OpenAI SDK does: leaving
            # early resets the connection under a server still finishing its response.
            async for raw in resp.content:
                buffer += raw
                if not buffer.endswith(b"\n"):
                    continue  # a line split across reads
                line, buffer = buffer.strip(), b""
                if not line.startswith(b"data:"):
                    continue
                if state.feed(line[5:].strip()) and ttft_s is None:
                    ttft_s = clock.monotonic() - started
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
        if not state.done:  # after [DONE] the user already has the whole answer
            state.error = state.error or f"{type(e).__name__}: {e}"[:200]
    total_s = clock.monotonic() - started
    tokens = state.usage_tokens if state.usage_tokens is not None else state.chunks_with_text
    clean = state.done and not state.error
    if clean:
        outcome: Outcome = "ok"
    elif state.first_token:
        outcome = "dropped"
    else:
        outcome = "failed"
    error = state.error or ("" if clean else "stream ended without [DONE]")
    return RequestResult(outcome, status, ttft_s, total_s, tokens, clean, error, started)


async def run_load(
    base_url: str,
    model: str,
    *,
    concurrency: int,
    duration_s: float,
    max_requests: int,
    prompt_tokens: int = 64,
    max_tokens: int = 32,
    stream: bool = True,
    api_key: str | None = None,
    chat: bool = False,
    on_result: Callable[[RequestResult], None] | None = None,
    grace_s: float = 10.0,
    stop: asyncio.Event | None = None,
    connect_timeout_s: float = 5.0,
    pause_after_error_s: float = 0.1,
) -> LoadReport:
    """Send requests from `concurrency` workers until `max_requests` have been started
    or `duration_s` has passed (or `stop` is set); in-flight requests then get `grace_s`.
    A worker whose request got no answer at all pauses `pause_after_error_s` before its
    next. Returns when everything has finished or been cut."""
    if concurrency < 1 or max_requests < 0 or duration_s < 0:
        raise ValueError("concurrency must be >= 1; max_requests and duration_s >= 0")
    path = "/v1/chat/completions" if chat else "/v1/completions"
    url = base_url.rstrip("/") + path
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    prompt = make_prompt(prompt_tokens)
    results: list[RequestResult] = []
    issued = 0
    started_at = clock.monotonic()
    stop_at = started_at + duration_s
    inflight: dict[asyncio.Task[RequestResult], float] = {}

    def record(result: RequestResult) -> None:
        results.append(result)
        if on_result is not None:
            on_result(result)

    async def worker(session: aiohttp.ClientSession, n: int) -> None:
        nonlocal issued
        while issued < max_requests and clock.monotonic() < stop_at:
            if stop is not None and stop.is_set():
                return
            issued += 1
            # Vary the prompt per request so a prefix cache cannot hide the load.
            body = request_body(
                model, f"{n}-{issued} {prompt}", max_tokens, stream=stream, chat=chat
            )
            task = asyncio.create_task(_one_request(session, url, body, headers, stream))
            inflight[task] = clock.monotonic()
            try:
                result = await task
            except asyncio.CancelledError:
                if not task.cancelled():
                    raise  # we were cancelled, not the request
                result = RequestResult(
                    "cut", 0, None, clock.monotonic() - inflight[task], 0, False,
                    "cut at the load generator's deadline", inflight[task],
                )  # fmt: skip
            finally:
                inflight.pop(task, None)
            record(result)
            if result.status == 0 and result.outcome == "failed" and pause_after_error_s > 0:
                # Nothing answered (refused, reset): do not spin on a dead target. Stop
                # waits here too, so a stop request is not delayed by the pause.
                stopped = stop.wait() if stop is not None else asyncio.sleep(pause_after_error_s)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopped, pause_after_error_s)

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        workers = [asyncio.create_task(worker(session, n)) for n in range(concurrency)]
        stopper = asyncio.create_task(stop.wait()) if stop is not None else None
        try:
            # Phase 1: until the load ends (time or count) or someone asks us to stop.
            running: set[asyncio.Task[Any]] = set(workers)
            while running and clock.monotonic() < stop_at:
                if stopper is not None and stopper.done():
                    break
                watch = running | ({stopper} if stopper is not None else set())
                done, _ = await asyncio.wait(
                    watch,
                    timeout=max(0.0, stop_at - clock.monotonic()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                running -= done
            # Phase 2: no new request starts now; in-flight ones get the grace period.
            if running:
                _, late = await asyncio.wait(running, timeout=grace_s)
                if late:
                    for task in list(inflight):
                        task.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
        finally:
            if stopper is not None:
                stopper.cancel()
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)
    return summarise(results, clock.monotonic() - started_at)
