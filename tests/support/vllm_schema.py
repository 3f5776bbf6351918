"""Strict checks of an OpenAI-compatible server's answers against vLLM 0.33.0's own.

The fixtures in `tests/data/vllm/` were produced by vLLM's code (tools/vllm/capture.sh):
`schemas.json` holds JSON Schemas of vLLM's pydantic response models, `captured.json` what
vLLM's real HTTP server answered for each case of `tools/vllm/capture.py` (`CASES`).

Two checks, usable on any server that claims to be vLLM (the sim, and the gateway passing
vLLM's answers through):
- `validate(body, model)`: the body against the model's schema made strict: an object the
  schema describes with properties admits no other key, and lacks none of the keys vLLM
  always writes (capture.py set each `required` to the keys present in every one of vLLM's
  own dumps of that model: pydantic's own `required` lists only fields without defaults).
- `same_keys(body, captured)`: the nested key sets equal those of vLLM's own answer to the
  same request. Stream chunks are written with `exclude_unset`/`exclude_none`, so which
  keys a chunk has depends on the case; comparing with vLLM's chunk of the same kind is the
  strict check for them.
`replay(base_url, name)` sends one of vLLM's cases to another server and
`assert_like_vllm(name, answer)` applies every check that case allows.
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

DATA = Path(__file__).resolve().parents[1] / "data" / "vllm"


@functools.cache
def schemas() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DATA / "schemas.json").read_text())
    return loaded


@functools.cache
def captured() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DATA / "captured.json").read_text())
    return loaded


def case(name: str) -> dict[str, Any]:
    """What vLLM answered for the named case: status, content_type, json or sse."""
    found: dict[str, Any] = captured()[name]
    return found


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        out = {k: _strict(v) for k, v in node.items()}
        # vLLM's models accept extra fields (`extra="allow"`, so the schema says
        # `additionalProperties: true`) but its answers have none: an object described by
        # its properties admits no other key; a map (`additionalProperties: {schema}`) stays
        if isinstance(out.get("properties"), dict) and not isinstance(
            out.get("additionalProperties"), dict
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_strict(v) for v in node]
    return node


@functools.cache
def _validator(model: str) -> jsonschema.protocols.Validator:
    schema = _strict(copy.deepcopy(schemas()[model]))
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    validator: jsonschema.protocols.Validator = cls(schema)
    return validator


def validate(body: Any, model: str) -> None:
    """Raise `AssertionError` listing every way `body` breaks vLLM's `model` schema
    (`ROUTE_MODELS` names the models of each route, non-stream and stream chunk)."""
    errors = sorted(_validator(model).iter_errors(body), key=lambda e: e.path)
    if errors:
        lines = [f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}" for e in errors]
        raise AssertionError(f"not a vLLM {model}:\n  " + "\n  ".join(lines[:20]))


# Objects keyed by data, not by field: completions' `top_logprobs` ({token: logprob}) and
# `prompt_logprobs` entries ({token id: Logprob}); chat's `top_logprobs` are lists of
# objects with a `token` field, which are fields.
_MAP_KEYS = frozenset({"top_logprobs", "prompt_logprobs"})


def key_shape(value: Any, parent: str | None = None) -> Any:
    """The nested key structure of a JSON value: objects become {key: shape}, lists the
    union of their items' shapes, scalars and null None (so a null where vLLM has an
    object still counts as the same key). Maps keyed by data become {"<map>": shape}."""
    if isinstance(value, dict):
        if parent in _MAP_KEYS and "token" not in value:
            merged_map: Any = None
            for v in value.values():
                merged_map = _merge(merged_map, key_shape(v))
            return {"<map>": merged_map}
        return {k: key_shape(v, k) for k, v in value.items()}
    if isinstance(value, list):
        merged: Any = None
        for item in value:
            merged = _merge(merged, key_shape(item, parent))
        return [merged] if value else []
    return None


def _merge(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merge(a.get(k), b.get(k)) for k in a.keys() | b.keys()}
    if isinstance(a, list) and isinstance(b, list):
        return [_merge(a[0] if a else None, b[0] if b else None)] if a or b else []
    return a if a is not None else b


def _diff(a: Any, b: Any, path: str, out: list[str]) -> None:
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(a.keys() - b.keys()):
            out.append(f"{path}.{k}: extra key")
        for k in sorted(b.keys() - a.keys()):
            out.append(f"{path}.{k}: missing key")
        for k in sorted(a.keys() & b.keys()):
            _diff(a[k], b[k], f"{path}.{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and a and b:
        _diff(a[0], b[0], f"{path}[]", out)


def same_keys(body: Any, reference: Any, what: str = "body") -> None:
    """Raise `AssertionError` unless `body` has exactly the keys of vLLM's `reference`
    at every level (where both have an object, or a non-empty list)."""
    problems: list[str] = []
    _diff(key_shape(body), key_shape(reference), what, problems)
    if problems:
        raise AssertionError("keys differ from vLLM's:\n  " + "\n  ".join(problems))


def chunk_kinds(chunks: list[Any]) -> dict[str, Any]:
    """A stream's chunks by kind: role, content, final (has a finish_reason), usage
    (no choices); the first of each, for `same_keys`."""
    kinds: dict[str, Any] = {}
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        choices = chunk.get("choices")
        if set(chunk) == {"error"}:
            kind = "error"
        elif choices == []:
            kind = "usage"
        elif choices and "delta" in choices[0] and "role" in choices[0]["delta"]:
            kind = "role"
        elif choices and choices[0].get("finish_reason") is not None:
            kind = "final"
        else:
            kind = "content"
        kinds.setdefault(kind, chunk)
    return kinds


# ------------------------------------------------------------------ replaying vLLM's cases

# the schema each route's answers are checked against: (non-stream, stream chunk)
ROUTE_MODELS: dict[str, tuple[str, str | None]] = {
    "/v1/completions": ("CompletionResponse", "CompletionStreamResponse"),
    "/v1/chat/completions": ("ChatCompletionResponse", "ChatCompletionStreamResponse"),
    "/v1/responses": ("ResponsesResponse", "ResponsesStreamEvents"),
    "/tokenize": ("TokenizeResponse", None),
    "/detokenize": ("DetokenizeResponse", None),
    "/v1/models": ("ModelList", None),
}


def parse_sse(text: str) -> list[Any]:
    """SSE events as capture.py stores them: the parsed `data` (or "[DONE]"), or
    {"event": ..., "data": ...} when the event has an `event:` line."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event: dict[str, Any] = {}
        for line in block.split("\n"):
            name, _, value = line.partition(": ")
            event[name] = value
        if "data" in event and event["data"] != "[DONE]":
            event["data"] = json.loads(event["data"])
        events.append(event if set(event) != {"data"} else event["data"])
    return events


def replay(
    base_url: str,
    name: str,
    timeout_s: float = 30.0,
    headers: dict[str, str] | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """Send vLLM's case `name` to another server; its answer in `case()`'s form.

    `headers` are added (a gateway's `Authorization`); `model` replaces the captured
    `sim-model` where the body names it (a gateway serving another model name)."""
    import http.client
    from urllib.parse import urlsplit

    req = case(name)["request"]
    body = expand(req["body"])
    if model is not None and isinstance(body, dict) and body.get("model") == "sim-model":
        body = {**body, "model": model}
    if isinstance(body, str):
        data: bytes | None = body.encode()
    elif body is None:
        data = None
    else:
        data = json.dumps(body).encode()
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=timeout_s)
    try:
        conn.request(req["method"], req["path"], body=data,
                     headers={**req["headers"], **(headers or {})})  # fmt: skip
        resp = conn.getresponse()
        raw = resp.read().decode()
        ctype = resp.getheader("Content-Type") or ""
        out: dict[str, Any] = {"status": resp.status, "content_type": ctype,
                               "x_request_id": resp.getheader("X-Request-Id")}  # fmt: skip
    finally:
        conn.close()
    if ctype.startswith("text/event-stream"):
        out["sse"] = parse_sse(raw)
    else:
        try:
            out["json"] = json.loads(raw)
        except ValueError:
            out["text"] = raw
    return out


def expand(value: Any) -> Any:
    """A captured request value with its {"$repeat": unit, "times": n} parts expanded."""
    if isinstance(value, dict):
        if set(value) == {"$repeat", "times"}:
            repeated: Any = value["$repeat"] * value["times"]
            return repeated
        return {k: expand(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expand(v) for v in value]
    return value


def _collapse(kinds: list[str]) -> list[str]:
    out: list[str] = []
    for k in kinds:
        if not out or out[-1] != k:
            out.append(k)
    return out


# A finished response's last event says how it ended; the text (so whether EOS came
# before max_output_tokens) is the engine's, not the server's
_TERMINAL = {"response.completed": "<terminal>", "response.incomplete": "<terminal>"}


def assert_like_vllm(
    name: str, got: dict[str, Any], substitute: dict[str, str] | None = None
) -> None:
    """`got` (from `replay`) answers case `name` as vLLM did: the same status; an error
    body identical to vLLM's; a success body valid against vLLM's schema with vLLM's keys;
    a stream with vLLM's kinds of chunk, each with vLLM's keys, in vLLM's order.

    `substitute`: replacements in vLLM's error message for facts of the model, not of the
    server (the vocabulary size that `logprobs: -1` asks for)."""
    want = case(name)
    path = want["request"]["path"]
    assert got["status"] == want["status"], (name, got.get("json") or got.get("text"))
    if "json" in want and want["status"] != 200:
        expected = copy.deepcopy(want["json"])
        for old, new in (substitute or {}).items():
            expected["error"]["message"] = expected["error"]["message"].replace(old, new)
        assert got.get("json") == expected, (name, got)
        return
    if path == "/health":
        return
    if path not in ROUTE_MODELS:
        assert got.get("json") == want.get("json"), (name, got)
        return
    unary, chunk_model = ROUTE_MODELS[path]
    if "json" in want:
        assert "json" in got, (name, got)
        validate(got["json"], unary)
        same_keys(got["json"], want["json"], name)
        return
    assert "sse" in got, (name, got)
    assert got["content_type"].startswith("text/event-stream"), got["content_type"]
    if path == "/v1/responses":
        assert chunk_model is not None
        for event in got["sse"]:
            validate(event["data"], chunk_model)
        kinds = _collapse([_TERMINAL.get(e["event"], e["event"]) for e in got["sse"]])
        theirs = _collapse([_TERMINAL.get(e["event"], e["event"]) for e in want["sse"]])
        assert kinds == theirs, (name, kinds)
        for mine, theirs in zip(got["sse"], want["sse"], strict=False):
            if mine["event"] == theirs["event"]:
                same_keys(mine["data"], theirs["data"], f"{name}:{mine['event']}")
        return
    assert got["sse"][-1] == "[DONE]" and want["sse"][-1] == "[DONE]", name
    assert chunk_model is not None
    for chunk in got["sse"][:-1]:
        validate(chunk, "ErrorResponse" if _kind(chunk) == "error" else chunk_model)
    mine_kinds, their_kinds = chunk_kinds(got["sse"]), chunk_kinds(want["sse"])
    assert mine_kinds.keys() == their_kinds.keys(), (name, mine_kinds.keys())
    for kind, chunk in mine_kinds.items():
        same_keys(chunk, their_kinds[kind], f"{name}:{kind}")
    # the order of kinds over the stream (all role chunks first, usage last)
    order = _collapse([_kind(c) for c in got["sse"][:-1]])
    assert order == _collapse([_kind(c) for c in want["sse"][:-1]]), (name, order)


def _kind(chunk: Any) -> str:
    (kind,) = chunk_kinds([chunk])
    return kind
