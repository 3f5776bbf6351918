"""Probes: the fleet monitor's HTTP calls to one replica, each bounded by a timeout.

Owns three questions asked over HTTP: is the server process answering (`liveness`, GET
/health), can it actually generate a token (`deep_probe`, a real one-token completion),
and what load does it report (`scrape`, GET /metrics through an engine adapter).

Must not decide: a failed probe is a fact handed to the monitor, which feeds the health
policy. Never raises for a replica's failure (only for programming errors), so one bad
replica cannot break the monitor's loop. The caller owns the `aiohttp.ClientSession`.

Why a deep probe at all: vLLM's /health answers 200 as long as the engine process has
not errored, including while the engine is hung mid-step. Only asking for a token proves
the engine moves.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from seawall import clock
from seawall.fleet.adapters import Adapter, adapter_for, detect_engine
from seawall.fleet.view import EngineLoad

# Plain Accept: with `application/openmetrics-text` prometheus_client 0.26 rewrites
# `vllm:` sample names to `vllm_` (engines reference §1.1); the adapters expect text.
SCRAPE_HEADERS = {"Accept": "*/*"}
DEEP_PROBE_PROMPT = "Hi"


@dataclass(frozen=True, slots=True)
class ProbeResult:
    ok: bool
    latency_s: float
    status: int | None = None  # HTTP status when there was a response
    error: str = ""  # "", "timeout", "connect", "http_<status>", "empty_output", "bad_body"
    detail: str = ""

    @property
    def refused(self) -> bool:
        """The server did not accept the connection: not up yet, or gone."""
        return self.error == "connect"


@dataclass(frozen=True, slots=True)
class ScrapeError:
    # "timeout", "connect", "absent" (404 or 501: no /metrics), "http_<status>",
    # "unknown_engine"
    reason: str
    status: int | None = None
    detail: str = ""


async def liveness(
    session: aiohttp.ClientSession,
    url: str,
    timeout_s: float,
    path: str = "/health",
    headers: Mapping[str, str] | None = None,
) -> ProbeResult:
    """GET /health: 200 means the server and (for vLLM) the engine process are alive.
    `headers`: the replica's credential, when it has one (every probe sends it)."""
    started = clock.monotonic()
    try:
        async with session.get(
            _join(url, path), headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            await resp.read()
            latency = clock.monotonic() - started
            if resp.status == 200:
                return ProbeResult(True, latency, resp.status)
            return ProbeResult(False, latency, resp.status, f"http_{resp.status}")
    except Exception as exc:  # every transport failure is a probe result, not a crash
        return _failure(exc, started)


async def deep_probe(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    timeout_s: float,
    path: str = "/v1/completions",
    headers: Mapping[str, str] | None = None,
) -> ProbeResult:
    """A real one-token completion (`max_tokens: 1, temperature: 0`): proves generation moves.

    Fails on any HTTP error, on the timeout, and on an answer with no generated token.
    """
    body = {"model": model, "prompt": DEEP_PROBE_PROMPT, "max_tokens": 1, "temperature": 0}
    started = clock.monotonic()
    try:
        async with session.post(
            _join(url, path),
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})},
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            raw = await resp.read()
            latency = clock.monotonic() - started
            if resp.status != 200:
                return ProbeResult(
                    False,
                    latency,
                    resp.status,
                    f"http_{resp.status}",
                    raw[:200].decode(errors="replace"),
                )
            try:
                data = orjson.loads(raw)
            except orjson.JSONDecodeError:
                return ProbeResult(
                    False, latency, resp.status, "bad_body", raw[:200].decode(errors="replace")
                )
            if not _generated(data):
                return ProbeResult(False, latency, resp.status, "empty_output")
            return ProbeResult(True, latency, resp.status)
    except Exception as exc:
        return _failure(exc, started)


async def scrape_text(
    session: aiohttp.ClientSession,
    url: str,
    timeout_s: float,
    path: str = "/metrics",
    headers: Mapping[str, str] | None = None,
) -> str | ScrapeError:
    try:
        async with session.get(
            _join(url, path),
            headers={**SCRAPE_HEADERS, **headers} if headers else SCRAPE_HEADERS,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            text = await resp.text(errors="replace")
            if resp.status in (404, 501):
                # Plain OpenAI-compatible servers have no /metrics (404), llama-server
                # started without --metrics says so (501): not a failure, the deep probe
                # alone decides for them.
                return ScrapeError("absent", resp.status)
            if resp.status != 200:
                return ScrapeError(f"http_{resp.status}", resp.status, text[:200])
            return text
    except Exception as exc:
        failed = ScrapeError(_error_code(exc), None, repr(exc)[:200])
        forget_failure(exc)
        return failed


async def scrape(
    session: aiohttp.ClientSession,
    url: str,
    adapter: Adapter | None,
    timeout_s: float,
) -> EngineLoad | ScrapeError:
    """GET /metrics and normalise it; with `adapter=None` the engine is detected."""
    text = await scrape_text(session, url, timeout_s)
    if isinstance(text, ScrapeError):
        return text
    if adapter is None:
        kind = detect_engine(text)
        if kind is None:
            return ScrapeError("unknown_engine", 200)
        adapter = adapter_for(kind)
    return adapter.parse(text, scraped_at=clock.monotonic())


def _generated(data: Any) -> bool:
    if not isinstance(data, dict):
        return False
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices:
        return False
    first = choices[0]
    if isinstance(first, dict):
        text = first.get("text")
        if text is None and isinstance(first.get("message"), dict):
            text = first["message"].get("content")
        if text:
            return True
    # One token may decode to "" (a partial UTF-8 byte, or EOS): usage still counts it.
    usage = data.get("usage")
    return isinstance(usage, dict) and int(usage.get("completion_tokens") or 0) >= 1


def _failure(exc: BaseException, started: float) -> ProbeResult:
    failed = ProbeResult(
        False, clock.monotonic() - started, None, _error_code(exc), repr(exc)[:200]
    )
    forget_failure(exc)
    return failed


def forget_failure(exc: BaseException) -> None:
    """Break the reference cycles a failed call leaves: aiohttp's errors keep their
    tracebacks, whose frames hold the errors (and the request, its timer, its socket), so
    each failure would wait for the cycle collector, whose passes stop the event loop and
    every stream on it, and a dead replica fails its probes every second. Clears the
    finished frames' locals (the executing ones, this probe's, are left alone) of the
    error and every error chained to it."""
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        e = pending.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if e.__traceback__ is not None:
            traceback.clear_frames(e.__traceback__)
            e.__traceback__ = None
        pending += (e.__cause__, e.__context__)


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectionRefusedError):
        return "connect"
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientOSError):
        return "reset"
    return "error"


def _join(url: str, path: str) -> str:
    return url.rstrip("/") + path
