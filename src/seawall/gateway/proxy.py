"""The request path for `/v1/completions` and `/v1/chat/completions`.

Order of work per request, and why (the stack, written once; see also `stack.py` for the
admission layers that run before any replica is chosen):

1. Refuse while draining: a gateway that is going away must not start new work.
2. Read and parse the body (413, 400): bad input costs nothing upstream.
3. Admission layers (auth, tier limits, rates, tenant concurrency, fleet saturation):
   refuse cheaply at the door, before the engine suffers.
4. Choose a replica (model, routable, not saturated, not yet tried; power of two choices).
5. Open the attempt and hold the client's response until the first token: anything
   that fails before that point is retried on another replica, within the fleet-wide
   retry budget; a hedge (opt-in) races a second replica under the same budget.
6. Relay the stream byte for byte, with the inter-token and total timeouts. After the
   first token there is no retry: a failure ends the stream cleanly (error event, then
   `[DONE]`), unless the tier opted into mid-stream migration.

The client leaving at any stage cancels this handler (aiohttp `handler_cancellation`);
every upstream response is closed on cancellation so the engine aborts the request and
frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import HttpVersion11, web

from seawall import clock
from seawall.config import Timeouts
from seawall.errors import ApiError, rate_limited, unavailable
from seawall.gateway.frontdoor import safe_request_id
from seawall.gateway.h1 import BrokenResponse
from seawall.gateway.idle import IdleDeadline
from seawall.gateway.migrate import combined_usage, continuation_body
from seawall.gateway.replicas import Replica, blocks_for
from seawall.gateway.upstream import AttemptFailed, Opened, open_attempt
from seawall.policy.deadline import first_token_wait
from seawall.protocol.openai import ParsedRequest, Route, parse
from seawall.protocol.sse import (
    ABORT_MARK,
    DONE_EVENT,
    Kind,
    choice_text,
    classify,
    event_bytes,
    usage_of,
)

if TYPE_CHECKING:
    from seawall.gateway.app import Gateway

log = logging.getLogger("seawall.access")

_DONE_TAIL = len(DONE_EVENT)


@dataclass(slots=True)
class RequestCtx:
    request_id: str
    route: Route
    started: float  # monotonic
    timeouts: Timeouts
    req: ParsedRequest | None = None
    tenant: str = "default"
    tier: str = "default"
    status: int = 0
    replica: str = ""
    attempts: int = 0
    ttft_s: float | None = None
    completion_tokens: int = 0
    usage: dict[str, Any] | None = None
    strip_usage: bool = False  # include_usage was added upstream by us
    reconcile: bool = False  # a prompt-token charge to settle with the engine's usage
    track_text: bool = False
    text: str = ""
    error: str = ""
    stage: str = "parsing"
    lease: object | None = None
    migrations: int = 0
    migrate: bool = False
    reserve_tokens: int = 0  # KV tokens this request may grow to (prompt + max_tokens)
    reserved: dict[str, int] = field(default_factory=dict)  # replica id -> blocks reserved
    tokens_before_migration: int = 0  # delivered when the latest continuation began
    opened: Opened | None = None  # the upstream being relayed now
    aborted: bool = False  # the engine ended the stream with finish_reason "abort"
    stream_id: str | None = None  # the first upstream's id and created, kept across migrations
    created: int | None = None

    @property
    def deadline(self) -> float:
        return self.started + self.timeouts.total_s

    @property
    def model(self) -> str:
        return self.req.model if self.req else ""


def new_request_id(incoming: str | None) -> str:
    """The client's `X-Request-Id` when it is safe to forward and log (see
    `frontdoor.safe_request_id`), else a fresh one."""
    return safe_request_id(incoming) or os.urandom(12).hex()


class Proxy:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    # -- entry -------------------------------------------------------------------------

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        gw = self.gw
        ctx = RequestCtx(
            request_id=new_request_id(request.headers.get("X-Request-Id")),
            route=route,
            started=clock.monotonic(),
            timeouts=gw.config.timeouts_for(route),
        )
        gw.inflight += 1
        try:
            return await self._handle(request, ctx)
        except ApiError as e:
            return self._error_response(ctx, e)
        except asyncio.CancelledError:
            gw.metrics.cancellations.labels(ctx.stage).inc()
            ctx.status = 499  # nginx's "client closed request", for the access log only
            ctx.error = f"client left while {ctx.stage}"
            raise
        finally:
            gw.inflight -= 1
            if gw.guard is not None and ctx.lease is not None:
                await gw.guard.release(ctx)
            self._finish(ctx)

    async def _handle(self, request: web.Request, ctx: RequestCtx) -> web.StreamResponse:
        gw = self.gw
        if gw.draining:
            raise unavailable(
                "The gateway is draining; retry on another instance.",
                retry_after_s=gw.config.drain.retry_after_s,
                code="draining",
            )
        req = ctx.req = parse(ctx.route, await self._read_body(request))
        if not gw.replicas.serves(req.model):
            raise ApiError(
                404,
                f"The model `{req.model}` does not exist. Valid models: "
                f"{', '.join(gw.replicas.models()) or '(none yet)'}.",
                param="model",
                code="model_not_found",
            )
        if gw.guard is not None:
            ctx.stage = "queued"
            await gw.guard.admit(request, ctx)
        ctx.stage = "before_first_token" if req.stream else "non_streaming"
        opened = await self._open(ctx)
        if not req.stream:
            return await self._finish_unary(ctx, opened)
        return await self._relay(request, ctx, opened)

    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.gw.config.limits.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise ApiError(
                413, f"Request body is {request.content_length} bytes; the limit is {limit}."
            )
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"Request body is over the limit of {limit} bytes.") from None

    # -- before the first token: choose, attempt, retry, hedge --------------------------

    async def _open(self, ctx: RequestCtx) -> Opened:
        gw = self.gw
        assert ctx.req is not None
        req = ctx.req
        body = req.body_bytes()
        tried: set[str] = set()
        last: AttemptFailed | None = None
        backoff: list[float] = []
        max_attempts = gw.config.retry.max_attempts
        while True:
            now = clock.monotonic()
            replica = self._choose(ctx, now, tried)
            if replica is None:
                raise self._exhausted(ctx, last, backoff, no_replica=not tried)
            if tried:
                if not gw.budget.try_withdraw(now):
                    gw.metrics.retry_budget_exhausted.inc()
                    raise self._exhausted(ctx, last, backoff, budget=True)
                gw.metrics.retries.labels(last.outcome if last else "unknown").inc()
            tried.add(replica.id)
            ctx.attempts += 1
            try:
                if gw.hedge_enabled and not tried - {replica.id} and self._hedge_ok(req):
                    opened = await self._hedged(ctx, replica, body, tried)
                else:
                    opened = await self._attempt(ctx, replica, body)
                return opened
            except AttemptFailed as f:
                last = f
                if f.retry_after_s is not None or f.outcome == "http_429":
                    backoff.append(f.retry_after_s or 1.0)
                if not f.retryable or ctx.attempts >= max_attempts:
                    raise self._exhausted(ctx, last, backoff) from None
                if clock.monotonic() >= ctx.deadline:
                    raise self._exhausted(ctx, last, backoff) from None

    def _choose(self, ctx: RequestCtx, now: float, tried: set[str]) -> Replica | None:
        free, saturated = self.gw.replicas.candidates(ctx.model, now, tried, ctx.reserve_tokens)
        return self.gw.replicas.choose(free or saturated)

    @staticmethod
    def _reserve(replica: Replica, ctx: RequestCtx) -> None:
        if ctx.reserve_tokens:
            blocks = blocks_for(ctx.reserve_tokens, replica.kv_block_size)
            replica.reserved_blocks += blocks
            ctx.reserved[replica.id] = ctx.reserved.get(replica.id, 0) + blocks

    async def _attempt(self, ctx: RequestCtx, replica: Replica, body: bytes) -> Opened:
        gw = self.gw
        assert ctx.req is not None
        wait = first_token_wait(
            clock.monotonic(), ctx.deadline, ctx.timeouts.ttft_s, ctx.req.stream
        )
        replica.inflight += 1
        self._reserve(replica, ctx)
        gw.metrics.inflight.labels(replica.id).inc()
        ok = False
        try:
            opened = await open_attempt(
                gw.pool,
                replica,
                ctx.req,
                body,
                ctx.request_id,
                max(wait.seconds, 0.001),
                wait.kind + "_timeout",
            )
            ok = True
            return opened
        except AttemptFailed as f:
            self._attempt_failed(replica, f)
            raise
        except asyncio.CancelledError:
            gw.metrics.upstream_attempts.labels(replica.id, "cancelled").inc()
            raise
        finally:
            if not ok:
                replica.inflight -= 1
                replica.reserved_blocks -= ctx.reserved.pop(replica.id, 0)
                gw.metrics.inflight.labels(replica.id).dec()

    def _attempt_failed(self, replica: Replica, f: AttemptFailed) -> None:
        gw = self.gw
        now = clock.monotonic()
        gw.metrics.upstream_attempts.labels(replica.id, f.outcome).inc()
        if f.outcome in ("ttft_timeout", "total_timeout"):
            gw.metrics.timeouts.labels(f.outcome.removesuffix("_timeout")).inc()
        if f.outcome == "connect_error":
            replica.ejected_until = now + gw.config.retry.eject_s
        elif f.outcome == "http_429":
            replica.backoff_until = now + (f.retry_after_s or 1.0)
        if f.outcome != "http_4xx":
            replica.observe_outcome(False)

    def _hedge_ok(self, req: ParsedRequest) -> bool:
        gw = self.gw
        # Bytes / 4 is a cheap upper-bound-ish estimate of prompt tokens; hedging only
        # needs to tell short prompts from long ones.
        prompt_tokens = len(req.raw) // 4
        return gw.hedge.allows(prompt_tokens, gw.fleet_load())

    async def _hedged(
        self, ctx: RequestCtx, first: Replica, body: bytes, tried: set[str]
    ) -> Opened:
        """Race a delayed second copy against a slow first attempt; the first token wins."""
        gw = self.gw
        primary = asyncio.ensure_future(self._attempt(ctx, first, body))
        done, _ = await asyncio.wait({primary}, timeout=gw.hedge.delay_s)
        if done:
            return primary.result()
        assert ctx.req is not None
        now = clock.monotonic()
        second = self._choose(ctx, now, tried)
        if second is None or not gw.budget.try_withdraw(now):
            if second is not None:
                gw.metrics.retry_budget_exhausted.inc()
            return await primary
        tried.add(second.id)
        ctx.attempts += 1
        gw.metrics.hedges.labels("launched").inc()
        secondary = asyncio.ensure_future(self._attempt(ctx, second, body))
        pending = {primary, secondary}
        failure: BaseException | None = None
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is None:
                        winner = task.result()
                        gw.metrics.hedges.labels("won" if task is secondary else "lost").inc()
                        for loser in pending:
                            loser.cancel()
                            other = second if task is primary else first
                            gw.metrics.upstream_attempts.labels(other.id, "hedge_lost").inc()
                        return winner
                    failure = task.exception()
            assert failure is not None
            raise failure
        finally:
            for task in (primary, secondary):
                if not task.done():
                    task.cancel()

    def _exhausted(
        self,
        ctx: RequestCtx,
        last: AttemptFailed | None,
        backoff: list[float],
        *,
        no_replica: bool = False,
        budget: bool = False,
    ) -> ApiError:
        gw = self.gw
        if last is None:
            return unavailable(
                f"No replica of `{ctx.model}` is available right now.",
                retry_after_s=1.0,
                code="no_replica",
            )
        ctx.error = last.message
        if last.outcome == "http_429" or (backoff and no_replica):
            retry_after = min(backoff) if backoff else 1.0
            return rate_limited(
                "Every replica serving this model asked the gateway to back off; "
                "retry after the indicated time.",
                retry_after,
                code="engine_busy",
            )
        if last.outcome == "http_4xx" and last.status is not None:
            return _pass_through(last.status, last.body or b"", last.content_type)
        if last.outcome in ("ttft_timeout", "total_timeout"):
            kind = "time to first token" if last.outcome == "ttft_timeout" else "total"
            return ApiError(
                504,
                f"Upstream timed out ({kind} timeout) after {ctx.attempts} attempt(s).",
                code=last.outcome,
            )
        if last.outcome == "http_5xx" and last.status is not None and last.body:
            return _pass_through(last.status, last.body, last.content_type)
        if last.outcome == "connect_error":
            return unavailable(
                f"No replica of `{ctx.model}` accepted the connection.",
                retry_after_s=gw.config.retry.eject_s,
                code="no_replica",
            )
        suffix = " (retry budget exhausted)" if budget else ""
        return ApiError(502, f"Upstream failed: {last.message}{suffix}", code=last.outcome)

    # -- after the first token ----------------------------------------------------------

    async def _finish_unary(self, ctx: RequestCtx, opened: Opened) -> web.StreamResponse:
        gw = self.gw
        replica = opened.replica
        ctx.replica = replica.id
        try:
            body = opened.body or b""
            ctx.ttft_s = opened.first_token_at - ctx.started
            self._attempt_ok(replica, ctx, opened)
            if ctx.reconcile:
                try:
                    obj = orjson.loads(body)
                    ctx.usage = usage_of(obj) if isinstance(obj, dict) else None
                except orjson.JSONDecodeError:
                    pass
            ctx.status = 200
            gw.budget.deposit(clock.monotonic())
            return web.Response(
                body=body,
                status=200,
                content_type="application/json",
                headers={"X-Request-Id": ctx.request_id},
            )
        finally:
            self._release(replica, opened, ctx)

    def _attempt_ok(self, replica: Replica, ctx: RequestCtx, opened: Opened) -> None:
        gw = self.gw
        gw.metrics.upstream_attempts.labels(replica.id, "ok").inc()
        replica.observe_ttft(opened.first_token_at - opened.opened_at)
        ttft = opened.first_token_at - ctx.started
        gw.metrics.ttft.labels(ctx.model).observe(ttft)
        if gw.admin is not None and len(gw.recent_ttft_s) < 10_000:
            gw.recent_ttft_s.append(ttft)

    def _release(self, replica: Replica, opened: Opened, ctx: RequestCtx) -> None:
        opened.close()
        replica.inflight -= 1
        replica.reserved_blocks -= ctx.reserved.pop(replica.id, 0)
        self.gw.metrics.inflight.labels(replica.id).dec()

    async def _relay(
        self, request: web.Request, ctx: RequestCtx, opened: Opened
    ) -> web.StreamResponse:
        gw = self.gw
        replica = opened.replica
        ctx.replica = replica.id
        ctx.ttft_s = opened.first_token_at - ctx.started
        self._attempt_ok(replica, ctx, opened)
        resp = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": opened.conn.headers.get(
                    "content-type", "text/event-stream; charset=utf-8"
                ),
                "Cache-Control": "no-cache",
                "X-Request-Id": ctx.request_id,
            },
        )
        ctx.stage = "streaming"
        ctx.status = 200
        replica.streams += 1
        try:
            return await self._stream(request, ctx, opened, resp)
        except ConnectionResetError:
            # The client went away between two writes (aiohttp raises on the write
            # rather than cancelling the handler): the same as any client disconnect.
            gw.metrics.cancellations.labels("streaming").inc()
            ctx.status, ctx.error = 499, "client left while streaming"
            return resp
        finally:
            current = ctx.opened or opened
            current.replica.streams -= 1
            self._release(current.replica, current, ctx)

    async def _stream(
        self, request: web.Request, ctx: RequestCtx, opened: Opened, resp: web.StreamResponse
    ) -> web.StreamResponse:
        gw = self.gw
        ctx.opened = opened
        await resp.prepare(request)
        end = await self._pump(request, ctx, opened, resp, head=True)
        while end != "done" and self._may_migrate(ctx, end):
            opened.replica.observe_outcome(False)
            nxt = await self._continue_elsewhere(ctx, opened.replica)
            if nxt is None:
                break
            opened.replica.streams -= 1
            self._release(opened.replica, opened, ctx)
            opened = ctx.opened = nxt
            opened.replica.streams += 1
            ctx.stage = "streaming"
            ctx.replica = opened.replica.id
            end = await self._pump(request, ctx, opened, resp, head=True)
        if end == "done" and ctx.aborted:
            # Relayed as the engine sent it (finish_reason "abort", then [DONE]), but the
            # answer was cut short: a dropped stream all the same.
            opened.replica.observe_outcome(False)
            gw.metrics.stream_errors.labels("upstream_aborted").inc()
            ctx.error = "upstream_aborted"
        elif end == "done":
            gw.budget.deposit(clock.monotonic())
            opened.replica.observe_outcome(True)
        else:
            opened.replica.observe_outcome(False)
            gw.metrics.stream_errors.labels(end).inc()
            ctx.error = end
            await resp.write(
                ApiError(
                    504 if end.endswith("timeout") else 502,
                    _end_message(end),
                    code=end,
                ).sse_event()
            )
        await resp.write_eof()
        return resp

    async def _pump(
        self,
        request: web.Request,
        ctx: RequestCtx,
        opened: Opened,
        resp: web.StreamResponse,
        head: bool,
    ) -> str:
        """Relay until the stream ends; return "done" or the reason it ended badly.

        The head (the events up to the first token) is written through aiohttp, which
        also puts the response's headers on the wire. After it, chunks go from the
        upstream's socket callback straight to the client's transport (`_Relay.feed`);
        this coroutine only waits for the end, a timeout, or a full client socket."""
        parse_events = ctx.strip_usage or ctx.track_text or ctx.reconcile
        tail = b""
        if head and opened.head:
            if parse_events:
                out = self._filter(ctx, [e.raw for e in opened.head])
            else:
                # Raw relay: the head's events, then whatever partial event followed them.
                out = b"".join(e.raw for e in opened.head) + opened.sse.pending
                tail = out[-_DONE_TAIL:]
                ctx.aborted = ctx.aborted or ABORT_MARK in out
            if out:
                await resp.write(out)
            if ctx.stage == "aborted":
                return "upstream_aborted"
            if any(e.kind is Kind.DONE for e in opened.head):
                return "done"
        conn = opened.conn
        timer = IdleDeadline(ctx.timeouts.itl_s, ctx.deadline, opened.first_token_at)
        relay = _Relay(self, request, ctx, opened, parse_events, timer, tail)
        conn.relay(relay.feed)
        try:
            while True:
                await conn.wait_relay()
                if relay.end == "client_left":
                    raise ConnectionResetError("client left while streaming")
                if relay.end is not None and (conn.stopped or conn.complete):
                    return relay.end
                if conn.complete:
                    return "done" if relay.tail.endswith(DONE_EVENT) else "upstream_closed"
                if conn.paused:
                    await resp.drain()
                    conn.resume()
        except asyncio.CancelledError:
            kind = timer.expired()
            if kind is None:
                raise
            self.gw.metrics.timeouts.labels(kind).inc()
            return f"{kind}_timeout"
        except BrokenResponse as e:
            ctx.error = str(e)
            return "upstream_reset"
        finally:
            conn.detach()
            timer.close()

    def _filter(self, ctx: RequestCtx, events: list[bytes]) -> bytes:
        """Event-level relay: capture usage, strip the usage chunk we added, track the text
        delivered (for migration), and after a migration present the continuation as the
        same stream (original id and created, no second role chunk, one usage)."""
        out: list[bytes] = []
        migrated = ctx.migrations > 0
        for raw in events:
            ev = classify(raw)
            obj = ev.obj
            if ev.kind is Kind.USAGE and obj is not None:
                usage = usage_of(obj)
                if migrated and usage is not None:
                    usage = combined_usage(usage, ctx.tokens_before_migration)
                ctx.usage = usage
                if ctx.strip_usage:
                    continue
                if migrated:
                    raw = event_bytes(
                        {**obj, "id": ctx.stream_id, "created": ctx.created, "usage": usage}
                    )
            elif ev.kind is Kind.TOKEN and obj is not None:
                if ctx.stream_id is None:
                    ctx.stream_id, ctx.created = obj.get("id"), obj.get("created")
                if ctx.track_text:
                    text = "".join(choice_text(c) for c in obj["choices"])
                    if text:
                        ctx.text += text
                        ctx.completion_tokens += 1
                if migrated:
                    raw = event_bytes({**obj, "id": ctx.stream_id, "created": ctx.created})
            elif ev.kind is Kind.PRELUDE and obj is not None:
                if migrated:
                    continue  # the continuation's own role chunk: the client has one already
                if ctx.stream_id is None:
                    ctx.stream_id, ctx.created = obj.get("id"), obj.get("created")
            elif ev.kind is Kind.ABORT:
                if ctx.migrate:
                    # Hold the abort back: another replica may finish the answer.
                    ctx.stage = "aborted"
                    break
                ctx.aborted = True
            elif ev.kind is Kind.DONE:
                ctx.stage = "done"
            out.append(raw)
        return b"".join(out)

    def _may_migrate(self, ctx: RequestCtx, end: str) -> bool:
        return (
            ctx.migrate
            and end in _MIGRATABLE
            and ctx.migrations < self.gw.config.retry.max_migrations
        )

    async def _continue_elsewhere(self, ctx: RequestCtx, failed: Replica) -> Opened | None:
        """Open the continuation on another replica, within the retry budget."""
        gw = self.gw
        req = ctx.req
        assert req is not None
        body = continuation_body(req, ctx.text, ctx.completion_tokens)
        now = clock.monotonic()
        if body is None:
            gw.metrics.migrations.labels("refused").inc()
            return None
        if not gw.budget.try_withdraw(now):
            gw.metrics.retry_budget_exhausted.inc()
            gw.metrics.migrations.labels("refused").inc()
            return None
        tried = {failed.id}
        while True:
            replica = self._choose(ctx, clock.monotonic(), tried)
            if replica is None or clock.monotonic() >= ctx.deadline:
                gw.metrics.migrations.labels("failed").inc()
                return None
            tried.add(replica.id)
            try:
                opened = await self._attempt(ctx, replica, body)
            except AttemptFailed:
                if len(tried) > gw.config.retry.max_attempts:
                    gw.metrics.migrations.labels("failed").inc()
                    return None
                continue
            ctx.migrations += 1
            ctx.attempts += 1
            ctx.tokens_before_migration = ctx.completion_tokens
            if not req.include_usage:
                ctx.strip_usage = True  # the continuation asked for usage; the client did not
            gw.metrics.migrations.labels("ok").inc()
            return opened

    # -- responses and bookkeeping ------------------------------------------------------

    def _error_response(self, ctx: RequestCtx, e: ApiError) -> web.Response:
        ctx.status = e.status
        ctx.error = ctx.error or e.message
        headers = {"X-Request-Id": ctx.request_id, **e.headers}
        headers["Content-Type"] = e.content_type
        return web.Response(body=e.json_bytes(), status=e.status, headers=headers)

    def _finish(self, ctx: RequestCtx) -> None:
        gw = self.gw
        elapsed = clock.monotonic() - ctx.started
        model = ctx.model or "unknown"
        gw.metrics.requests.labels(model, ctx.route, str(ctx.status)).inc()
        if ctx.status == 200:
            gw.metrics.e2e.labels(model).observe(elapsed)
        if gw.access_log:
            log.info(
                "%s",
                orjson.dumps(
                    {
                        "request_id": ctx.request_id,
                        "route": ctx.route,
                        "model": model,
                        "tenant": ctx.tenant,
                        "status": ctx.status,
                        "replica": ctx.replica,
                        "attempts": ctx.attempts,
                        "ttft_s": None if ctx.ttft_s is None else round(ctx.ttft_s, 4),
                        "duration_s": round(elapsed, 4),
                        "error": ctx.error or None,
                    }
                ).decode(),
            )


class _Relay:
    """One upstream's body on its way to the client, from the upstream's socket callback.

    `feed` runs once per read from the replica: it records the inter-token gap (metrics,
    the replica's ITL average, the idle timer), then writes the bytes to the client's
    transport, framed as one HTTP chunk. Event-level work (`Proxy._filter`) happens only
    when the request needs it; otherwise the bytes pass as the engine wrote them."""

    __slots__ = (
        "_client",
        "_filter",
        "_framed",
        "_itl",
        "_proxy",
        "_sse",
        "conn",
        "ctx",
        "end",
        "replica",
        "tail",
        "timer",
        "transport",
    )

    def __init__(
        self,
        proxy: Proxy,
        request: web.Request,
        ctx: RequestCtx,
        opened: Opened,
        parse: bool,
        timer: IdleDeadline,
        tail: bytes,
    ) -> None:
        transport = request.transport
        if transport is None:
            raise ConnectionResetError("client left while streaming")
        self.transport = transport
        self._client = request.protocol
        self._framed = request.version >= HttpVersion11  # aiohttp chunks 1.1 responses
        self._proxy = proxy
        self._filter = parse
        self._sse = opened.sse
        self._itl = proxy.gw.metrics.itl.labels(ctx.model)
        self.conn = opened.conn
        self.ctx = ctx
        self.replica = opened.replica
        self.timer = timer  # its `last` is when the latest chunk arrived
        self.tail = tail  # the stream's last bytes: does it end with [DONE]?
        self.end: str | None = None  # set when the stream's end is known from its events

    def feed(self, data: bytes) -> bool:
        if self.end is not None:
            return True
        now = clock.monotonic()
        timer = self.timer
        gap = now - timer.last
        timer.last = now
        self._itl.observe(gap)
        replica = self.replica
        replica.observe_itl(gap)
        replica.chunks_relayed += 1
        ctx = self.ctx
        if self._filter:
            out = self._proxy._filter(ctx, self._sse.feed(data))
            if out:
                self.tail = out[-_DONE_TAIL:]
        else:
            out = data
            self.tail = (self.tail + data)[-_DONE_TAIL:]
            if ABORT_MARK in data:
                ctx.aborted = True
        if out:
            transport = self.transport
            if transport.is_closing():
                self.end = "client_left"
                return False
            transport.write(b"%x\r\n%b\r\n" % (len(out), out) if self._framed else out)
            if self._client.writing_paused:
                self.conn.pause()
        if self._filter:
            if ctx.stage == "done":
                # Keep the connection for reuse when the response's end came in this read.
                self.end = "done"
                return self.conn.complete
            if ctx.stage == "aborted":
                self.end = "upstream_aborted"
                return False
        return True


def _pass_through(status: int, raw: bytes, content_type: str) -> ApiError:
    """An upstream error relayed as the engine wrote it (already OpenAI-shaped)."""
    return ApiError(status, raw[:200].decode(errors="replace"), raw=raw, content_type=content_type)


# Ways a stream can end that another replica can continue from.
_MIGRATABLE = frozenset({"upstream_reset", "upstream_closed", "itl_timeout", "upstream_aborted"})


def _end_message(end: str) -> str:
    return {
        "itl_timeout": "The upstream replica stopped sending tokens (inter-token timeout).",
        "total_timeout": "The request reached its total deadline.",
        "upstream_reset": "The upstream replica failed mid-stream.",
        "upstream_closed": "The upstream replica closed the stream before it finished.",
        "upstream_aborted": "The upstream replica aborted the request (it is shutting down).",
    }.get(end, f"The stream ended early: {end}.")
