"""`seawall serve` with a timestamp at each stage of a request's way through it: where a
lone request's time in the gateway goes (`bench_hop.py --stages`).

    SEAWALL_STAGES_OUT=FILE python bench/stage_gateway.py serve [serve's arguments]

Wraps, in this process only, the functions that mark each stage (none of Seawall's code
changes): the request's first bytes reach the front door's protocol, aiohttp has parsed
them, the front door hands over, the proxy's handler starts, each admission step ends
(named as in `gateway/stack.py`), the request goes out to the replica, the first
non-empty content arrives from it, and that token has been written to the client (from
the socket callback, `Relay.commit`, or through aiohttp when the stream is not eligible).
On SIGUSR1, every request timed since the last SIGUSR1 is written to FILE as JSON (a list
of {stage: seconds since the first stamp}) and the list starts again, so a caller can
drop its warm-up. One request at a time: the stamps are the process's, not a request's
(a second request in flight would mix its stamps in; `bench_hop.py` sends one at a time).
The wrappers cost time of their own, so this gateway's TTFT is not Seawall's: read the
stages, and the hop from an unwrapped gateway.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from seawall.cli import main
from seawall.gateway import app, frontdoor, h1, proxy, relay, stack

now = time.perf_counter
_current: dict[str, float] = {}
_timed: list[dict[str, float]] = []
_CONTENT = b'"content":"'


def _stamp(stage: str) -> None:
    _current.setdefault(stage, now())


def _done() -> None:
    if "in" in _current:
        start = _current["in"]
        _timed.append({k: v - start for k, v in _current.items()})
    _current.clear()


_door_data = frontdoor._Handler.data_received


def data_received(self: Any, data: bytes) -> None:
    if data[:5] == b"POST ":
        _current.clear()
        _stamp("in")
        _door_data(self, data)
        _stamp("parsed")
    else:
        _door_data(self, data)


_through_door = frontdoor._Handler._through_door


def through_door(self: Any, inner: Callable[[Any], Awaitable[Any]]) -> Any:
    async def past_the_door(request: Any) -> Any:
        _stamp("door")
        return await inner(request)

    return _through_door(self, past_the_door)


_handle = proxy.Proxy.handle


async def handle(self: Any, request: Any, route: Any) -> Any:
    _stamp("handler")
    return await _handle(self, request, route)


_admission_stack = stack.admission_stack


def admission_stack(**kwargs: Any) -> tuple[stack.Step, ...]:
    def timed(step: stack.Step) -> stack.Step:
        async def run(request: Any, ctx: Any) -> None:
            await step.run(request, ctx)
            _stamp(f"step {step.name}")

        return stack.Step(step.name, run, step.why)

    return tuple(timed(s) for s in _admission_stack(**kwargs))


_send = h1.H1Connection.send


def send(self: Any, data: bytes, body: bytes = b"") -> None:
    if "handler" in _current:  # not the fleet monitor's own probes
        _stamp("sent upstream")
    _send(self, data, body)


_upstream_data = h1.H1Connection.data_received


def upstream_data(self: Any, data: bytes) -> None:
    if "sent upstream" in _current and _CONTENT in data.replace(b'"content":""', b""):
        _stamp("token in")
    _upstream_data(self, data)


_commit = relay.Relay.commit


def commit(self: Any, request: Any, ctx: Any) -> Any:
    inner = _commit(self, request, ctx)
    if inner is None:
        return None

    def commit_for(strip: frozenset[str]) -> Any:
        written_by = inner(strip)

        def timed(headers: Any, events: Any, pending: bytes) -> bool:
            written = written_by(headers, events, pending)
            if written and "token in" in _current:
                _stamp("token out")
                _done()
            return written

        return timed

    return commit_for


_write = relay._EventStream.write


async def write(self: Any, data: bytes) -> None:
    await _write(self, data)
    if "token in" in _current:  # the head written through aiohttp (not committed)
        _stamp("token out")
        _done()


def dump(*_: object) -> None:
    out = Path(os.environ["SEAWALL_STAGES_OUT"])
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(_timed))
    tmp.replace(out)
    _timed.clear()


frontdoor._Handler.data_received = data_received  # type: ignore[method-assign]
frontdoor._Handler._through_door = through_door  # type: ignore[method-assign]
proxy.Proxy.handle = handle  # type: ignore[method-assign]
app.admission_stack = admission_stack  # type: ignore[attr-defined]  # imported by name
h1.H1Connection.send = send  # type: ignore[method-assign]
h1.H1Connection.data_received = upstream_data  # type: ignore[method-assign]
relay.Relay.commit = commit  # type: ignore[method-assign]
relay._EventStream.write = write  # type: ignore[method-assign,assignment]
signal.signal(signal.SIGUSR1, dump)

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
