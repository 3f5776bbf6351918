"""OpenAI request parsing: just enough to route, limit and protect; the engine validates the rest.

Sans-I/O. The gateway forwards the client's bytes unchanged unless a policy must change
the request (a default or clamped `max_tokens`, `include_usage` added for accounting);
then `ParsedRequest.body_bytes()` re-serialises the edited object.

`n` (choices per prompt) is parsed as vLLM's pydantic models parse it (lax integers:
`2`, `2.0`, `"2"`, `true`), so the count the gateway charges is the count the engine
runs; `n > 1` is served (issue 13) and counted as `n` sequences per prompt by
`protocol.tokens.count_request`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from seawall.errors import bad_request

Route = Literal["completions", "chat"]

# orjson's limit when writing (it reads deeper): a body edited by the gateway must fit.
MAX_WRITTEN_DEPTH = 254

# Strings pydantic's lax mode reads as integers (a subset: what it reads, it reads the same).
_INT_STRING = re.compile(r" *[+-]?[0-9]+(?:\.0+)? *")
_INT64 = 2**63


def lax_int(value: Any) -> int | None:
    """`value` as vLLM's pydantic models read an `int` field in lax mode (`2`, `2.0`,
    `"2"`, `true`), or None if it would not be an integer. Never reads a value as a
    different number than pydantic would; may refuse a few exotic spellings it accepts."""
    if isinstance(value, bool | int):
        return int(value)
    if isinstance(value, float):
        return int(value) if value.is_integer() and abs(value) < _INT64 else None
    if isinstance(value, str) and _INT_STRING.fullmatch(value):
        return int(value.strip().split(".")[0])
    return None


@dataclass(slots=True)
class ParsedRequest:
    route: Route
    obj: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
    n: int = 1  # sequences per prompt the engine will run (n, or best_of if larger)
    edited: bool = False
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def include_usage(self) -> bool:
        opts = self.obj.get("stream_options")
        return bool(isinstance(opts, dict) and opts.get("include_usage"))

    def max_tokens_field(self) -> str:
        if self.route == "chat" and "max_completion_tokens" in self.obj:
            return "max_completion_tokens"
        return "max_tokens"

    def requested_max_tokens(self) -> int | None:
        value = self.obj.get(self.max_tokens_field())
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def set(self, key: str, value: Any) -> None:
        self.obj[key] = value
        self.edited = True

    def body_bytes(self) -> bytes:
        if not self.edited:
            return self.raw
        try:
            return orjson.dumps(self.obj)
        except orjson.JSONEncodeError:
            # orjson reads 1,024 levels of nesting but writes only 254: a body the
            # gateway edits must fit what it can write back (no OpenAI field nests so).
            raise bad_request(
                f"The request body is nested more than {MAX_WRITTEN_DEPTH} levels deep."
            ) from None


def parse(route: Route, raw: bytes) -> ParsedRequest:
    """Parse and check the fields the gateway relies on; raise `ApiError(400)` otherwise."""
    if not raw:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.")
    model = obj.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", param="model")
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.", param="stream")
    if route == "chat":
        messages = obj.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("`messages` must be a non-empty list.", param="messages")
    elif obj.get("prompt") is None and obj.get("prompt_embeds") is None:
        raise bad_request("`prompt` is required.", param="prompt")
    for key in ("max_tokens", "max_completion_tokens"):
        value = obj.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise bad_request(f"`{key}` must be a positive integer.", param=key)
    n = _positive_lax_int(obj, "n")
    if route == "completions":
        # vLLM's completions accept best_of: that many sequences run, n are returned.
        n = max(n, _positive_lax_int(obj, "best_of"))
    return ParsedRequest(route, obj, raw, model, stream, n=n)


def _positive_lax_int(obj: dict[str, Any], key: str) -> int:
    """`obj[key]` as vLLM's pydantic reads an `int | None = 1` field; 400 otherwise."""
    value = obj.get(key)
    if value is None:
        return 1
    number = lax_int(value)
    if number is None:
        raise bad_request(f"`{key}` must be an integer, got {value!r:.40}.", param=key)
    if number < 1:
        raise bad_request(f"`{key}` must be at least 1, got {number}.", param=key)
    return number
