"""OpenAI request parsing: just enough to route, limit and protect; the engine validates the rest.

Sans-I/O. The gateway forwards the client's bytes unchanged unless a policy must change
the request (a default or clamped `max_tokens`, `include_usage` added for accounting);
then `ParsedRequest.body_bytes()` re-serialises the edited object.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import orjson

from seawall.errors import ApiError, bad_request

Route = Literal["completions", "chat"]

# orjson's limit when writing (it reads deeper): a body edited by the gateway must fit.
MAX_WRITTEN_DEPTH = 254


@dataclass(slots=True)
class ParsedRequest:
    route: Route
    obj: dict[str, Any]
    raw: bytes
    model: str
    stream: bool
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
    elif "prompt" not in obj or obj["prompt"] is None:
        raise bad_request("`prompt` is required.", param="prompt")
    for key in ("max_tokens", "max_completion_tokens"):
        value = obj.get(key)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or value < 1
        ):
            raise bad_request(f"`{key}` must be a positive integer.", param=key)
    n = obj.get("n", 1)
    if n is not None and n != 1:
        # One choice per request keeps retry, hedge and migration semantics exact.
        raise ApiError(400, "Only n=1 is supported by this gateway.", param="n")
    return ParsedRequest(route, obj, raw, model, stream)
