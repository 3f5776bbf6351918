"""One upstream attempt, up to and including the first token.

The gateway holds the client's response until the first token chunk has arrived (vLLM
commits stream headers before any token), so everything that can go wrong before that
point is still a clean, retryable failure: connection refused or reset, a 5xx, an
error event, silence past the time-to-first-token deadline. This module turns each of
those into one `AttemptFailed` with an outcome name (the `outcome` label of
`seawall_upstream_attempts_total`) and says whether another replica may be tried.

It must not decide retries, pick replicas or touch the client: the proxy does that.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from seawall import clock
from seawall.gateway.h1 import ConnectFailed, H1Connection, H1Pool
from seawall.gateway.replicas import Replica
from seawall.protocol.openai import ParsedRequest
from seawall.protocol.sse import Event, Kind, SSEBuffer, classify

# Bodies of upstream errors are relayed to the client; cap what we hold in memory.
_MAX_ERROR_BODY = 64 * 1024


class AttemptFailed(Exception):
    def __init__(
        self,
        outcome: str,
        retryable: bool,
        message: str,
        status: int | None = None,
        body: bytes | None = None,
        retry_after_s: float | None = None,
        content_type: str = "application/json",
    ) -> None:
        super().__init__(message)
        self.outcome = outcome
        self.retryable = retryable
        self.message = message
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s
        self.content_type = content_type


@dataclass(slots=True)
class Opened:
    """An upstream response that has produced its first token (or its whole body)."""

    replica: Replica
    conn: H1Connection
    head: list[Event]  # streaming: events read so far, the first token last
    sse: SSEBuffer
    body: bytes | None  # non-streaming: the whole body
    opened_at: float  # monotonic, when the attempt started
    first_token_at: float

    def close(self) -> None:
        """Done with the upstream: its connection is reused if the response was read to
        the end, and closed otherwise (the engine then aborts the request)."""
        self.conn.release()


def parse_retry_after(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP-date; engines do not send those


def upstream_headers(replica: Replica, request_id: str) -> dict[str, str]:
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if replica.api_key:
        headers["Authorization"] = f"Bearer {replica.api_key}"
    return headers


_PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


async def open_attempt(
    pool: H1Pool,
    replica: Replica,
    req: ParsedRequest,
    body: bytes,
    request_id: str,
    timeout_s: float,
    timeout_outcome: str,
) -> Opened:
    """Send the request and wait for its first token (streaming) or whole body.

    `timeout_s` is the time left before the first token (streaming) or the total
    deadline (non-streaming); `timeout_outcome` names which one it is.
    """
    started = clock.monotonic()
    conn: H1Connection | None = None
    try:
        async with asyncio.timeout(timeout_s):
            conn = await pool.request(
                replica.endpoint, _PATHS[req.route], upstream_headers(replica, request_id), body
            )
            if conn.status != 200:
                raise await _http_failure(conn)
            if not req.stream:
                data = await conn.read_all()
                now = clock.monotonic()
                return Opened(replica, conn, [], SSEBuffer(), data, started, now)
            sse = SSEBuffer()
            head: list[Event] = []
            while True:
                chunk = await conn.read()
                if not chunk:
                    raise AttemptFailed("reset", True, "upstream closed before the first token")
                got_token = False
                # Every complete event of this read goes into the head, including those
                # after the first token: a short answer can arrive whole in one read.
                for raw in sse.feed(chunk):
                    ev = classify(raw)
                    if ev.kind is Kind.ERROR and not got_token:
                        raise AttemptFailed(
                            "error_event", True, _error_message(ev), status=502, body=None
                        )
                    if ev.kind is Kind.ABORT and not got_token:
                        # vLLM shutting down (abort mode) answers with an empty abort.
                        raise AttemptFailed("aborted", True, "upstream aborted the request")
                    head.append(ev)
                    if ev.kind in (Kind.TOKEN, Kind.DONE, Kind.USAGE):
                        got_token = True
                if got_token:
                    return Opened(replica, conn, head, sse, None, started, clock.monotonic())
    except AttemptFailed:
        if conn is not None:
            conn.release()  # reused when the error's body was read to its end
        raise
    except TimeoutError:
        if conn is not None:
            conn.close()
        raise AttemptFailed(
            timeout_outcome, True, f"no first token within {timeout_s:.3g}s"
        ) from None
    except ConnectFailed as e:
        raise AttemptFailed("connect_error", True, f"cannot connect to {replica.id}: {e}") from None
    except ConnectionError as e:
        if conn is not None:
            conn.close()
        raise AttemptFailed("reset", True, f"{replica.id}: {type(e).__name__}: {e}") from None
    except BaseException:
        # Cancelled (client left, hedge lost, shutdown): close the connection so the
        # engine sees the disconnect and aborts the request at once.
        if conn is not None:
            conn.close()
        raise


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
        return AttemptFailed(
            "http_429",
            True,
            message,
            status=status,
            body=body,
            retry_after_s=parse_retry_after(conn.headers.get("retry-after")),
            content_type=ctype,
        )
    if status >= 500:
        return AttemptFailed(
            "http_5xx", True, message, status=status, body=body, content_type=ctype
        )
    if 300 <= status < 400:
        # Not followed: a replica URL that redirects is misconfigured (http -> https, a
        # moved path), and re-sending a prompt to wherever it points is not ours to do.
        where = conn.headers.get("location", "(no Location)")
        return AttemptFailed(
            "redirect",
            True,
            f"{message}, redirecting to {where}: set the replica's URL to that address",
        )
    return AttemptFailed("http_4xx", False, message, status=status, body=body, content_type=ctype)


def _error_message(ev: Event) -> str:
    """The engine's message from an error event (classify has parsed it when it could)."""
    error = ev.obj.get("error") if ev.obj else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return "upstream error event"
