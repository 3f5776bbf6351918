"""Server-sent events as OpenAI-compatible engines send them: framing and classification.

Sans-I/O: bytes in, events out. The gateway relays event bytes unchanged (byte-faithful
pass-through); it parses an event's JSON only where it must decide something: before
the first token (is this chunk a token?), and when it tracks usage or delivered text.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import orjson

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


class Kind(Enum):
    TOKEN = "token"  # carries generated output (or a finish reason)
    ABORT = "abort"  # finish_reason "abort": the engine gave up on it (shutdown, abort)
    PRELUDE = "prelude"  # a chunk before any output: the chat role chunk, empty prefill chunks
    USAGE = "usage"  # the include_usage chunk: no choices, a usage object
    ERROR = "error"  # a mid-stream error event
    DONE = "done"  # data: [DONE]
    COMMENT = "comment"  # ": keep-alive" and other non-data lines


@dataclass(frozen=True, slots=True)
class Event:
    kind: Kind
    raw: bytes
    obj: dict[str, Any] | None = None


def _data_payload(raw: bytes) -> bytes | None:
    if raw.startswith(b"data: "):
        return raw[6:].rstrip(b"\n")
    if raw.startswith(b"data:"):
        return raw[5:].strip()
    return None


def classify(raw: bytes) -> Event:
    payload = _data_payload(raw)
    if payload is None:
        return Event(Kind.COMMENT, raw)
    if payload == b"[DONE]":
        return Event(Kind.DONE, raw)
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


def event_bytes(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + _SEP
