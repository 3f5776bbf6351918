"""Server-sent events as the engines send them: framing, and each dialect's classification.

Sans-I/O: bytes in, events out. The gateway relays event bytes unchanged (byte-faithful
pass-through); it parses an event's JSON only where it must decide something: before
the first token (is this chunk a token?), and when it tracks usage or delivered text.

Three dialects (`Dialect`), one per family of routes (`protocol/routes.py` says which):

- `openai`: chat and text completions, audio transcription streams. Every event is
  `data: <chunk>`; `data: [DONE]` ends the stream, after a mid-stream error event too.
- `responses`: OpenAI's Responses API as vLLM 0.33 (and llama.cpp) serve it. Each event
  is `event: <type>` then `data: <json with the same type>`; the first output `*.delta`
  is the first token; `response.completed` or `response.incomplete` ends it cleanly,
  `response.failed` or an `error` event ends it with the engine's error. vLLM sends no
  `[DONE]` after them (captured: `resp.stream`, `resp.stream_completed`); the sim's
  generation error is `data: {"error": ...}` then `data: [DONE]`, which also ends it.
- `anthropic`: Anthropic's Messages API as vLLM (`entrypoints/anthropic/serving.py`) and
  llama.cpp serve it: `event: <type>` then `data: {"type": <type>, ...}`;
  `content_block_delta` is the first token, `message_stop` ends it, `event: error` ends
  it with the engine's error.

The raw relay does not parse events: it knows a stream ended cleanly from its last bytes.
For `openai` that is the `[DONE]` event at the very end (`DONE_EVENT`); for the other two
it is one of `END_MARKS[dialect]` seen as an SSE field line (a line feed, then
`event: <terminal type>` and a line feed: JSON data cannot hold a raw line feed, so a
model's text can never forge one), then the stream ending on an event boundary. A
stream cut inside its terminal event, or before it, never counts as done.
"""

from __future__ import annotations

from enum import Enum, StrEnum
from typing import Any

import orjson

from seawall.values import frozen

DONE_EVENT = b"data: [DONE]\n\n"
# vLLM's compact chunk JSON, as a byte pattern the raw relay can look for cheaply.
ABORT_MARK = b'"finish_reason":"abort"'
_SEP = b"\n\n"


class SSEBuffer:
    """Reassembles events from arbitrary network reads. An event keeps its terminator."""

    __slots__ = ("_pending",)

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, data: bytes) -> list[bytes]:
        buf = self._pending + data if self._pending else data
        end = buf.rfind(_SEP)
        if end < 0:
            self._pending = buf
            return []
        complete, self._pending = buf[: end + 2], buf[end + 2 :]
        return [e + _SEP for e in complete[:-2].split(_SEP)]

    @property
    def pending(self) -> bytes:
        return self._pending


class Dialect(StrEnum):
    """How a route's stream is framed and ended (see the module doc)."""

    openai = "openai"
    responses = "responses"
    anthropic = "anthropic"


class Kind(Enum):
    TOKEN = "token"  # carries generated output (or a finish reason)
    ABORT = "abort"  # finish_reason "abort": the engine gave up on it (shutdown, abort)
    PRELUDE = "prelude"  # before any output: the chat role chunk, response.created, ...
    USAGE = "usage"  # the include_usage chunk (no choices); Anthropic's message_delta
    ERROR = "error"  # a mid-stream error event
    DONE = "done"  # data: [DONE]; response.completed/incomplete; message_stop
    COMMENT = "comment"  # ": keep-alive", Anthropic's ping and other non-data events


@frozen
class Event:
    kind: Kind
    raw: bytes
    obj: dict[str, Any] | None = None
    terminal: bool = False  # the dialect's last event: nothing follows it


# The terminal events' field lines, as the raw relay looks for them (see the module doc).
END_MARKS: dict[Dialect, tuple[bytes, ...]] = {
    Dialect.openai: (DONE_EVENT,),
    Dialect.responses: (
        b"\nevent: response.completed\n",
        b"\nevent: response.incomplete\n",
        b"\nevent: response.failed\n",
        b"\nevent: error\n",
        b"\n" + DONE_EVENT,
    ),
    Dialect.anthropic: (b"\nevent: message_stop\n", b"\nevent: error\n"),
}


class EndWatch:
    """Whether a stream relayed raw (never parsed) has ended cleanly, from its bytes as
    they pass: for `openai`, `[DONE]` is its last event; for the other dialects, one of
    `END_MARKS` has been seen and the bytes end on an event boundary. Also counts the
    events that have passed (their `\n\n` terminators). A few bytes kept per read; the
    relay inlines the `openai` rule on its hot path (`relay._Feed.feed`)."""

    __slots__ = ("_keep", "_marks", "events", "tail", "terminal")

    def __init__(self, dialect: Dialect) -> None:
        marks = END_MARKS[dialect]
        self._marks = None if dialect is Dialect.openai else marks
        self._keep = max(map(len, marks))
        self.tail = b""
        self.terminal = False  # a terminal event has begun (not the openai dialect)
        self.events = 0

    def see(self, data: bytes) -> None:
        tail = self.tail
        joined = tail + data if tail else data
        if self._marks is not None and not self.terminal:
            self.terminal = any(mark in joined for mark in self._marks)
        self.events += joined.count(_SEP) - tail.count(_SEP)
        self.tail = joined[-self._keep :]

    @property
    def done(self) -> bool:
        if self._marks is None:
            return self.tail.endswith(DONE_EVENT)
        # The terminal event's data holds no raw line feed, so the first blank line after
        # its field line is its end: a body cut inside it does not end on one.
        return self.terminal and self.tail.endswith(_SEP)


def _data_payload(raw: bytes) -> bytes | None:
    if raw.startswith(b"data: "):
        return raw[6:].rstrip(b"\n")
    if raw.startswith(b"data:"):
        return raw[5:].strip()
    return None


def classify(raw: bytes) -> Event:
    """An OpenAI chunk event (the `openai` dialect)."""
    payload = _data_payload(raw)
    if payload is None:
        return Event(Kind.COMMENT, raw)
    if payload == b"[DONE]":
        return Event(Kind.DONE, raw, terminal=True)
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return Event(Kind.ERROR, raw)
    if not isinstance(obj, dict):
        return Event(Kind.ERROR, raw)
    if "error" in obj:
        return Event(Kind.ERROR, raw, obj)
    choices = obj.get("choices")
    if not choices:
        return Event(Kind.USAGE if obj.get("usage") else Kind.PRELUDE, raw, obj)
    for choice in choices:
        finish = choice.get("finish_reason")
        if finish == "abort":
            return Event(Kind.ABORT, raw, obj)
        if finish is not None or choice_text(choice):
            return Event(Kind.TOKEN, raw, obj)
        delta = choice.get("delta")
        if delta and (delta.get("tool_calls") or delta.get("reasoning_content")):
            return Event(Kind.TOKEN, raw, obj)
    return Event(Kind.PRELUDE, raw, obj)


def _typed_event(raw: bytes) -> tuple[str | None, dict[str, Any] | None, Event | None]:
    """(type, data object) of an `event:`/`data:` event, or the Event it already is."""
    name: bytes | None = None
    payload: bytes | None = None
    for line in raw.split(b"\n"):
        if line.startswith(b"event:"):
            name = line[6:].strip()
        elif line.startswith(b"data:"):
            payload = line[5:].strip()
    if payload is None:
        return None, None, Event(Kind.COMMENT, raw)
    if payload == b"[DONE]":
        return None, None, Event(Kind.DONE, raw, terminal=True)
    try:
        obj = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None, None, Event(Kind.ERROR, raw)
    if not isinstance(obj, dict):
        return None, None, Event(Kind.ERROR, raw)
    kind = obj.get("type")
    if not isinstance(kind, str):
        kind = name.decode("latin-1") if name else None
    return kind, obj, None


def classify_responses(raw: bytes) -> Event:
    """A Responses API event (the `responses` dialect)."""
    kind, obj, done = _typed_event(raw)
    if done is not None:
        return done
    if kind is None:
        # No type at all: the OpenAI-style error object the sim (and older servers) send
        # mid-stream, followed by [DONE].
        return Event(Kind.ERROR if obj and "error" in obj else Kind.PRELUDE, raw, obj)
    if kind in ("response.completed", "response.incomplete"):
        return Event(Kind.DONE, raw, obj, terminal=True)
    if kind in ("response.failed", "error"):
        return Event(Kind.ERROR, raw, obj, terminal=True)
    if kind.endswith(".delta"):
        return Event(Kind.TOKEN, raw, obj)
    return Event(Kind.PRELUDE, raw, obj)


def classify_anthropic(raw: bytes) -> Event:
    """An Anthropic Messages event (the `anthropic` dialect)."""
    kind, obj, done = _typed_event(raw)
    if done is not None:
        return done
    if kind == "content_block_delta":
        return Event(Kind.TOKEN, raw, obj)
    if kind == "message_stop":
        return Event(Kind.DONE, raw, obj, terminal=True)
    if kind == "error":
        return Event(Kind.ERROR, raw, obj, terminal=True)
    if kind == "message_delta":
        return Event(Kind.USAGE, raw, obj)
    if kind == "ping":
        return Event(Kind.COMMENT, raw, obj)
    return Event(Kind.PRELUDE, raw, obj)


CLASSIFY = {
    Dialect.openai: classify,
    Dialect.responses: classify_responses,
    Dialect.anthropic: classify_anthropic,
}


def choice_text(choice: dict[str, Any]) -> str:
    """The generated text a chunk's choice carries (completions `text`, chat `delta.content`)."""
    text = choice.get("text")
    if text:
        return str(text)
    delta = choice.get("delta")
    if delta:
        content = delta.get("content")
        if content:
            return str(content)
    return ""


def usage_of(obj: dict[str, Any] | None) -> dict[str, int] | None:
    if not obj:
        return None
    usage = obj.get("usage")
    return usage if isinstance(usage, dict) else None


def normalised_usage(usage: Any) -> dict[str, Any] | None:
    """A usage object in OpenAI's words (`prompt_tokens`, `completion_tokens`), whichever
    vocabulary the engine used: the Responses API's and Anthropic's `input_tokens` /
    `output_tokens` (Anthropic's `input_tokens` excludes cached tokens; the prompt is the
    sum with `cache_read_input_tokens` and `cache_creation_input_tokens`)."""
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage or ("input_tokens" not in usage and "output_tokens" not in usage):
        return usage
    out: dict[str, Any] = {}
    prompt = usage.get("input_tokens")
    if isinstance(prompt, int):
        for extra in ("cache_read_input_tokens", "cache_creation_input_tokens"):
            value = usage.get(extra)
            if isinstance(value, int):  # Anthropic's only; the Responses API has none
                prompt += value
        out["prompt_tokens"] = prompt
    completion = usage.get("output_tokens")
    if isinstance(completion, int):
        out["completion_tokens"] = completion
    return out


def body_usage(obj: Any) -> dict[str, Any] | None:
    """The usage of a whole (non-streamed) answer, in OpenAI's words."""
    return normalised_usage(obj.get("usage")) if isinstance(obj, dict) else None


def event_usage(dialect: Dialect, ev: Event) -> dict[str, Any] | None:
    """The usage an event of `dialect` reports, in OpenAI's words (None: none)."""
    obj = ev.obj
    if obj is None:
        return None
    if dialect is Dialect.responses:
        response = obj.get("response")
        return body_usage(response) if ev.terminal else None
    if dialect is Dialect.anthropic:
        message = obj.get("message")
        if isinstance(message, dict):
            return body_usage(message)  # message_start: the prompt's count
        return body_usage(obj)  # message_delta: the output's count (and the prompt's)
    return usage_of(obj)


# vLLM's Anthropic error types by status (`anthropic/protocol.py` translate_error_type).
_ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_event(
    dialect: Dialect, error: dict[str, Any], status: int, sequence_number: int = 0
) -> bytes:
    """The gateway's own mid-stream error as the last event of a `dialect` stream.
    `error` is the OpenAI error object (`{"message", "type", "param", "code"}`); in the
    other dialects it is rewritten as their own error event, since it is what their
    clients parse: the Responses API's `error` event (its `sequence_number` follows the
    upstream's events), Anthropic's `error` event (its `type` chosen by status as vLLM
    chooses it)."""
    if dialect is Dialect.openai:
        return b"data: " + orjson.dumps({"error": error}) + b"\n\ndata: [DONE]\n\n"
    if dialect is Dialect.responses:
        code = error.get("code")
        data: dict[str, Any] = {
            "type": "error",
            "code": None if code is None else str(code),
            "message": error.get("message", ""),
            "param": error.get("param"),
            "sequence_number": sequence_number,
        }
    else:
        kind = _ANTHROPIC_ERROR_TYPES.get(status)
        kind = kind or ("api_error" if status >= 500 else "invalid_request_error")
        data = {"type": "error", "error": {"type": kind, "message": error.get("message", "")}}
    return b"event: error\ndata: " + orjson.dumps(data) + _SEP


def event_bytes(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + _SEP
