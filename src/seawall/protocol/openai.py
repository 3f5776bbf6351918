"""Request parsing for every route the gateway passes through: just enough to route, limit
and protect; the engine validates the rest.

Sans-I/O. The gateway forwards the client's bytes unchanged unless a policy must change
the request (a default or clamped `max_tokens`, `include_usage` added for accounting);
then `ParsedRequest.body_bytes()` re-serialises the edited object. A multipart upload
(the audio routes) is never edited: its text fields are read in place
(`protocol/multipart.py`) and its bytes forwarded as they came.

What is checked, per route (`protocol/routes.py`): a JSON object body; `model` a
non-empty string (absent: allowed where vLLM allows it, and resolved to the fleet's only
model by the admission stack); `stream` a boolean; the output bound (`max_tokens`,
`max_completion_tokens`, `max_output_tokens`) and `n` integers as vLLM's pydantic models
read them in lax mode (`2`, `2.0`, `"2"`, `true`), so the count the gateway charges is the
count the engine runs; completions need a `prompt` and chat a non-empty `messages` list.
`n > 1` is served (issue 13) and counted as `n` sequences per prompt by
`protocol.tokens.count_request`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

from seawall.errors import bad_request
from seawall.protocol import multipart
from seawall.protocol.routes import ROUTES, Route, RouteSpec
from seawall.protocol.sse import Dialect
from seawall.protocol.structured import Constraint, constraints_of

__all__ = ["ParsedRequest", "Route", "lax_int", "parse"]

# The multipart form fields the gateway reads (the rest pass through unread).
_FORM_FIELDS = frozenset({"model", "stream", "prompt"})
# Form values pydantic's lax mode reads as `true` (case-insensitive).
_TRUE_TEXT = frozenset({"true", "1", "yes", "on", "t", "y"})

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
    content_type: str | None = None  # the client's, forwarded with the body
    constraints: tuple[Constraint, ...] = ()  # structured-output constraints it carries
    uploads: int = 0  # files in a multipart form
    spec: RouteSpec = field(init=False, repr=False, compare=False)  # the route's rules

    def __post_init__(self) -> None:
        self.spec = ROUTES[self.route]

    @property
    def dialect(self) -> Dialect:
        """How its stream is framed (the OpenAI chunk dialect for routes that never stream)."""
        return self.spec.dialect or Dialect.openai

    @property
    def include_usage(self) -> bool:
        opts = self.obj.get("stream_options")
        return bool(isinstance(opts, dict) and opts.get("include_usage"))

    def max_tokens_field(self) -> str:
        """The field that bounds the output: the first of the route's that the request
        sets, else the route's usual one (chat: `max_completion_tokens` when given)."""
        fields = self.spec.max_tokens_fields or ("max_tokens",)
        for name in fields[:-1]:
            if name in self.obj:
                return name
        return fields[-1]

    def requested_max_tokens(self) -> int | None:
        value = self.obj.get(self.max_tokens_field())
        return None if value is None else lax_int(value)

    def set(self, key: str, value: Any) -> None:
        if self.spec.body != "json":
            raise TypeError(f"a {self.spec.body} body is forwarded unchanged; cannot set {key}")
        self.obj[key] = value
        self.edited = True

    def with_model(self, served: str) -> bytes:
        """The body as sent to a replica that serves the model under `served` (a form's
        `model` field rewritten; a JSON body's by `gateway/aliases.py`)."""
        boundary = multipart.boundary_of(self.content_type)
        if self.spec.body != "multipart" or boundary is None:
            raise TypeError("only a multipart body is rewritten here")
        return multipart.with_field(self.raw, boundary, "model", served)

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


def parse(route: Route, raw: bytes, content_type: str | None = None) -> ParsedRequest:
    """Parse and check the fields the gateway relies on; raise `ApiError(400)` otherwise.
    `content_type`: the client's header (a multipart body needs its boundary)."""
    spec = ROUTES[route]
    if content_type is not None and not (content_type.isascii() and content_type.isprintable()):
        # It is forwarded as a header: only what HTTP can carry as it came.
        raise bad_request("The Content-Type header is not printable ASCII.")
    if spec.body == "multipart":
        return _parse_form(spec, raw, content_type)
    if not raw:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise bad_request("The request body must be a JSON object.")
    model = _model(spec, obj.get("model"))
    stream = obj.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.", param="stream")
    if route == "chat" and not isinstance(obj.get("messages"), list):
        # An empty list is the engine's to refuse (vLLM: "Cannot apply chat template to an
        # empty conversation"); anything but a list cannot be counted.
        raise bad_request("`messages` must be a list.", param="messages")
    elif route == "completions" and obj.get("prompt") is None and obj.get("prompt_embeds") is None:
        raise bad_request("`prompt` is required.", param="prompt")
    for key in spec.max_tokens_fields:
        value = obj.get(key)
        if value is None:
            continue
        number = lax_int(value)
        # Completions take 0 with `echo` (the prompt alone, with its logprobs: how
        # lm-eval-harness scores a text); the engine refuses it otherwise.
        least = 0 if route == "completions" else 1
        if number is None or number < least:
            raise bad_request(f"`{key}` must be a positive integer.", param=key)
    n = 1
    if route in ("completions", "chat"):
        n = _positive_lax_int(obj, "n")
    if route == "completions":
        # vLLM's completions accept best_of: that many sequences run, n are returned.
        n = max(n, _positive_lax_int(obj, "best_of"))
    return ParsedRequest(
        route,
        obj,
        raw,
        model,
        stream and spec.dialect is not None,
        n=n,
        content_type=content_type,
        constraints=constraints_of(route, obj),
    )


def _model(spec: RouteSpec, model: Any) -> str:
    if model is None and not spec.model_required:
        return ""  # the admission stack routes it to the fleet's only model
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string.", param="model")
    return model


def _parse_form(spec: RouteSpec, raw: bytes, content_type: str | None) -> ParsedRequest:
    boundary = multipart.boundary_of(content_type)
    if boundary is None:
        raise bad_request(
            f"`{spec.path}` takes a multipart/form-data body (with its boundary) holding the "
            "audio file and the request's fields."
        )
    form = multipart.scan(raw, boundary, _FORM_FIELDS)
    fields: dict[str, Any] = dict(form.fields)
    model = _model(spec, fields.get("model"))
    stream = fields.get("stream", "").strip().lower() in _TRUE_TEXT
    fields["stream"] = stream
    return ParsedRequest(
        spec.name,
        fields,
        raw,
        model,
        stream,
        content_type=content_type,
        uploads=len(form.files),
    )


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
