"""W3C trace context for every request, and OpenTelemetry spans when configured.

Propagation, always: a client's `traceparent` (and `tracestate`) reaches each replica
the request is sent to, so an engine that traces (vLLM's `--otlp-traces-endpoint`) joins
the client's trace. With tracing off the headers go on as received (a proxy that does
not take part forwards them unchanged, as the W3C recommendation says), after a format
check so that a malformed value is dropped rather than relayed.

Spans, when `telemetry.enabled` (exported over OTLP/HTTP by the OpenTelemetry SDK's
batch processor, on its own thread):

    seawall.request  SERVER  parent: the client's traceparent, if any
    ├─ seawall.attempt  CLIENT  one per attempt (retries, hedges, migration
    │                            continuations), from sending to its first token or
    │                            failure; its context is the traceparent the replica gets
    └─ seawall.stream   INTERNAL  streams only: from the first token to the stream's end

The request span carries `first_token` and `stream_end` events too. Attributes follow
OpenTelemetry's HTTP and GenAI conventions where they have a name (`http.route`,
`http.response.status_code`, `gen_ai.request.model` is the public name,
`gen_ai.response.model` the replica's served one, `server.address`), `seawall.*`
otherwise: `seawall.replica`, `seawall.attempt.outcome` (an `outcomes.Attempt` value),
`seawall.ttft_s`, `seawall.outcome`, `seawall.stream_end` (a `StreamEnd` value).

Zero cost when off: the proxy and the dispatcher hold `None` instead of a `Tracing`,
and the request path then does one header lookup per request (two when a traceparent
came); OpenTelemetry is not even imported. Nothing here runs per streamed chunk: the
stream's end is recorded when the request finishes. Never records a header value
other than the trace context, a prompt, or a key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from seawall.config import ConfigError, TelemetryConfig
from seawall.protocol.routes import ROUTES

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span, Tracer

    from seawall.gateway.replicas import Replica

# version-traceid-parentid-flags; a future version may append fields after a dash.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_TRACESTATE_MAX = 512  # what W3C asks every participant to propagate at least
_ZERO_TRACE, _ZERO_SPAN = "0" * 32, "0" * 16


@dataclass(frozen=True, slots=True)
class TraceContext:
    """A client's trace context, checked; `headers` is what goes upstream with tracing off."""

    traceparent: str
    tracestate: str | None
    headers: Mapping[str, str]

    @property
    def trace_id(self) -> str:
        return self.traceparent[3:35]


def incoming(headers: Mapping[str, str]) -> TraceContext | None:
    """The request's W3C trace context, or None (absent or malformed: not forwarded)."""
    traceparent = headers.get("traceparent")
    if traceparent is None:
        return None
    m = _TRACEPARENT.match(traceparent.strip().lower())
    if m is None:
        return None
    version, trace_id, span_id, _flags, rest = m.groups()
    if version == "ff" or trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    if version == "00" and rest:
        return None  # version 00 has exactly four fields
    value = m.group(0)
    out = {"traceparent": value}
    state = headers.get("tracestate")
    if state is not None:
        state = state.strip()
        if len(state) <= _TRACESTATE_MAX and state.isascii() and state.isprintable():
            out["tracestate"] = state
        else:
            state = None
    return TraceContext(value, state, out)


class Tracing:
    """The tracer and its exporter; built only when `telemetry.enabled`."""

    def __init__(
        self, config: TelemetryConfig, version: str, exporter: SpanExporter | None = None
    ) -> None:
        """`exporter`: instead of OTLP/HTTP to `config.endpoint` (a benchmark's)."""
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )
        except ImportError:
            raise ConfigError(
                "telemetry.enabled needs the OpenTelemetry SDK and its OTLP exporter: "
                "pip install 'seawall[otel]'"
            ) from None
        # The gateway's own provider, not the process-wide one: `seawall up` runs the
        # gateway inside another program, whose tracing is its own business.
        self.provider: TracerProvider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            resource=Resource.create(
                {"service.name": config.service_name, "service.version": version}
            ),
            shutdown_on_exit=False,
        )
        if exporter is None:
            exporter = OTLPSpanExporter(
                endpoint=config.endpoint,
                headers=dict(config.headers),
                timeout=config.export_timeout_s,
            )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                schedule_delay_millis=config.export_interval_s * 1000,
                export_timeout_millis=config.export_timeout_s * 1000,
            )
        )
        self.tracer: Tracer = self.provider.get_tracer("seawall.gateway", version)
        self.propagator = TraceContextTextMapPropagator()

    def start_request(
        self, route: str, request_id: str, method: str, trace: TraceContext | None
    ) -> RequestSpan:
        from opentelemetry.trace import SpanKind

        parent = self.propagator.extract(dict(trace.headers)) if trace is not None else None
        span = self.tracer.start_span(
            "seawall.request",
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "http.route": ROUTES[route].path if route in ROUTES else route,
                "seawall.request_id": request_id,
            },
        )
        return RequestSpan(self, span)

    def shutdown(self) -> None:
        """Export what is batched and stop (blocking: run it off the event loop)."""
        self.provider.shutdown()


class RequestSpan:
    """One request's span, and the spans below it."""

    __slots__ = ("_stream", "span", "tracing")

    def __init__(self, tracing: Tracing, span: Span) -> None:
        self.tracing = tracing
        self.span = span
        self._stream: Span | None = None

    @property
    def trace_id(self) -> str:
        return f"{self.span.get_span_context().trace_id:032x}"

    def attempt(self, replica: Replica, served: str, migration: bool) -> AttemptSpan:
        from opentelemetry.trace import SpanKind, set_span_in_context

        span = self.tracing.tracer.start_span(
            "seawall.attempt",
            context=set_span_in_context(self.span),
            kind=SpanKind.CLIENT,
            attributes={
                "seawall.replica": replica.id,
                "server.address": replica.endpoint.host,
                "server.port": replica.endpoint.port,
                "gen_ai.response.model": served,
                "seawall.attempt.migration": migration,
            },
        )
        headers: dict[str, str] = {}
        self.tracing.propagator.inject(headers, context=set_span_in_context(span))
        return AttemptSpan(span, headers)

    def first_token(self, ttft_s: float, replica: str, stream: bool) -> None:
        from opentelemetry.trace import set_span_in_context

        self.span.add_event("first_token", {"seawall.ttft_s": ttft_s, "seawall.replica": replica})
        if stream:
            self._stream = self.tracing.tracer.start_span(
                "seawall.stream",
                context=set_span_in_context(self.span),
                attributes={"seawall.replica": replica},
            )

    def end(self, record: Mapping[str, Any]) -> None:
        """End the request (and its stream) with the access record's fields."""
        from opentelemetry.trace import Status, StatusCode

        outcome = str(record["outcome"])
        status = int(record["status"])
        attrs: dict[str, Any] = {
            f"seawall.{key}": value
            for key, value in record.items()
            if key in _SPAN_FIELDS and value is not None
        }
        attrs["http.response.status_code"] = status
        attrs["gen_ai.request.model"] = record["model"]
        # A 4xx is the client's (OpenTelemetry's rule for server spans); a stream that
        # broke after its 200 is the gateway's failure all the same.
        failed = status >= 500 or (status == 200 and outcome != "ok")
        stream = self._stream
        if stream is not None:
            end: dict[str, Any] = {
                "seawall.stream_end": outcome,
                "seawall.migrations": int(record["migrations"]),
                "seawall.replica": str(record["replica"]),
            }
            self.span.add_event("stream_end", end)
            stream.set_attributes(end)
            if failed:
                stream.set_status(Status(StatusCode.ERROR, outcome))
            stream.end()
        self.span.set_attributes(attrs)
        if failed:
            self.span.set_status(Status(StatusCode.ERROR, outcome))
        self.span.end()


# The access record's fields that the request span carries (as `seawall.<field>`).
_SPAN_FIELDS = frozenset(
    {"tenant", "tier", "outcome", "replica", "served_model", "attempts", "migrations",
     "ttft_s", "queued_s", "duration_s"}
)  # fmt: skip


class AttemptSpan:
    """One attempt's span; `headers` carries its context to the replica."""

    __slots__ = ("headers", "span")

    def __init__(self, span: Span, headers: dict[str, str]) -> None:
        self.span = span
        self.headers = headers

    def end(self, outcome: str, *, failed: bool, ttft_s: float | None = None) -> None:
        """`failed`: the replica's fault (the outcome's rule says), not a lost hedge or a
        client that left."""
        from opentelemetry.trace import Status, StatusCode

        self.span.set_attribute("seawall.attempt.outcome", outcome)
        if ttft_s is not None:
            self.span.set_attribute("seawall.ttft_s", ttft_s)
            self.span.add_event("first_token", {"seawall.ttft_s": ttft_s})
        if failed:
            self.span.set_status(Status(StatusCode.ERROR, outcome))
        self.span.end()
