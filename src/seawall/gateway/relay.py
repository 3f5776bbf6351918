"""After the first token: relay the stream byte for byte, with the inter-token and total
timeouts, and end it cleanly whatever happens.

The head (the events up to the first token) goes out with the response's headers. To an
HTTP/1.1 client, both are written from the upstream's socket callback the moment the
first token arrives (`Relay.commit`, called by `upstream._Head`), as aiohttp would write
them, the head filtered first when the stream is read event by event; otherwise (an
HTTP/1.0 client, a head that already holds the usage or the end, an event-level stream
in another dialect) through aiohttp, once the attempt's coroutine has the token. After
it, each read from the replica is written to the client's transport from the upstream's
socket callback (`_Feed.feed`), with no task switch per chunk; the relaying coroutine
only waits for the end, a timeout, or a full client socket (then reading from the
replica pauses until the client drains).

There is no retry after the first token: the client holds part of the answer. A failure
ends the stream with an error event and `data: [DONE]`, unless the tier opted into
migration (`migrate.py`): then the rest of the answer comes from another replica on the
same client stream, under the same retry budget. At the gateway's drain deadline a stream
still running is ended the same clean way (`gateway_draining`).

Event-level work (`_filter`) happens only when the request needs it (usage to strip or
reconcile, text to track for migration); otherwise bytes pass as the engine wrote them.

Must not: choose replicas (the dispatcher does, for continuations too) or refuse
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

import orjson
from aiohttp import HttpVersion11, web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE

from seawall import clock
from seawall.gateway.context import RequestCtx, StreamState
from seawall.gateway.dispatch import Dispatcher
from seawall.gateway.h1 import BrokenResponse
from seawall.gateway.idle import IdleDeadline
from seawall.gateway.migrate import combined_usage, continuation_body, running_count
from seawall.gateway.outcomes import STREAM_RULES, StreamEnd, stream_error
from seawall.gateway.replicas import Replica
from seawall.gateway.upstream import AttemptFailed, Commit, CommitFor, Opened
from seawall.metrics import Metrics
from seawall.policy.retry_budget import RetryBudget
from seawall.protocol.sse import (
    ABORT_MARK,
    CLASSIFY,
    DONE_EVENT,
    Dialect,
    EndWatch,
    Event,
    Kind,
    body_usage,
    choice_text,
    classify,
    error_event,
    event_bytes,
    event_usage,
    usage_of,
)

# The raw relay keeps the stream's last bytes: enough to see `[DONE]` at its end, and an
# abort mark that one socket read split from the next (OpenAI chunks); enough to see a
# terminal event's field line that one read split from the next (the other dialects).
_TAIL = max(len(DONE_EVENT), len(ABORT_MARK))

_CLIENT_LEFT = "client_left"

# What a head read event by event may hold for `commit` to filter it: the role chunk,
# tokens and comments (not the usage, an abort or the end: the relay's coroutine's).
_HEAD_KINDS = frozenset((Kind.PRELUDE, Kind.TOKEN, Kind.COMMENT))
_SSE_TYPE = "text/event-stream; charset=utf-8"  # when the engine names none

# How long a stream whose answer has ended (`[DONE]`) waits for its upstream's response to
# end before the client is given the end anyway (and the upstream connection is closed).
DONE_GRACE_S = 1.0


class ClientLeft(ConnectionResetError):
    """The client went away while its stream was being written."""


class Relay:
    def __init__(
        self,
        *,
        dispatcher: Dispatcher,
        budget: RetryBudget,
        metrics: Metrics,
        max_migrations: int,
        migration_ttft_s: float,
    ) -> None:
        self.dispatcher = dispatcher
        self.budget = budget
        self.metrics = metrics
        self.max_migrations = max_migrations
        self.migration_ttft_s = migration_ttft_s

    async def unary(self, ctx: RequestCtx, opened: Opened) -> web.Response:
        """A non-streaming answer, relayed as the engine wrote it."""
        try:
            self.dispatcher.first_token(ctx, opened)
            body = opened.body or b""
            if ctx.reconcile or ctx.admission is not None:  # adaptive admission learns it
                try:
                    # In OpenAI's words whatever the route's vocabulary (input_tokens...).
                    ctx.usage = body_usage(orjson.loads(body))
                except orjson.JSONDecodeError:
                    pass
            ctx.status = 200
            self.budget.deposit(clock.monotonic())
            opened.replica.observe_outcome(True)
            return web.Response(
                body=body,
                status=200,
                headers={
                    # The engine's: audio answers may be text, SRT or VTT.
                    "Content-Type": opened.conn.headers.get("content-type", "application/json"),
                    "X-Request-Id": ctx.request_id,
                },
            )
        finally:
            opened.close()

    def commit(self, request: web.Request, ctx: RequestCtx) -> CommitFor | None:
        """The writer of this request's response head and first token from the upstream's
        socket callback, or None when the client does not speak HTTP/1.1 (no chunks) or
        the stream's events are read in a dialect other than OpenAI's (`_filter_typed`).
        A stream read event by event (`_parses_events`: migration, usage to read or
        strip) has its head filtered here as `_pump` would; one whose head holds more
        than the role and tokens (usage, an abort) is left to the relay's coroutine."""
        req = ctx.req
        if req is None or not req.stream:
            return None
        parse = _parses_events(ctx)
        if parse and req.dialect is not Dialect.openai:
            return None
        if request.version != HttpVersion11:
            return None
        close = "" if request.keep_alive else "Connection: close\r\n"

        def commit_for(strip: frozenset[str]) -> Commit:
            def commit(headers: Mapping[str, str], events: list[Event], pending: bytes) -> bool:
                transport = request.transport
                if transport is None or transport.is_closing():
                    return False  # the client left: the attempt's cancellation says so
                if not parse:
                    out = b"".join(e.raw for e in events) + pending
                elif all(e.kind in _HEAD_KINDS for e in events):
                    self._counting(ctx, strip)
                    out, _ = self._filter(ctx, [e.raw for e in events])
                else:
                    return False
                # Ours (the engine's content type cannot hold CR or LF: llhttp refuses
                # them), then those aiohttp adds to a chunked HTTP/1.1 response.
                ours = _stream_headers(headers, ctx.request_id)
                head = "".join(f"{k}: {v}\r\n" for k, v in ours.items())
                head = (
                    f"HTTP/1.1 200 OK\r\n{head}Transfer-Encoding: chunked\r\n"
                    f"Date: {rfc822_formatted_time()}\r\nServer: {SERVER_SOFTWARE}\r\n"
                    f"{close}\r\n"
                )
                data = head.encode("latin-1")
                if out:  # (an empty chunk would end the body)
                    data += b"%x\r\n%b\r\n" % (len(out), out)
                transport.write(data)
                # Counted where aiohttp counts what it wrote: the front door's last resort
                # answers an error only to a client that has received nothing.
                request.writer.output_size += len(data)
                ctx.stream.head_sent = True
                return True

            return commit

        return commit_for

    async def end_committed(
        self, request: web.Request, ctx: RequestCtx, end: StreamEnd
    ) -> web.StreamResponse:
        """End a stream whose head went out from the socket callback (`commit`) before the
        relay took it over (the gateway's drain cut came in between): the error event and
        the response's end, as `_relay` ends any broken stream."""
        resp = _SentStream(status=200)
        ctx.status = 200
        ctx.error = end.value
        self.metrics.stream_errors.labels(end.value).inc()
        with contextlib.suppress(ConnectionResetError):
            await resp.prepare(request)
            await resp.write_eof(_error_event(ctx, end, 0))
        return resp

    async def stream(
        self, request: web.Request, ctx: RequestCtx, opened: Opened
    ) -> web.StreamResponse:
        self.dispatcher.first_token(ctx, opened)
        st = ctx.stream
        resp: web.StreamResponse
        if st.head_sent:
            resp = _SentStream(status=200)  # its headers are on the wire (`commit`)
        else:
            resp = _EventStream(
                status=200, headers=_stream_headers(opened.conn.headers, ctx.request_id)
            )
        ctx.stage = "streaming"
        ctx.status = 200
        st.opened = opened
        self._counting(ctx, opened.strip)
        if opened.hold is not None:
            opened.hold.stream()
        try:
            await resp.prepare(request)
            await self._relay(request, ctx, resp)
        except ConnectionResetError:
            # The client went away between two writes (aiohttp raises on the write
            # rather than cancelling the handler): the same as any client disconnect.
            self.metrics.cancellations.labels("streaming").inc()
            ctx.status, ctx.error = 499, "client left while streaming"
        finally:
            current = st.opened or opened
            current.close()
        return resp

    @staticmethod
    def _counting(ctx: RequestCtx, strip: frozenset[str]) -> None:
        """What this upstream was asked for on our behalf (`Opened.strip`) is stripped
        from the client's stream: the per-chunk counts, and the usage chunk if the client
        did not ask."""
        st = ctx.stream
        st.strip = strip
        if "usage" in strip and ctx.req is not None and not ctx.req.include_usage:
            st.strip_usage = True

    async def _relay(self, request: web.Request, ctx: RequestCtx, resp: web.StreamResponse) -> None:
        st = ctx.stream
        opened = st.opened
        assert opened is not None
        assert ctx.req is not None
        watch = EndWatch(ctx.req.dialect)  # events relayed, and the raw end (not openai)
        end = await self._pump(request, ctx, opened, resp, watch, head_written=st.head_sent)
        while end is not StreamEnd.done and self._may_migrate(ctx, end):
            opened.replica.observe_outcome(False)
            nxt = await self._continue_elsewhere(ctx, opened.replica)
            if nxt is None:
                break
            opened.close()
            opened = st.opened = nxt
            self._counting(ctx, nxt.strip)
            if nxt.hold is not None:
                nxt.hold.stream()
            ctx.stage = "streaming"
            ctx.replica = nxt.replica.id
            end = await self._pump(request, ctx, opened, resp, watch)
        # The stream's final bytes, held back by the feed to go out with the end (`_send`).
        last, st.last = st.last, b""
        if end is StreamEnd.done and st.aborted:
            # Relayed as the engine sent it (finish_reason "abort", then [DONE]), but the
            # answer was cut short: a dropped stream all the same.
            end = StreamEnd.upstream_aborted
            opened.replica.observe_outcome(False)
            self.metrics.stream_errors.labels(end.value).inc()
            ctx.error = end.value
        elif end is StreamEnd.done:
            if last:
                # The answer's last bytes and the terminating chunk, in one write (a client
                # gone before it did not get `[DONE]`: it left).
                await resp.write_eof(last)
            else:
                # The client has the whole answer, `[DONE]` included; SDKs close the
                # connection as soon as they read it, so the terminating chunk may find
                # it gone. That is a complete stream, not a client that left.
                with contextlib.suppress(ConnectionResetError):
                    await resp.write_eof()
            self.budget.deposit(clock.monotonic())
            opened.replica.observe_outcome(True)
            return
        else:
            if STREAM_RULES[end].replica_fault:
                opened.replica.observe_outcome(False)
            self.metrics.stream_errors.labels(end.value).inc()
            ctx.error = end.value
            last += _error_event(ctx, end, watch.events)
        await resp.write_eof(last)

    async def _pump(
        self,
        request: web.Request,
        ctx: RequestCtx,
        opened: Opened,
        resp: web.StreamResponse,
        watch: EndWatch,
        head_written: bool = False,
    ) -> StreamEnd:
        """Relay until the stream ends; return how it ended. `head_written`: the head is
        on the client's wire already (`commit`)."""
        st = ctx.stream
        assert ctx.req is not None
        dialect = ctx.req.dialect
        parse_events = _parses_events(ctx)
        tail = b""
        if opened.head:
            if parse_events:
                watch.events += len(opened.head)
                if head_written:
                    out, end = b"", None  # filtered and written by `commit`
                else:
                    out, end = self._filter(ctx, [e.raw for e in opened.head])
            else:
                # Raw relay: the head's events, then whatever partial event followed them.
                out = b"".join(e.raw for e in opened.head) + opened.sse.pending
                if dialect is Dialect.openai:
                    tail = out[-_TAIL:]
                    st.aborted = st.aborted or ABORT_MARK in out
                else:
                    watch.see(out)  # a terminal event may begin after the head's events
                done = any(e.terminal for e in opened.head)
                end = StreamEnd.done if done else None
            if end is StreamEnd.done:
                # A whole answer in the head: headers, answer and terminating chunk go out
                # in one write (`_relay`).
                st.last = out
                return end
            if not head_written:
                # Puts the headers on the wire, with the head when it has bytes (one write).
                await resp.write(out)
            if end is not None:
                return end
        conn = opened.conn
        timer = IdleDeadline(ctx.timeouts.itl_s, ctx.deadline, opened.first_token_at)
        feed = _Feed(self, request, ctx, opened, parse_events, timer, tail)
        if dialect is Dialect.openai:
            conn.relay(feed.feed)
        else:
            feed.watch = watch
            conn.relay(feed.feed_marked)
        try:
            while True:
                await conn.wait_relay()
                if feed.end == _CLIENT_LEFT:
                    raise ClientLeft("client left while streaming")
                if isinstance(feed.end, StreamEnd) and (conn.stopped or conn.complete):
                    return feed.end
                if conn.complete:
                    return StreamEnd.done if feed.finished() else StreamEnd.upstream_closed
                if conn.paused:
                    await resp.drain()
                    conn.resume()
        except asyncio.CancelledError:
            kind = timer.expired()
            if kind is not None:
                if feed.end is StreamEnd.done:
                    return feed.end  # the answer was whole; its response never ended
                self.metrics.timeouts.labels(kind).inc()
                return StreamEnd(f"{kind}_timeout")
            if _uncancel_cut(ctx):
                return StreamEnd.gateway_draining
            raise
        except BrokenResponse as e:
            if feed.end is StreamEnd.done:
                return feed.end  # the answer was whole; the connection broke after it
            ctx.error = str(e)
            return StreamEnd.upstream_reset
        finally:
            conn.detach()
            timer.close()

    def _filter(self, ctx: RequestCtx, events: list[bytes]) -> tuple[bytes, StreamEnd | None]:
        """Event-level relay: capture usage, strip the usage chunk we added, track the text
        delivered (for migration), and after a migration present the continuation as the
        same stream (original id and created, no second role chunk, one usage).
        Returns the bytes to write and, when these events end the stream, how."""
        assert ctx.req is not None
        if ctx.req.dialect is not Dialect.openai:
            return self._filter_typed(ctx, events, ctx.req.dialect)
        st = ctx.stream
        out: list[bytes] = []
        migrated = st.migrations > 0
        end: StreamEnd | None = None
        for raw in events:
            ev = classify(raw)
            obj = ev.obj
            if ev.kind is Kind.USAGE and obj is not None:
                usage = usage_of(obj)
                if migrated and usage is not None:
                    usage = combined_usage(usage, st.tokens_before_migration, st.prompt_tokens)
                ctx.usage = usage
                if st.strip_usage:
                    continue
                if migrated:
                    raw = event_bytes(
                        {**obj, "id": st.stream_id, "created": st.created, "usage": usage}
                    )
            elif ev.kind is Kind.TOKEN and obj is not None:
                if st.stream_id is None:
                    st.stream_id, st.created = obj.get("id"), obj.get("created")
                if st.track_text:
                    self._count(st, obj)
                relayed = _without(obj, st.strip)
                usage = usage_of(obj)
                if usage is not None:
                    # Some engines (llama.cpp) put the final usage on the last token chunk.
                    if migrated:
                        usage = combined_usage(usage, st.tokens_before_migration, st.prompt_tokens)
                        if "usage" in relayed:
                            relayed = {**relayed, "usage": usage}
                    ctx.usage = usage
                if migrated:
                    raw = event_bytes({**relayed, "id": st.stream_id, "created": st.created})
                elif relayed is not obj:
                    raw = event_bytes(relayed)
            elif ev.kind is Kind.PRELUDE and obj is not None:
                if st.track_text:
                    # A chunk without text still counts: a role chunk may carry the prompt's
                    # count, and llama.cpp sends a held-back token as an empty chunk.
                    self._count(st, obj)
                if migrated:
                    continue  # the continuation's own role chunk: the client has one already
                if st.stream_id is None:
                    st.stream_id, st.created = obj.get("id"), obj.get("created")
                stripped = _without(obj, st.strip)
                if stripped is not obj:
                    raw = event_bytes(stripped)
            elif ev.kind is Kind.ABORT:
                if st.migrate:
                    # Hold the abort back: another replica may finish the answer.
                    end = StreamEnd.upstream_aborted
                    break
                st.aborted = True
            elif ev.kind is Kind.DONE:
                end = StreamEnd.done
            out.append(raw)
        return b"".join(out), end

    @staticmethod
    def _filter_typed(
        ctx: RequestCtx, events: list[bytes], dialect: Dialect
    ) -> tuple[bytes, StreamEnd | None]:
        """Event-level relay of the Responses and Anthropic dialects: the bytes pass as
        the engine wrote them; the usage their events report is read (for token-rate
        reconciliation, in OpenAI's words), and the terminal event ends the stream."""
        classify_event = CLASSIFY[dialect]
        end: StreamEnd | None = None
        for raw in events:
            ev = classify_event(raw)
            usage = event_usage(dialect, ev)
            if usage:
                # Anthropic reports the prompt at the start and the output at the end.
                ctx.usage = {**(ctx.usage or {}), **usage}
            if ev.terminal:
                end = StreamEnd.done
        return b"".join(events), end

    @staticmethod
    def _count(st: StreamState, obj: dict[str, Any]) -> None:
        """Delivered text and tokens, from the count the engine reports on the chunk when
        it does (see `migrate.running_count`), else one token per chunk with text."""
        text = "".join(choice_text(c) for c in obj.get("choices") or ())
        if text:
            st.text_parts.append(text)
        count, prompt = running_count(obj)
        if count is not None:
            st.upstream_tokens = count
        elif text:
            st.upstream_tokens += 1
        if prompt is not None and st.migrations == 0:
            st.prompt_tokens = prompt

    def _may_migrate(self, ctx: RequestCtx, end: StreamEnd) -> bool:
        st = ctx.stream
        return st.migrate and STREAM_RULES[end].migratable and st.migrations < self.max_migrations

    async def _continue_elsewhere(self, ctx: RequestCtx, failed: Replica) -> Opened | None:
        """Open the continuation on another replica, within the retry budget."""
        d = self.dispatcher
        req = ctx.req
        assert req is not None
        st = ctx.stream
        body = continuation_body(req, st.text, st.completion_tokens)
        if body is None:
            self.metrics.migrations.labels("refused").inc()
            return None
        tried = {failed.id}
        paid = False
        while True:
            # Only where there is room: a saturated replica, or one with every slot busy,
            # would queue the continuation and stall the client's stream (issue 13 bug 4).
            replica = d.choose(ctx, clock.monotonic(), tried, free_only=True)
            if replica is None or clock.monotonic() >= ctx.deadline:
                self.metrics.migrations.labels("failed").inc()
                return None
            if not paid:  # one withdrawal per migration, and none when nowhere has room
                if not self.budget.try_withdraw(clock.monotonic()):
                    self.metrics.retry_budget_exhausted.inc()
                    self.metrics.migrations.labels("refused").inc()
                    return None
                paid = True
            tried.add(replica.id)
            try:
                opened = await d.attempt(ctx, replica, body, ttft_s=self.migration_ttft_s)
            except AttemptFailed:
                if len(tried) > d.retry.max_attempts:
                    self.metrics.migrations.labels("failed").inc()
                    return None
                continue
            st.migrations += 1
            ctx.attempts += 1
            st.tokens_before_migration = st.completion_tokens
            st.upstream_tokens = 0
            if not req.include_usage:
                st.strip_usage = True  # the continuation asked for usage; the client did not
            self.metrics.migrations.labels("ok").inc()
            return opened


class _EventStream(web.StreamResponse):
    """A stream's response whose headers wait for its first bytes, to go out with them in
    one write (aiohttp buffers them so since 3.12).
    The relay writes the head at once after `prepare`, so nothing is held back."""

    _send_headers_immediately = False


class _SentStream(_EventStream):
    """A stream's response whose head went out from the upstream's socket callback
    (`Relay.commit`): aiohttp prepares it (chunked framing, keep-alive) but does not
    write the head again."""

    async def _write_headers(self) -> None:
        return


def _stream_headers(upstream: Mapping[str, str], request_id: str) -> dict[str, str]:
    """A stream's response headers, whichever path writes them (`Relay.commit`,
    `Relay.stream`): the engine's content type (audio routes differ), no caching, the id."""
    return {
        "Content-Type": upstream.get("content-type", _SSE_TYPE),
        "Cache-Control": "no-cache",
        "X-Request-Id": request_id,
    }


def _parses_events(ctx: RequestCtx) -> bool:
    """The stream needs event-level work (`Relay._filter`), not the raw relay."""
    st = ctx.stream
    if st.strip_usage or st.track_text or ctx.reconcile:
        return True
    # Adaptive admission learns the completion's length from the usage that the Responses
    # and Anthropic dialects put in their events (the raw relay counts OpenAI chunks only).
    return (
        ctx.admission is not None and ctx.req is not None and ctx.req.dialect is not Dialect.openai
    )


def _without(obj: dict[str, Any], keys: frozenset[str]) -> dict[str, Any]:
    """`obj` without `keys` (the same object when it has none of them)."""
    if not keys or keys.isdisjoint(obj):
        return obj
    return {k: v for k, v in obj.items() if k not in keys}


def _error_event(ctx: RequestCtx, end: StreamEnd, events_relayed: int) -> bytes:
    """The gateway's error that ends a broken stream, in the stream's dialect (the
    Responses API numbers its events: this one takes the next number)."""
    error = stream_error(end)
    dialect = ctx.req.dialect if ctx.req is not None else Dialect.openai
    if dialect is Dialect.openai:
        return error.sse_event()
    return error_event(dialect, error.body()["error"], error.status, events_relayed)


def _uncancel_cut(ctx: RequestCtx) -> bool:
    """True (and the cancellation undone) when it came from the gateway's own drain cut."""
    ticket = ctx.ticket
    if ticket is None or ticket.cut_reason is None:
        return False
    task = asyncio.current_task()
    if task is not None:
        task.uncancel()
    return True


class _Feed:
    """One upstream's body on its way to the client, from the upstream's socket callback.

    `feed` runs once per read from the replica: it records the inter-token gap (metrics,
    the replica's ITL average, the idle timer), then writes the bytes to the client's
    transport, framed as one HTTP chunk. `feed_marked` does the same for the Responses
    and Anthropic dialects, whose raw end is a terminal event's field line rather than a
    `[DONE]` tail (a method of its own, so OpenAI chunks' per-read work is unchanged)."""

    __slots__ = (
        "_client",
        "_filter",
        "_framed",
        "_itl",
        "_relay",
        "_sse",
        "conn",
        "ctx",
        "end",
        "replica",
        "tail",
        "timer",
        "transport",
        "watch",
    )

    def __init__(
        self,
        relay: Relay,
        request: web.Request,
        ctx: RequestCtx,
        opened: Opened,
        parse: bool,
        timer: IdleDeadline,
        tail: bytes,
    ) -> None:
        transport = request.transport
        if transport is None:
            raise ClientLeft("client left while streaming")
        self.transport = transport
        self._client = request.protocol
        self._framed = request.version >= HttpVersion11  # aiohttp chunks 1.1 responses
        self._relay = relay
        self._filter = parse
        self._sse = opened.sse
        self._itl = relay.metrics.itl.labels(ctx.model)
        self.conn = opened.conn
        self.ctx = ctx
        self.replica = opened.replica
        self.timer = timer  # its `last` is when the latest chunk arrived
        self.tail = tail  # the stream's last bytes (see _TAIL)
        self.end: StreamEnd | str | None = None  # known from the events, or client_left
        self.watch: EndWatch | None = None  # set for the Responses and Anthropic dialects

    def finished(self) -> bool:
        """The upstream's body, as relayed raw, ended its stream cleanly (`EndWatch`)."""
        if self.watch is None:
            return self.tail.endswith(DONE_EVENT)
        return self.watch.done

    def feed(self, data: bytes) -> bool:
        """Once per read from the replica (OpenAI chunks)."""
        if self.end is not None or not data:
            return True
        self._arrived()
        st = self.ctx.stream
        st.events += data.count(b"data:")
        end: StreamEnd | None = None
        if self._filter:
            out, end = self._relay._filter(self.ctx, self._sse.feed(data))
            if out:
                self.tail = out[-_TAIL:]
        else:
            out = data
            joined = self.tail + data
            if ABORT_MARK in joined:
                st.aborted = True
            if (tail := joined[-_TAIL:]).endswith(DONE_EVENT):
                end = StreamEnd.done  # a body that ends without it: `_pump` says how
            self.tail = tail
        return self._send(out, end)

    def feed_marked(self, data: bytes) -> bool:
        """`feed` for the Responses and Anthropic dialects, whose end is an event of their
        own (`EndWatch`), not a trailing `[DONE]`."""
        if self.end is not None:
            return True
        self._arrived()
        end: StreamEnd | None = None
        watch = self.watch
        assert watch is not None
        if self._filter:
            events = self._sse.feed(data)
            watch.events += len(events)
            out, end = self._relay._filter(self.ctx, events)
        else:
            out = data
            watch.see(data)
            if watch.done:
                end = StreamEnd.done
        return self._send(out, end)

    def _arrived(self) -> None:
        """A read arrived: the inter-token gap goes to the metrics, the replica's ITL
        average and the idle timer."""
        now = clock.monotonic()
        timer = self.timer
        gap = now - timer.last
        timer.last = now
        self._itl.observe(gap)
        replica = self.replica
        replica.observe_itl(gap)
        replica.chunks_relayed += 1

    def _send(self, out: bytes, end: StreamEnd | None) -> bool:
        """Write `out` to the client as one HTTP chunk; False ends the relay.

        The bytes that end a stream (`[DONE]`, or whatever the upstream's response ended
        with) are held, and the relay's coroutine writes them with the response's
        terminating chunk once the upstream's response has ended, usually in the same
        read or the next: one write, and a client that closes as soon as it reads
        `[DONE]` (SDKs do) never finds the handler still running, which counted complete
        streams as clients that left. An upstream that never ends its response after
        `[DONE]` is given `DONE_GRACE_S`."""
        if end is StreamEnd.done:
            self.ctx.stream.last = out
            self.end = end
            if not self.conn.complete:
                self.timer.within(DONE_GRACE_S)
            return True
        if out:
            transport = self.transport
            if transport.is_closing():
                self.end = _CLIENT_LEFT
                return False
            transport.write(b"%x\r\n%b\r\n" % (len(out), out) if self._framed else out)
            if self._client.writing_paused:
                self.conn.pause()
        if end is not None:
            self.end = end
            return False
        return True
