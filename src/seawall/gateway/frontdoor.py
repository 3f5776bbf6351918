"""The front door: how the client listener accepts, reads, times out, caps and answers
connections, below the OpenAI API.

Owns everything a client can do before a request reaches a route: the TCP accept, the
HTTP/1.1 parse (aiohttp's), header/body/idle timeouts, connection caps with eviction,
the process's descriptor limit, and the answer to anything the parser refuses. Also owns
what request ids the gateway accepts from clients (`safe_request_id`) and the last line
of defence against secrets in logs (`RedactSecrets`).

Must not: read a request body, route, authenticate for the request path (it only asks
the `authorize` hook whether a connection has shown a valid key, to decide which cap it
counts against), or log anything a client sent. aiohttp's own error path quotes the raw
header line in an ERROR traceback and in a plain-text 400 (an `Authorization` line it
cannot parse leaked the key); here every refusal is an OpenAI-shaped JSON error built
from the exception's *type*, never its text, and logs one line without client bytes.

Why each rule exists (issue 11, item 4): without read timeouts and caps, 300 clients
trickling headers at 1 byte/s and 100 trickling bodies all stayed open, and ~20,000 idle
connections exhausted the descriptor limit, so new clients and the admin API were reset.

- Header timeout: from accept (or, on a kept-alive connection, from the first byte of
  the next request) until the headers are complete. Expiry: 408 JSON, close.
- Body timeout: from complete headers until the whole body has arrived. Expiry: 408
  JSON, close (the handler reading the body is cancelled with the connection).
- Idle timeout: aiohttp's keep-alive timer, set to `keepalive_timeout_s`; an idle
  connection is closed silently, as HTTP allows.
- Caps: every connection is *unauthenticated* until a request on it carries a valid
  key (the `authorize` hook). Unauthenticated connections are capped globally and per
  client address (with no tenants configured nobody is ever authenticated, and one
  address is often a balancer carrying everyone, so those two caps default to the
  global one: `effective_caps`); all connections together are capped below the
  descriptor limit, leaving `fd_reserve` descriptors for the admin port, replicas, Redis
  and logs. At a cap a new connection evicts the one that has been *evictable* longest:
  an unauthenticated one that is idle, still sending headers, or still sending its body,
  or (for the global cap only, after those) an authenticated one that is idle between
  requests. A client that sends its request promptly is evicted last, so a flood of
  connections that never finish a request only ever pushes out its own kind. If nothing
  is evictable (every connection is in the middle of a served request) the newcomer is
  refused with a 503 JSON answer.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import platform
import re
import resource
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Literal

from aiohttp import web
from aiohttp.http_exceptions import (
    BadHttpMessage,
    BadStatusLine,
    ContentEncodingError,
    HttpProcessingError,
    LineTooLong,
)
from aiohttp.web_protocol import RequestPayloadError
from prometheus_client import CollectorRegistry, Counter, Gauge

from seawall import clock
from seawall.config import ServerConfig
from seawall.errors import ApiError
from seawall.gateway.idle import Callback, Wheel

log = logging.getLogger("seawall.frontdoor")

# aiohttp's defaults for the request line and a header line are both 8190 bytes. They are
# set one byte apart here so that a `LineTooLong` says which one it was (its only other
# content is the client's bytes): a request line over the limit is 414, a header 431.
MAX_REQUEST_LINE_BYTES = 8190
MAX_HEADER_LINE_BYTES = 8191
MAX_HEADERS = 128
# After a response that left the body unread (a refusal before reading it), aiohttp
# reads and discards the rest so the client can read the answer before the close. Its
# default of 10 s let a trickler hold the connection; 2 s is enough on any real network.
LINGERING_S = 2.0
# The content codings the listener decodes (aiohttp's; br and zstd only if their
# libraries are installed, which this project does not require).
DECODED_CODINGS = frozenset({"gzip", "deflate", "x-gzip"})
# A log line per kind of refusal at most this often: a flood of malformed requests must
# not become a flood of log lines.
LOG_EVERY_S = 10.0
# Request ids the gateway forwards and logs: ASCII letters, digits and `._:-/+=@`, up to
# 128 characters (uuids, W3C trace ids, base64). Anything else is replaced by a fresh id.
_SAFE_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")
# Strings that look like an API key (OpenAI's and ours start `sk-`): never echoed.
_KEY_SHAPED = re.compile(r"(?i)\b(sk|pk|rk)-[A-Za-z0-9_-]{8,}|bearer")


# -------------------------------------------------------------------------- request ids


def safe_request_id(incoming: str | None) -> str | None:
    """The client's `X-Request-Id` if the gateway may forward, return and log it as is;
    None otherwise (the caller makes a fresh one).

    A raw non-ASCII byte forwarded in a header made vLLM-like replicas answer 500, a
    character outside latin-1 made the gateway's own response fail, and a key pasted
    into the header would be logged: only a conservative ASCII alphabet passes.
    """
    if incoming is None or not _SAFE_REQUEST_ID.fullmatch(incoming):
        return None
    if _KEY_SHAPED.search(incoming):
        return None
    return incoming


# --------------------------------------------------------------- refusals of bad HTTP


@dataclass(frozen=True, slots=True)
class HttpRefusal:
    """The answer to a request the listener refuses: status, error code, message. Built
    from the exception's type only: the exception's text quotes the client's bytes."""

    status: int
    code: str
    message: str

    def error(self) -> ApiError:
        return ApiError(self.status, self.message, code=self.code)


# llhttp's error reasons are fixed English phrases ("Invalid header value char"), which
# aiohttp formats as "<reason>:\n\n  <the raw bytes>\n  <pointer>"; only the phrase is
# kept, and only if it is made of the characters such phrases use.
_LLHTTP_REASON = re.compile(r"([A-Za-z][A-Za-z' -]{2,80}):\n")


def _reason_phrase(exc: BaseException) -> str | None:
    message = exc.message if isinstance(exc, HttpProcessingError) else ""
    match = _LLHTTP_REASON.match(message) if isinstance(message, str) else None
    return match.group(1) if match else None


def refusal_for(exc: BaseException | None, status: int) -> HttpRefusal:
    """How to answer an error aiohttp hands to `handle_error` (`status` is aiohttp's:
    400 for any parse error, 500 for an exception in a handler, 504 for a timeout)."""
    if isinstance(exc, ApiError):
        return HttpRefusal(exc.status, str(exc.code or exc.status), exc.message)
    if isinstance(exc, LineTooLong):
        limit = exc.args[1] if len(exc.args) > 1 else None
        if limit == MAX_REQUEST_LINE_BYTES:
            return HttpRefusal(
                414,
                "uri_too_long",
                f"The request line is longer than {MAX_REQUEST_LINE_BYTES} bytes.",
            )
        return HttpRefusal(
            431,
            "request_header_fields_too_large",
            f"A request header line is longer than {MAX_HEADER_LINE_BYTES} bytes.",
        )
    if isinstance(exc, BadHttpMessage) and exc.message == "Too many headers received":
        return HttpRefusal(
            431,
            "request_header_fields_too_large",
            f"The request has more than {MAX_HEADERS} headers.",
        )
    if isinstance(exc, ContentEncodingError):
        text = exc.message if isinstance(exc.message, str) else ""
        if "install" in text:  # aiohttp without the library for br or zstd
            return _unsupported_coding()
        return HttpRefusal(
            400,
            "invalid_content_encoding",
            "The request body could not be decoded with its Content-Encoding.",
        )
    if isinstance(exc, RequestPayloadError):
        # Raised by `request.read()`: the body's framing or coding broke midway.
        if isinstance(exc.__cause__, ContentEncodingError):
            return HttpRefusal(
                400,
                "invalid_content_encoding",
                "The request body could not be decoded with its Content-Encoding.",
            )
        return HttpRefusal(400, "malformed_body", "The request body's framing is not valid.")
    if isinstance(exc, BadStatusLine):  # BadHttpMethod too
        return HttpRefusal(400, "malformed_http", "The request line is not valid HTTP/1.1.")
    if isinstance(exc, HttpProcessingError):
        reason = _reason_phrase(exc)
        detail = f" ({reason})" if reason else ""
        code = exc.code if 400 <= exc.code < 500 else 400
        return HttpRefusal(code, "malformed_http", f"The request is not valid HTTP/1.1{detail}.")
    if isinstance(exc, asyncio.TimeoutError) or status == 504:
        return HttpRefusal(504, "gateway_timeout", "The gateway timed out handling the request.")
    if status >= 500:
        return HttpRefusal(
            500, "internal_error", "The gateway failed to handle this request; it is logged."
        )
    return HttpRefusal(status, "bad_request", "The request could not be processed.")


def _unsupported_coding() -> HttpRefusal:
    return HttpRefusal(
        415,
        "unsupported_content_encoding",
        "Unsupported Content-Encoding; send the body uncompressed, gzip or deflate.",
    )


def content_coding_refusal(headers: Mapping[str, str]) -> HttpRefusal | None:
    """415 for a body coding the listener does not decode. aiohttp passes an unknown
    coding through undecoded (and chokes on br without Brotli), so the check is here."""
    coding = headers.get("Content-Encoding")
    if coding is None:
        return None
    coding = coding.strip().lower()
    if coding in ("", "identity") or coding in DECODED_CODINGS:
        return None
    return _unsupported_coding()


def json_error_response(refusal: HttpRefusal) -> web.Response:
    resp = web.Response(
        body=refusal.error().json_bytes(), status=refusal.status, content_type="application/json"
    )
    return resp


def canned_response(refusal: HttpRefusal) -> bytes:
    """A whole HTTP/1.1 response written straight to the socket (no request object
    exists yet, or the handler is about to be cancelled); the connection closes after."""
    body = refusal.error().json_bytes()
    phrase = HTTPStatus(refusal.status).phrase
    head = (
        f"HTTP/1.1 {refusal.status} {phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


# --------------------------------------------------------------------- secrets in logs

_SECRET_PATTERNS = (
    # `Authorization: Bearer x`, `api-key: x`, `x-api-key=x`, in any quoting.
    re.compile(
        r"(?i)((?:proxy-)?authorization|x-api-key|api-key|api_key)"
        r"(\\?['\"]?\s*[:=]\s*)[^\r\n]*"
    ),
    re.compile(r"(?i)\b(bearer|basic)(\s+)[^\s'\"\\]+"),
    re.compile(r"()()\bsk-[A-Za-z0-9_-]{8,}"),
)


def redact(text: str) -> str:
    """`text` with anything shaped like a credential replaced by `[redacted]`."""
    for pattern in _SECRET_PATTERNS:
        text = pattern.sub(r"\1\2[redacted]", text)
    return text


class RedactSecrets(logging.Filter):
    """The last line of defence: a record whose message or traceback mentions a header
    that carries keys, a bearer token or a key-shaped string is rewritten before any
    handler formats it. The fix is not to log client bytes at all (see `_Handler`);
    this catches what a library logs behind our back."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a broken format string must not lose the record
            message = str(record.msg)
        cleaned = redact(message)
        if cleaned != message:
            record.msg, record.args = cleaned, None
        if record.exc_info:
            text = logging.Formatter().formatException(record.exc_info)
            record.exc_text = redact(text)
            record.exc_info = None
        elif record.exc_text:
            record.exc_text = redact(record.exc_text)
        return True


_REDACTOR = RedactSecrets()
_LOGGERS_TO_REDACT = (
    "seawall.frontdoor",
    "aiohttp.server",
    "aiohttp.access",
    "aiohttp.internal",
    "aiohttp.web",
    "asyncio",
)


def install_log_redaction() -> None:
    """Attach `RedactSecrets` to the loggers that can see raw requests (records made
    there) and to the root handlers (records propagated from anywhere). Idempotent."""
    for name in _LOGGERS_TO_REDACT:
        logger = logging.getLogger(name)
        if _REDACTOR not in logger.filters:
            logger.addFilter(_REDACTOR)
    for handler in logging.getLogger().handlers:
        if _REDACTOR not in handler.filters:
            handler.addFilter(_REDACTOR)


# ------------------------------------------------------------------ connection table


@dataclass(eq=False, slots=True)
class Conn:
    """One client connection, as the caps see it."""

    address: str
    keyed: bool = False  # a request on it carried a valid key
    evictable: bool = True  # idle, sending headers, or (unkeyed) sending its body
    closer: Callable[[], None] | None = None  # closes the connection (set by the handler)


RefuseReason = Literal["max_connections", "max_unauthenticated", "max_per_address"]


@dataclass(frozen=True, slots=True)
class Admitted:
    conn: Conn
    evict: tuple[Conn, ...]  # close these (already removed from the table)


@dataclass(frozen=True, slots=True)
class Refused:
    reason: RefuseReason


class ConnectionTable:
    """Bookkeeping for the caps, and the choice of whom to evict. No I/O and no clock:
    order is arrival order into the evictable state (dicts keep insertion order)."""

    def __init__(self, max_total: int, max_unkeyed: int, max_unkeyed_per_address: int) -> None:
        self.max_total = max_total
        self.max_unkeyed = max_unkeyed
        self.max_unkeyed_per_address = max_unkeyed_per_address
        self._all: dict[Conn, None] = {}
        self._unkeyed_count = 0
        self._unkeyed_by_address: dict[str, int] = {}
        # Evictable connections, oldest first: unkeyed (globally and by address), keyed.
        self._idle_unkeyed: dict[Conn, None] = {}
        self._idle_unkeyed_by_address: dict[str, dict[Conn, None]] = {}
        self._idle_keyed: dict[Conn, None] = {}

    def __len__(self) -> int:
        return len(self._all)

    @property
    def unauthenticated(self) -> int:
        return self._unkeyed_count

    def unauthenticated_from(self, address: str) -> int:
        return self._unkeyed_by_address.get(address, 0)

    def admit(self, address: str) -> Admitted | Refused:
        """A new (unkeyed, evictable) connection from `address`: room for it, after
        evicting whom; or why not."""
        victims: list[Conn] = []

        def oldest(pool: dict[Conn, None]) -> Conn | None:
            return next((c for c in pool if c not in victims), None)

        if self.unauthenticated_from(address) >= self.max_unkeyed_per_address:
            victim = oldest(self._idle_unkeyed_by_address.get(address, {}))
            if victim is None:
                return Refused("max_per_address")
            victims.append(victim)
        unkeyed_after = self._unkeyed_count - sum(1 for v in victims if not v.keyed)
        if unkeyed_after >= self.max_unkeyed:
            victim = oldest(self._idle_unkeyed)
            if victim is None:
                return Refused("max_unauthenticated")
            victims.append(victim)
        if len(self._all) - len(victims) >= self.max_total:
            victim = oldest(self._idle_unkeyed) or oldest(self._idle_keyed)
            if victim is None:
                return Refused("max_connections")
            victims.append(victim)
        for victim in victims:
            self.remove(victim)
        conn = Conn(address)
        self._all[conn] = None
        self._count_unkeyed(conn, +1)
        self._set_idle(conn, True)
        return Admitted(conn, tuple(victims))

    def update(self, conn: Conn, *, keyed: bool | None = None, evictable: bool) -> None:
        """The connection's state changed (a request began or ended, a key was seen)."""
        if conn not in self._all:
            return  # evicted or closed meanwhile
        if not evictable and not conn.evictable and (not keyed or conn.keyed):
            return  # in no pool, and staying out of them: nothing changes
        self._set_idle(conn, False)
        if keyed and not conn.keyed:
            self._count_unkeyed(conn, -1)
            conn.keyed = True
        self._set_idle(conn, evictable)

    def remove(self, conn: Conn) -> None:
        if conn not in self._all:
            return  # already removed (evicted, then its close reported)
        del self._all[conn]
        self._set_idle(conn, False)
        if not conn.keyed:
            self._count_unkeyed(conn, -1)

    def _count_unkeyed(self, conn: Conn, delta: int) -> None:
        self._unkeyed_count += delta
        left = self._unkeyed_by_address.get(conn.address, 0) + delta
        if left:
            self._unkeyed_by_address[conn.address] = left
        else:
            self._unkeyed_by_address.pop(conn.address, None)

    def _set_idle(self, conn: Conn, evictable: bool) -> None:
        """Move `conn` in or out of the evictable pools (in: to the young end)."""
        if conn.evictable:  # in a pool (or new, in none yet): out of it first
            by_address = self._idle_unkeyed_by_address.get(conn.address)
            self._idle_unkeyed.pop(conn, None)
            self._idle_keyed.pop(conn, None)
            if by_address is not None:
                by_address.pop(conn, None)
                if not by_address:
                    del self._idle_unkeyed_by_address[conn.address]
        conn.evictable = evictable
        if not evictable:
            return
        if conn.keyed:
            self._idle_keyed[conn] = None
        else:
            self._idle_unkeyed[conn] = None
            self._idle_unkeyed_by_address.setdefault(conn.address, {})[conn] = None


# ------------------------------------------------------------------ descriptor limit


def raise_fd_limit(ceiling: int = 1 << 20) -> int:
    """Raise this process's soft descriptor limit to its hard limit (at most `ceiling`);
    returns the soft limit now in force. Many distributions start services at 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = ceiling if hard == resource.RLIM_INFINITY else min(hard, ceiling)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the descriptor limit from %d to %d: %s", soft, target, e)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


# glibc raises its mmap threshold to the size of the largest block freed so far (up to
# 32 MiB), after which multi-MiB request bodies come from the heap and their pages stay
# with the process once freed: a burst of 4 MiB bodies left the gateway ~40 MiB larger.
# Pinned, every block over 256 KiB is its own mapping and goes back to the OS when freed.
MMAP_THRESHOLD_BYTES = 256 * 1024
TRIM_THRESHOLD_BYTES = 1024 * 1024
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def pin_malloc_thresholds() -> bool:
    """Fix glibc's mmap and trim thresholds (see above); False where there is no glibc."""
    if platform.libc_ver()[0] != "glibc":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        ok_mmap = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
        ok_trim = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    except (OSError, AttributeError):
        return False
    return bool(ok_mmap and ok_trim)


@dataclass(frozen=True, slots=True)
class Caps:
    max_total: int
    max_unkeyed: int
    max_unkeyed_per_address: int


def effective_caps(settings: ServerConfig, fd_soft_limit: int, keys_exist: bool = True) -> Caps:
    """The configured caps, lowered to fit the descriptor limit: each client connection
    may hold an upstream connection too, and `fd_reserve` are never given to clients.

    With no keys (an open gateway) there are no strangers to keep from crowding out
    tenants, and one client address is often a proxy or a balancer carrying everyone:
    the caps for connections without a valid key default to `max_connections` then
    (values set in the configuration are kept)."""
    room = max(16, (fd_soft_limit - settings.fd_reserve) // 2)
    total = min(settings.max_connections, room)
    unkeyed_cap = settings.max_unauthenticated_connections
    per_address_cap = settings.max_unauthenticated_per_address
    if not keys_exist:
        chosen = settings.model_fields_set
        if "max_unauthenticated_connections" not in chosen:
            unkeyed_cap = total
        if "max_unauthenticated_per_address" not in chosen:
            per_address_cap = total
    unkeyed = min(unkeyed_cap, total)
    per_address = min(per_address_cap, unkeyed)
    return Caps(total, unkeyed, per_address)


# -------------------------------------------------------------------------- metrics


@dataclass
class DoorMetrics:
    open: Gauge
    unauthenticated: Gauge
    refused: Counter
    evicted: Counter
    timeouts: Counter
    bad_requests: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None) -> DoorMetrics:
        # A private registry when none is given: several gateways may share a process.
        kw: dict[str, Any] = {"registry": registry or CollectorRegistry()}
        return cls(
            Gauge("seawall_client_connections", "Open client connections.", **kw),
            Gauge(
                "seawall_client_connections_unauthenticated",
                "Client connections that have not yet shown a valid key.",
                **kw,
            ),
            Counter(
                "seawall_client_connections_refused_total",
                "Connections refused at accept, by the cap that was full.",
                ["reason"],
                **kw,
            ),
            Counter(
                "seawall_client_connections_evicted_total",
                "Idle or unfinished connections closed to make room, by the cap.",
                ["reason"],
                **kw,
            ),
            Counter(
                "seawall_client_read_timeouts_total",
                "Connections closed because headers or a body arrived too slowly.",
                ["kind"],
                **kw,
            ),
            Counter(
                "seawall_http_refused_total",
                "Requests refused by the listener before any route (malformed HTTP...).",
                ["code"],
                **kw,
            ),
        )


class _Throttle:
    """At most one log line per key per `LOG_EVERY_S`, saying how many were skipped."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def allow(self, key: str, now: float) -> int | None:
        """None to skip; else how many were skipped since the last line."""
        last = self._last.get(key)
        if last is not None and now - last < LOG_EVERY_S:
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return None
        self._last[key] = now
        return self._skipped.pop(key, 0)


# --------------------------------------------------------------------------- handler

Phase = Literal["headers", "request", "idle", "closed"]
Authorize = Callable[[Mapping[str, str]], bool]


def _closed() -> None:
    """A closed connection's clock: nothing left to time."""


class _Handler(web.RequestHandler):
    """aiohttp's connection protocol with the front door's timeouts, caps and answers."""

    def __init__(self, door: FrontDoor, manager: web.Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._door = door
        self._conn: Conn | None = None
        self._phase: Phase = "headers"
        # The header and body clocks: one deadline on the loop's timer wheel (a timer
        # handle per request cost more than everything else the door does).
        self._clock = Callback(self._fire)
        self._expired: Callable[[], None] | None = None  # what the running clock does
        self._request: web.BaseRequest | None = None
        # Each request passes the door before the application (an aiohttp middleware
        # did this at a few microseconds more per request: its wrapper per request).
        inner = self._request_handler
        if inner is not None:
            self._request_handler = self._through_door(inner)

    def _through_door(
        self, inner: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            self.request_started(request)
            refusal = content_coding_refusal(request.headers)
            if refusal is not None:
                self._door.metrics.bad_requests.labels(refusal.code).inc()
                return json_error_response(refusal)
            return await inner(request)

        return handle

    # -- connection ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        door = self._door
        peer = transport.get_extra_info("peername")
        address = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
        decision = door.table.admit(address)
        if isinstance(decision, Refused):
            door.metrics.refused.labels(decision.reason).inc()
            door.note("refused", f"connection from {address} refused: {decision.reason} full")
            self._answer_and_close(
                HttpRefusal(
                    503,
                    "too_many_connections",
                    "The gateway has too many open connections; retry shortly.",
                )
            )
            return
        for victim in decision.evict:
            door.metrics.evicted.labels(
                "max_unauthenticated" if not victim.keyed else "max_connections"
            ).inc()
            if victim.closer is not None:
                victim.closer()
        self._conn = decision.conn
        self._conn.closer = self._evicted
        self._arm(door.settings.header_timeout_s, self._header_timeout)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._disarm()
        self._phase = "closed"
        # Break the cycles handler -> conn -> handler and handler -> clock -> handler now:
        # left to the cyclic collector, each closed connection kept its request buffers
        # for a while, and the collector's pauses stop every stream.
        self._clock.fn = _closed
        if self._conn is not None:
            self._door.table.remove(self._conn)
            self._conn.closer = None
            self._conn = None
        self._request = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._phase == "idle" and data:
            # The first byte of the next request on a kept-alive connection.
            self._phase = "headers"
            self._arm(self._door.settings.header_timeout_s, self._header_timeout)
        super().data_received(data)

    # -- requests -----------------------------------------------------------------------

    def request_started(self, request: web.BaseRequest) -> None:
        """Headers complete: stop the header clock, learn whether the key is valid,
        and start the body clock if a body is still to come."""
        self._disarm()
        self._phase = "request"
        self._request = request
        conn = self._conn
        if conn is None:
            return
        door = self._door
        keyed = conn.keyed or (door.authorize is not None and door.authorize(request.headers))
        body_pending = not request.content.is_eof()
        door.table.update(conn, keyed=keyed, evictable=not keyed and body_pending)
        if body_pending:
            self._arm(door.settings.body_timeout_s, self._body_timeout)
            request.content.on_eof(self._body_complete)

    def _body_complete(self) -> None:
        if self._phase != "request":
            return
        self._disarm()
        if self._conn is not None:
            self._door.table.update(self._conn, evictable=False)

    async def finish_response(
        self, request: web.BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if isinstance(resp, web.HTTPException) and resp.status >= 400 and not resp.prepared:
            # aiohttp's own exceptions (413 from `read()`, 405 from the router) are text.
            phrase = HTTPStatus(resp.status).phrase
            refusal = HttpRefusal(resp.status, phrase.lower().replace(" ", "_"), phrase + ".")
            converted = json_error_response(refusal)
            for name in ("Allow", "Retry-After"):
                if name in resp.headers:
                    converted.headers[name] = resp.headers[name]
            resp = converted
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            # Also after an error answered without a route (the header clock still runs).
            self._request = None
            self._disarm()
            if self._phase != "closed":
                self._phase = "idle"
                if self._conn is not None:
                    self._door.table.update(self._conn, evictable=True)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """Every error aiohttp would answer in plain text (and log with the raw bytes)."""
        refusal = refusal_for(exc, status)
        door = self._door
        door.metrics.bad_requests.labels(refusal.code).inc()
        kind = type(exc).__name__ if exc is not None else "none"
        if refusal.status >= 500 and exc is not None and not isinstance(exc, ApiError):
            # Our own bug, not the client's: keep the traceback (redacted) for the fix.
            door.note(
                f"500:{kind}",
                f"unhandled {kind} while handling a request from {request.remote}",
                exc=exc,
            )
        else:
            door.note(
                refusal.code,
                f"refused a request from {request.remote}: {refusal.status} {refusal.code} "
                f"({kind})",
            )
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send an error")
        resp = json_error_response(refusal)
        resp.force_close()
        return resp

    # -- timers and closing -------------------------------------------------------------

    def _arm(self, delay_s: float, callback: Callable[[], None]) -> None:
        """Start a clock: `callback` runs `delay_s` from now (up to a wheel tick late)."""
        self._expired = callback
        Wheel.of(asyncio.get_running_loop()).set(self._clock, clock.monotonic() + delay_s)

    def _disarm(self) -> None:
        self._expired = None
        if self._clock.bucket is not None:
            Wheel.of(asyncio.get_running_loop()).clear(self._clock)

    def _fire(self) -> None:
        expired, self._expired = self._expired, None
        if expired is not None:
            expired()

    def _header_timeout(self) -> None:
        if self._phase != "headers":
            return
        self._door.metrics.timeouts.labels("header").inc()
        self._answer_and_close(
            HttpRefusal(
                408,
                "header_timeout",
                f"The request headers did not arrive within "
                f"{self._door.settings.header_timeout_s:g}s.",
            )
        )

    def _body_timeout(self) -> None:
        request = self._request
        if self._phase != "request" or request is None or request.content.is_eof():
            return
        self._door.metrics.timeouts.labels("body").inc()
        refusal = HttpRefusal(
            408,
            "body_timeout",
            f"The request body did not arrive within {self._door.settings.body_timeout_s:g}s.",
        )
        if request.writer.output_size == 0:
            self._answer_and_close(refusal)
        else:
            self.force_close()

    def _evicted(self) -> None:
        if self._conn is not None:
            self._conn.closer = None
        self._conn = None  # already out of the table
        self._disarm()
        self.force_close()

    def _answer_and_close(self, refusal: HttpRefusal) -> None:
        """Write a whole response and close: the handler task, if any, is cancelled with
        the connection (aiohttp's handler cancellation)."""
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(canned_response(refusal))
        self.force_close()


# ----------------------------------------------------------------------------- site


class _Site(web.BaseSite):
    """A TCP listener whose connections are `_Handler`s (aiohttp's `TCPSite` makes
    plain `RequestHandler`s through the runner's `Server`)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        protocol_factory: Callable[[], _Handler],
        backlog: int,
        reuse_port: bool = False,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        self._host = host
        self._port = port
        self._factory = protocol_factory
        self._reuse_port = reuse_port
        self.bound_port: int | None = None

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self.bound_port or self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._factory,
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=True,
            # Several worker processes on one port (`seawall serve --workers`): the
            # kernel spreads new connections over their listeners.
            reuse_port=self._reuse_port or None,
        )
        sockets = self._server.sockets
        self.bound_port = int(sockets[0].getsockname()[1]) if sockets else self._port


# --------------------------------------------------------------------------- the door


@dataclass
class FrontDoor:
    """The running client listener. Build it with `serve`."""

    settings: ServerConfig
    table: ConnectionTable
    metrics: DoorMetrics
    authorize: Authorize | None
    fd_soft_limit: int
    runner: web.AppRunner | None = None
    site: _Site | None = None
    _throttle: _Throttle = field(default_factory=_Throttle)

    @property
    def port(self) -> int:
        assert self.site is not None and self.site.bound_port is not None
        return self.site.bound_port

    def note(self, key: str, message: str, exc: BaseException | None = None) -> None:
        """Log one line per kind of event per `LOG_EVERY_S` (never client bytes)."""
        skipped = self._throttle.allow(key, clock.monotonic())
        if skipped is None:
            return
        more = f" (and {skipped} more like it since the last line)" if skipped else ""
        if exc is not None:
            log.error("%s%s", message, more, exc_info=exc)
        else:
            log.info("%s%s", message, more)

    async def close(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


async def serve(
    app: web.Application,
    host: str,
    port: int,
    settings: ServerConfig,
    *,
    authorize: Authorize | None = None,
    registry: CollectorRegistry | None = None,
    backlog: int = 1024,
    shutdown_timeout_s: float = 60.0,
    reuse_port: bool = False,
) -> FrontDoor:
    """Listen on `host:port` with `app` behind the front door's rules; `authorize(headers)`
    says whether a request carries a valid key (None: no keys exist). Raises the
    process's descriptor soft limit first, and sizes the caps to what it allows; pins
    glibc's allocator thresholds so that large bodies' memory is returned."""
    install_log_redaction()
    pin_malloc_thresholds()
    fd_soft_limit = raise_fd_limit()
    caps = effective_caps(settings, fd_soft_limit, keys_exist=authorize is not None)
    if caps.max_total < settings.max_connections:
        log.warning(
            "descriptor limit %d allows only %d client connections (server.max_connections "
            "is %d); raise the hard limit (ulimit -Hn / LimitNOFILE) to allow more",
            fd_soft_limit,
            caps.max_total,
            settings.max_connections,
        )
    door = FrontDoor(
        settings,
        ConnectionTable(caps.max_total, caps.max_unkeyed, caps.max_unkeyed_per_address),
        DoorMetrics.create(registry),
        authorize,
        fd_soft_limit,
    )
    door.metrics.open.set_function(lambda: len(door.table))
    door.metrics.unauthenticated.set_function(lambda: door.table.unauthenticated)
    runner = web.AppRunner(
        app, handler_cancellation=True, access_log=None, shutdown_timeout=shutdown_timeout_s
    )
    await runner.setup()
    server = runner.server
    assert server is not None
    loop = asyncio.get_running_loop()

    def protocol_factory() -> _Handler:
        return _Handler(
            door,
            server,
            loop=loop,
            keepalive_timeout=settings.keepalive_timeout_s,
            access_log=None,
            logger=log,
            max_line_size=MAX_REQUEST_LINE_BYTES,
            max_field_size=MAX_HEADER_LINE_BYTES,
            max_headers=MAX_HEADERS,
            lingering_time=LINGERING_S,
        )

    site = _Site(runner, host, port, protocol_factory, backlog, reuse_port)
    door.runner, door.site = runner, site
    try:
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return door
