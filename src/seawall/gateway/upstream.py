"""One upstream attempt, up to and including the first token, behind the `Upstream` seam.

The gateway holds the client's response until the first token chunk has arrived (vLLM
commits stream headers before any token), so everything that can go wrong before that
point is still a clean, retryable failure: connection refused or reset, a 5xx, an
error event, silence past the time-to-first-token deadline. An attempt either returns
`Opened` or raises one `AttemptFailed` whose `outcome` (an `outcomes.Attempt`) says what
happened; the outcome's rules say whether another replica may be tried.

The reads before the first token are scanned in the upstream's socket callback
(`_Head`), and with a `commit` (the relay's, for a stream to an HTTP/1.1 client)
the first token goes on to the client from that same callback, with the response's
head, before the attempt's coroutine runs: a lone request's first token waits for no
task switch and no bookkeeping (`bench/bench_hop.py --baseline`).

`Upstream` is the seam: the request path (`dispatch.py`, `relay.py`) needs only `open`
and, once a stream is open, the `UpstreamStream` members below. `H1Upstream` is the
production implementation over the hand-written HTTP/1.1 pool (`h1.py`); layer tests
script their own.

It must not decide retries, pick replicas or touch the client: the dispatcher does that.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from seawall import clock
from seawall.gateway.h1 import ConnectFailed, H1Connection, H1Pool, Sink
from seawall.gateway.idle import Expiry
from seawall.gateway.outcomes import Attempt, Failure
from seawall.gateway.replicas import Replica
from seawall.protocol.openai import ParsedRequest
from seawall.protocol.sse import CLASSIFY, Event, Kind, SSEBuffer

if TYPE_CHECKING:
    from seawall.gateway.inflight import Hold

# Bodies of upstream errors are relayed to the client; cap what we hold in memory.
_MAX_ERROR_BODY = 64 * 1024

# Writes a stream's response head and first events to the client, from the upstream's
# socket callback, given the upstream's headers, the head's events and the partial event
# after them; True once written (`relay.Relay.commit`).
Commit = Callable[[Mapping[str, str], list[Event], bytes], bool]
# The relay's `Commit` for one attempt, given the keys that attempt asks the engine for on
# the client's behalf, to be stripped again (`Opened.strip`).
CommitFor = Callable[[frozenset[str]], Commit]


class AttemptFailed(Exception):
    """One attempt failed before its first token; `failure` says how."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure

    @property
    def outcome(self) -> Attempt:
        return self.failure.outcome

    @property
    def message(self) -> str:
        return self.failure.message


def _failed(
    outcome: Attempt,
    message: str,
    *,
    status: int | None = None,
    body: bytes | None = None,
    content_type: str = "application/json",
    retry_after_s: float | None = None,
) -> AttemptFailed:
    return AttemptFailed(Failure(outcome, message, status, body, content_type, retry_after_s))


class UpstreamStream(Protocol):
    """An upstream response being read: what the relay needs of it (see `H1Connection`)."""

    # Read-only here: the connection sets them (an alias's restamping wrapper delegates).
    @property
    def headers(self) -> dict[str, str]: ...
    @property
    def complete(self) -> bool: ...  # the response ended
    @property
    def stopped(self) -> bool: ...  # the sink ended the relay
    @property
    def paused(self) -> bool: ...  # reading paused until the client's socket drains

    def relay(self, sink: Sink) -> None: ...
    async def wait_relay(self) -> None: ...
    def detach(self) -> None: ...
    def pause(self) -> None: ...
    def resume(self) -> None: ...
    def release(self) -> None: ...
    def close(self) -> None: ...


@dataclass(slots=True)
class Opened:
    """An upstream response that has produced its first token (or its whole body)."""

    replica: Replica
    conn: UpstreamStream
    head: list[Event]  # streaming: events read so far, the first token last
    sse: SSEBuffer
    body: bytes | None  # non-streaming: the whole body
    opened_at: float  # monotonic, when the attempt started
    first_token_at: float
    hold: Hold | None = None  # the attempt's claim in the in-flight ledger
    # Chunk keys this upstream was asked for on our behalf (a running token count), to
    # strip from what the client receives.
    strip: frozenset[str] = frozenset()

    def close(self) -> None:
        """Done with the upstream: its connection is reused if the response was read to
        the end, and closed otherwise (the engine then aborts the request); the attempt's
        in-flight claim is released (once, whichever path calls this)."""
        self.conn.release()
        if self.hold is not None:
            self.hold.release()


class Upstream(Protocol):
    async def open(
        self,
        replica: Replica,
        path: str,
        req: ParsedRequest,
        body: bytes,
        request_id: str,
        timeout_s: float,
        timeout_outcome: Attempt,
        trace: Mapping[str, str] | None = None,
        commit: Commit | None = None,
    ) -> Opened:
        """Send the request and wait for its first token (streaming) or whole body;
        raise `AttemptFailed` otherwise. Cancellation closes the connection. `trace`:
        the W3C trace context headers for the replica (see telemetry.py). `commit`:
        called with the first token's bytes the moment they arrive, unless the head
        already ends the stream or the attempt is being cancelled."""
        ...

    def close(self) -> None: ...


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP-date; engines do not send those


def upstream_headers(
    replica: Replica,
    request_id: str,
    trace: Mapping[str, str] | None = None,
    content_type: str | None = None,
) -> dict[str, str]:
    """The headers sent with a request. `content_type`: the client's, forwarded as given
    (a multipart boundary must reach the engine, and vLLM answers a body labelled
    `text/plain` as it would have answered the client); none given: `application/json`,
    since the gateway has read the body as JSON (vLLM would refuse it; see
    docs/engines-reference.md §8)."""
    headers = {"Content-Type": content_type or "application/json", "X-Request-Id": request_id}
    if replica.api_key:
        headers["Authorization"] = f"Bearer {replica.api_key}"
    if trace:
        headers.update(trace)  # traceparent, tracestate: checked or made by telemetry.py
    return headers


class H1Upstream:
    """`Upstream` over the keep-alive HTTP/1.1 pool."""

    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool

    async def open(
        self,
        replica: Replica,
        path: str,
        req: ParsedRequest,
        body: bytes,
        request_id: str,
        timeout_s: float,
        timeout_outcome: Attempt,
        trace: Mapping[str, str] | None = None,
        commit: Commit | None = None,
    ) -> Opened:
        return await open_attempt(
            self.pool,
            replica,
            path,
            req,
            body,
            request_id,
            timeout_s,
            timeout_outcome,
            trace,
            commit,
        )

    def close(self) -> None:
        self.pool.close()


async def open_attempt(
    pool: H1Pool,
    replica: Replica,
    path: str,
    req: ParsedRequest,
    body: bytes,
    request_id: str,
    timeout_s: float,
    timeout_outcome: Attempt,
    trace: Mapping[str, str] | None = None,
    commit: Commit | None = None,
) -> Opened:
    """Send the request and wait for its first token (streaming) or whole body.

    `timeout_s` is the time left before the first token (streaming) or the total
    deadline (non-streaming); `timeout_outcome` names which one it is.
    """
    started = clock.monotonic()
    conn: H1Connection | None = None
    expiry = Expiry(timeout_s)
    try:
        headers = upstream_headers(replica, request_id, trace, req.content_type)
        conn = await pool.request(replica.endpoint, path, headers, body)
        if conn.status != 200:
            raise await _http_failure(conn)
        if not req.stream:
            data = await conn.read_all()
            now = clock.monotonic()
            return Opened(replica, conn, [], SSEBuffer(), data, started, now)
        scan = _Head(conn, CLASSIFY[req.dialect], expiry, commit)
        conn.relay(scan.feed)
        await conn.wait_sink()
        if scan.failure is not None:
            raise scan.failure
        if not scan.first_token_at:
            raise _failed(Attempt.reset, "upstream closed before the first token")
        return Opened(replica, conn, scan.events, scan.sse, None, started, scan.first_token_at)
    except AttemptFailed:
        if conn is not None:
            conn.release()  # reused when the error's body was read to its end
        raise
    except ConnectFailed as e:
        raise _failed(Attempt.connect_error, f"cannot connect to {replica.id}: {e}") from None
    except ConnectionError as e:
        if conn is not None:
            conn.close()
        raise _failed(Attempt.reset, f"{replica.id}: {type(e).__name__}: {e}") from None
    except BaseException as e:
        # Timed out, or cancelled (client left, hedge lost, shutdown): close the connection
        # so the engine sees the disconnect and aborts the request at once.
        if conn is not None:
            conn.close()
        if isinstance(e, asyncio.CancelledError) and expiry.expired():
            raise _failed(timeout_outcome, f"no first token within {timeout_s:.3g}s") from None
        raise
    finally:
        expiry.close()


class _Head:
    """The sink of an upstream's reads until its first token, in the socket callback:
    every complete event of each read goes into the head (a short answer can arrive
    whole in one read); an error or an abort before any token fails the attempt. At the
    first token the connection is handed back (later reads wait for the relay) and,
    with a `commit`, the head goes to the client at once: unless it already ends the
    stream (the relay writes that with the response's end), or the attempt is being
    cancelled (its time ran out in this same turn of the loop, the client left)."""

    __slots__ = (
        "_classify",
        "_commit",
        "_conn",
        "_expiry",
        "events",
        "failure",
        "first_token_at",
        "sse",
    )

    def __init__(
        self,
        conn: H1Connection,
        classify: Callable[[bytes], Event],
        expiry: Expiry,
        commit: Commit | None,
    ) -> None:
        self._conn = conn
        self._classify = classify
        self._expiry = expiry
        self._commit = commit
        self.sse = SSEBuffer()
        self.events: list[Event] = []
        self.failure: AttemptFailed | None = None
        self.first_token_at = 0.0

    def feed(self, data: bytes) -> bool:
        got_token = False
        events = self.events
        for raw in self.sse.feed(data):
            ev = self._classify(raw)
            if not got_token:
                if ev.kind is Kind.ERROR:
                    self.failure = _failed(Attempt.error_event, _error_message(ev), status=502)
                    return False
                if ev.kind is Kind.ABORT:
                    # vLLM shutting down (abort mode) answers with an empty abort.
                    self.failure = _failed(Attempt.aborted, "upstream aborted the request")
                    return False
            events.append(ev)
            if ev.kind in (Kind.TOKEN, Kind.DONE, Kind.USAGE):
                got_token = True
        if got_token:
            self.first_token_at = clock.monotonic()
            commit = self._commit
            if commit is not None and self._expiry.disarm() and not any(e.terminal for e in events):
                commit(self._conn.headers, events, self.sse.pending)
            self._conn.hand_back()
        return True


async def _http_failure(conn: H1Connection) -> AttemptFailed:
    try:
        body = await conn.read_all(limit=_MAX_ERROR_BODY)
    except ConnectionError:
        body = b""
    status = conn.status
    ctype = conn.headers.get("content-type", "application/json")
    message = f"upstream answered {status}"
    if status in (429, 503):
        # Engine admission: a signal to back off from this replica, not a broken one.
        return _failed(
            Attempt.http_429,
            message,
            status=status,
            body=body,
            retry_after_s=parse_retry_after(conn.headers.get("retry-after")),
            content_type=ctype,
        )
    if status >= 500 and status != 501:
        return _failed(Attempt.http_5xx, message, status=status, body=body, content_type=ctype)
    if 300 <= status < 400:
        # Not followed: a replica URL that redirects is misconfigured (http -> https, a
        # moved path), and re-sending a prompt to wherever it points is not ours to do.
        where = conn.headers.get("location", "(no Location)")
        return _failed(
            Attempt.redirect,
            f"{message}, redirecting to {where}: set the replica's URL to that address",
        )
    # 4xx, and 501: the engine cannot do this at all (vLLM's NotImplementedError, a
    # generative model asked for the Responses API; llama.cpp asked for audio without an
    # audio model): the request's fault on this fleet, relayed as the engine wrote it.
    return _failed(Attempt.http_4xx, message, status=status, body=body, content_type=ctype)


def _error_message(ev: Event) -> str:
    """The engine's message from an error event (classify has parsed it when it could)."""
    obj = ev.obj or {}
    error = obj.get("error")
    if not isinstance(error, dict) and isinstance(obj.get("response"), dict):
        error = obj["response"].get("error")  # the Responses API's response.failed
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if obj.get("message"):
        return str(obj["message"])  # the Responses API's error event
    return "upstream error event"
