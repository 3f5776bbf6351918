"""What tracing costs the request path, per request, off and on.

    .venv/bin/python bench/bench_telemetry.py [--requests 100000]

The gateway's tracing work happens once per request and once per attempt, never per
streamed chunk (`relay._Feed.feed` has none). This measures that work in-process, side
by side in one run, against a baseline of one header lookup on the same headers:

- off, no traceparent: what every request pays with telemetry off (the default);
- off, with a traceparent: the same when a client sends trace context (it is checked
  and forwarded);
- on: a request span, one attempt span with its traceparent for the replica, the
  first-token event and the stream span, and their end, through the OpenTelemetry
  SDK's batch processor into an exporter that discards (the network and a collector
  are left out: they run on the exporter's thread, not the event loop).

Prints microseconds per request for each and its ratio to the baseline. For the cost
through a whole gateway under load, run `bench_gateway.py --systems seawall
--seawall-config FILE` with `telemetry: {enabled: true, endpoint: ...}` in FILE, beside
a run without it.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_context, print_table
from seawall import __version__
from seawall.config import TelemetryConfig
from seawall.gateway.replicas import Replica
from seawall.gateway.telemetry import Tracing, incoming

CLIENT_HEADERS = {
    "Host": "127.0.0.1:8080",
    "User-Agent": "OpenAI/Python 1.99.0",
    "Content-Type": "application/json",
    "Authorization": "Bearer sk-sw-" + "x" * 43,
    "Accept": "application/json",
}
TRACE = {
    "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
    "tracestate": "congo=t61rcWkgMzE",
}
RECORD: dict[str, Any] = {
    "request_id": "r",
    "route": "chat",
    "model": "m",
    "tenant": "default",
    "tier": "default",
    "status": 200,
    "outcome": "ok",
    "replica": "r0",
    "served_model": "m",
    "attempts": 1,
    "migrations": 0,
    "ttft_s": 0.02,
    "queued_s": 0.0,
    "duration_s": 0.5,
}


def per_request_us(fn: Callable[[], object], n: int) -> float:
    for _ in range(min(n, 1000)):  # warm-up
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    args = parser.parse_args(argv)
    n = args.requests

    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    plain = CIMultiDictProxy(CIMultiDict(CLIENT_HEADERS))
    traced = CIMultiDictProxy(CIMultiDict({**CLIENT_HEADERS, **TRACE}))
    # The gateway's own SDK pipeline (batch processor), into an exporter that keeps nothing.
    tracing = Tracing(TelemetryConfig(enabled=True), __version__, exporter=Discard())
    replica = Replica("r0", "http://127.0.0.1:8001", "m", None)

    def on() -> None:
        ctx = incoming(traced)
        span = tracing.start_request("chat", "r", "POST", ctx)
        attempt = span.attempt(replica, "m", False)
        assert attempt.headers["traceparent"]
        attempt.end("ok", failed=False, ttft_s=0.02)
        span.first_token(0.02, "r0", True)
        span.end(RECORD)

    rows = []
    baseline = per_request_us(lambda: plain.get("traceparent"), n)
    for name, fn in (
        ("baseline: one header lookup", lambda: plain.get("traceparent")),
        ("off, no traceparent", lambda: incoming(plain)),
        ("off, traceparent forwarded", lambda: incoming(traced)),
        ("on: 3 spans, discarding exporter", on),
    ):
        us = per_request_us(fn, n if fn is not on else max(1, n // 10))
        rows.append((name, f"{us:.3f}", f"{us / baseline:.1f}x"))
    tracing.shutdown()
    print(machine_context())
    print(f"requests per case: {n} ({max(1, n // 10)} with tracing on)\n")
    print_table(("case", "us/request", "vs baseline"), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
