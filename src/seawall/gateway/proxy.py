"""The request path for `/v1/completions` and `/v1/chat/completions`, end to end.

Per request: a ticket in the in-flight ledger (the gateway's drain waits on it and, at
its deadline, cuts it); the admission stack (`stack.py`, its order and reasons written
there); the dispatcher, which holds the client's response until the first token and
retries before it (`dispatch.py`); the relay, after it (`relay.py`); and at the end, one
set of books: the tenant's lease, the completion rate, the metrics and the access log.

The client leaving at any stage cancels this handler (aiohttp `handler_cancellation`);
every upstream response is closed on cancellation so the engine aborts the request and
frees its KV blocks at once.

Labels and log fields take only values the gateway knows: a model the fleet does not
serve is `other` in metrics, and client strings in the log are truncated.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from seawall import clock
from seawall.config import Timeouts
from seawall.errors import ApiError, clip, unavailable
from seawall.gateway import telemetry
from seawall.gateway.context import RequestCtx, new_request_id
from seawall.gateway.dispatch import Dispatcher
from seawall.gateway.fleet_admission import FleetAdmission
from seawall.gateway.inflight import InFlight
from seawall.gateway.outcomes import StreamEnd
from seawall.gateway.relay import Relay
from seawall.gateway.replicas import ReplicaSet
from seawall.gateway.stack import Step
from seawall.gateway.tenancy import Tenancy
from seawall.logs import FIELDS
from seawall.metrics import Metrics
from seawall.protocol.openai import Route

log = logging.getLogger("seawall.access")

OTHER_MODEL = "other"  # the metric label of every model the fleet does not serve
_LOG_FIELD_MAX = 128  # client strings in the access log are cut to this many characters


class Proxy:
    def __init__(
        self,
        *,
        stack: tuple[Step, ...],
        dispatcher: Dispatcher,
        relay: Relay,
        ledger: InFlight,
        tenancy: Tenancy,
        fleet: FleetAdmission,
        replicas: ReplicaSet,
        metrics: Metrics,
        timeouts_for: Callable[[Route], Timeouts],
        drain_retry_after_s: float,
        access_log: bool = True,
        tracing: telemetry.Tracing | None = None,
    ) -> None:
        self.stack = stack
        self.dispatcher = dispatcher
        self.relay = relay
        self.ledger = ledger
        self.tenancy = tenancy
        self.fleet = fleet
        self.replicas = replicas
        self.metrics = metrics
        self.timeouts_for = timeouts_for
        self.drain_retry_after_s = drain_retry_after_s
        self.access_log = access_log
        self.tracing = tracing  # None: tracing off, and no span work at all

    async def handle(self, request: web.Request, route: Route) -> web.StreamResponse:
        ctx = RequestCtx(
            request_id=new_request_id(request.headers.get("X-Request-Id")),
            route=route,
            started=clock.monotonic(),
            timeouts=self.timeouts_for(route),
            trace=telemetry.incoming(request.headers),
        )
        if self.tracing is not None:
            ctx.span = self.tracing.start_request(route, ctx.request_id, request.method, ctx.trace)
        ticket = ctx.ticket = self.ledger.enter()
        try:
            return await self._handle(request, ctx)
        except ApiError as e:
            return self._error_response(ctx, e)
        except asyncio.CancelledError:
            if ticket.cut_reason is not None:
                # The gateway's drain deadline, before this request's answer began.
                current = asyncio.current_task()
                if current is not None:
                    current.uncancel()
                if ctx.stream.head_sent:
                    # ... or as it began: its head is on the client's wire (relay.commit).
                    return await self.relay.end_committed(request, ctx, StreamEnd.gateway_draining)
                return self._error_response(
                    ctx,
                    unavailable(
                        "The gateway is shutting down and its drain deadline has passed; "
                        "retry on another instance.",
                        retry_after_s=self.drain_retry_after_s,
                        code="draining",
                    ),
                )
            self.metrics.cancellations.labels(ctx.stage).inc()
            ctx.status = 499  # nginx's "client closed request", for the access log only
            ctx.error = f"client left while {ctx.stage}"
            raise
        finally:
            ticket.done()
            if ctx.lease is not None:
                await self.tenancy.release(ctx)
            self.fleet.completed(ctx)
            self._finish(ctx)

    async def _handle(self, request: web.Request, ctx: RequestCtx) -> web.StreamResponse:
        for step in self.stack:
            await step.run(request, ctx)
        req = ctx.req
        assert req is not None
        ctx.stage = "before_first_token" if req.stream else "non_streaming"
        # A stream that may migrate is sent as an object, so that each engine is asked
        # for its per-chunk token counts in its own dialect (see migrate.py).
        body = req.obj if ctx.stream.track_text else req.body_bytes()
        opened = await self.dispatcher.open(ctx, body, self.relay.commit(request, ctx))
        if not req.stream:
            return await self.relay.unary(ctx, opened)
        return await self.relay.stream(request, ctx, opened)

    # -- responses and bookkeeping ------------------------------------------------------

    def _error_response(self, ctx: RequestCtx, e: ApiError) -> web.Response:
        ctx.status = e.status
        ctx.error = ctx.error or e.message
        ctx.error_code = str(e.code) if e.code is not None else f"http_{e.status}"
        headers = {"X-Request-Id": ctx.request_id, **e.response_headers()}
        return web.Response(body=e.json_bytes(), status=e.status, headers=headers)

    def _finish(self, ctx: RequestCtx) -> None:
        elapsed = clock.monotonic() - ctx.started
        label = ctx.model if ctx.model_known else OTHER_MODEL
        self.metrics.requests_of(label, ctx.route, str(ctx.status)).inc()
        if ctx.status == 200:
            self.metrics.e2e.labels(label).observe(elapsed)
        if self.access_log or ctx.span is not None:
            record = self.access_record(ctx, elapsed)
            if ctx.span is not None:
                ctx.span.end(record)
            if self.access_log:
                # Text logs show the record as one JSON object; JSON logs merge its fields.
                log.info("request", extra={FIELDS: record})

    def access_record(self, ctx: RequestCtx, elapsed_s: float) -> dict[str, Any]:
        """One request's account: who, what, where it went, how it ended, how long each
        part took. Values are the gateway's own or clipped client strings; never a key,
        a header or a prompt."""
        replica = self.replicas.get(ctx.replica) if ctx.replica else None
        trace_id = (
            ctx.span.trace_id if ctx.span is not None else ctx.trace.trace_id if ctx.trace else None
        )
        return {
            "request_id": ctx.request_id,
            "route": ctx.route,
            "model": clip(ctx.model, _LOG_FIELD_MAX) if ctx.model else "unknown",
            "tenant": ctx.tenant,
            "tier": ctx.tier,
            "status": ctx.status,
            "outcome": outcome_of(ctx),
            "replica": ctx.replica or None,
            "served_model": replica.model if replica is not None else None,
            "attempts": ctx.attempts,
            "migrations": ctx.stream.migrations,
            "ttft_s": None if ctx.ttft_s is None else round(ctx.ttft_s, 4),
            "queued_s": round(ctx.queued_s, 4),
            "duration_s": round(elapsed_s, 4),
            "error": ctx.error[: _LOG_FIELD_MAX * 4] or None,
            "trace_id": trace_id,
        }


def outcome_of(ctx: RequestCtx) -> str:
    """How the request ended, as one code: `ok`; a stream's end (`outcomes.StreamEnd`)
    when it broke after its 200; `client_left`; else the error's code."""
    if ctx.status == 200:
        return ctx.error if ctx.error else "ok"
    if ctx.status == 499:
        return "client_left"
    return ctx.error_code or f"http_{ctx.status}"
