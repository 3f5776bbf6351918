"""Public model names: a replica reached under a name its engine does not serve.

A replica's `model_name` (LiteLLM's term; `model_list` in the config is LiteLLM's own
shape for it) is the public name clients ask for, `/v1/models` lists, and routing,
tier limits, metric labels and the access log use. Its `model` is the name its engine
serves. Per replica, so one pool may mix engines serving different names (a model
moved to a quantised build, one replica at a time).

Two rewrites, both only for a replica whose public name differs from its served one:

- the request sent to that replica carries its served name (`upstream_body`), on every
  attempt, retry, hedge and migration continuation, since each may go to a replica
  with a different served name;
- its response is restamped with the public name (`restamp`), the whole body or every
  streamed read. LiteLLM's proxy does the same (`_override_openai_response_model` and
  `_restamp_streaming_chunk_model` since v1.81.7): a client that asked for `qwen3-8b`
  reads `qwen3-8b` back, as `/v1/models` told it. The served name is in the access log
  and the attempt's span.

The streamed restamp is one `bytes.replace` per read over the engines' compact JSON
(`"model":"<served>"`; the spaced form too), with the few bytes at the end of a read
that could begin the pattern held for the next read: they belong to an event whose
end has not arrived yet, so holding them delays nothing a client could parse. A quote
inside a string value is escaped in JSON, so the pattern only ever matches the field.

Must not: parse events, or touch a request or response of a replica without an alias
(those pass as they are, at no cost).
"""

from __future__ import annotations

from typing import Any, overload

import orjson

from seawall.errors import ApiError
from seawall.gateway.h1 import Sink
from seawall.gateway.upstream import Opened, UpstreamStream
from seawall.protocol.sse import Event, SSEBuffer


@overload
def upstream_body(body: bytes, served: str) -> bytes: ...
@overload
def upstream_body(body: dict[str, Any], served: str) -> dict[str, Any]: ...
def upstream_body(body: bytes | dict[str, Any], served: str) -> bytes | dict[str, Any]:
    """The request (encoded, or still an object) with `model` set to the served name."""
    if isinstance(body, dict):
        return {**body, "model": served}
    obj = orjson.loads(body)
    obj["model"] = served
    try:
        return orjson.dumps(obj)
    except orjson.JSONEncodeError:  # orjson reads 1,024 levels deep but writes 254
        raise ApiError(
            400, "The request body is nested too deeply to be forwarded.", code="too_deep"
        ) from None


class Restamp:
    """Replaces the served name with the public one in `"model"` fields, across reads."""

    __slots__ = ("_carry", "_pairs", "_starts")

    def __init__(self, served: str, public: str) -> None:
        s, p = orjson.dumps(served), orjson.dumps(public)
        self._pairs = ((b'"model":' + s, b'"model":' + p), (b'"model": ' + s, b'"model": ' + p))
        self._starts = tuple(needle for needle, _ in self._pairs)
        self._carry = b""

    def whole(self, data: bytes) -> bytes:
        """A complete body: every occurrence replaced, nothing held back."""
        for needle, repl in self._pairs:
            if needle in data:
                data = data.replace(needle, repl)
        return data

    def part(self, data: bytes) -> bytes:
        """One read of a stream: replaced, minus a tail that may begin a `"model"` field
        (kept and put in front of the next read)."""
        if self._carry:
            data, self._carry = self._carry + data, b""
        data = self.whole(data)
        held = self._held_from(data)
        if held < len(data):
            self._carry = data[held:]
            return data[:held]
        return data

    def _held_from(self, data: bytes) -> int:
        """Where the longest tail of `data` that is a proper prefix of a pattern starts
        (len(data) when there is none). Every pattern begins with a quote."""
        longest = max(len(n) for n in self._starts) - 1
        i = data.find(b'"', max(0, len(data) - longest))
        while i != -1:
            tail = data[i:]
            if any(n.startswith(tail) for n in self._starts):
                return i
            i = data.find(b'"', i + 1)
        return len(data)


class RestampedStream:
    """An `UpstreamStream` whose body reaches the sink restamped (see `Restamp.part`)."""

    __slots__ = ("_inner", "_restamp")

    def __init__(self, inner: UpstreamStream, restamp: Restamp) -> None:
        self._inner = inner
        self._restamp = restamp

    @property
    def headers(self) -> dict[str, str]:
        return self._inner.headers

    @property
    def complete(self) -> bool:
        return self._inner.complete

    @property
    def stopped(self) -> bool:
        return self._inner.stopped

    @property
    def paused(self) -> bool:
        return self._inner.paused

    def relay(self, sink: Sink) -> None:
        part = self._restamp.part

        def restamped(data: bytes) -> bool:
            out = part(data)
            return sink(out) if out else True

        self._inner.relay(restamped)

    async def wait_relay(self) -> None:
        await self._inner.wait_relay()

    def detach(self) -> None:
        self._inner.detach()

    def pause(self) -> None:
        self._inner.pause()

    def resume(self) -> None:
        self._inner.resume()

    def release(self) -> None:
        self._inner.release()

    def close(self) -> None:
        self._inner.close()


def restamp(opened: Opened, served: str, public: str) -> None:
    """Present `opened`'s response under the public name, in place: its body (unary), or
    the events read so far, the partial event after them and every later read (stream)."""
    r = Restamp(served, public)
    if opened.body is not None:
        opened.body = r.whole(opened.body)
        return
    opened.head = [Event(e.kind, r.whole(e.raw), e.obj) for e in opened.head]
    # The partial event after the head goes through the same carry as later reads, so a
    # `"model"` field split across the two is still found.
    sse = SSEBuffer()
    sse.feed(r.part(opened.sse.pending))
    opened.sse = sse
    opened.conn = RestampedStream(opened.conn, r)
