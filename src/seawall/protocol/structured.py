"""Grammar-constrained output: where a request asks for it, and how big its grammar is.

Why the gateway cares (issue 11, item 11): vLLM 0.33 fills the batch's grammar bitmask
while the forward pass runs and samples only when both are done, so one request with a
huge or deeply nested schema lengthens every decode step it takes part in, and every
stream sharing those steps slows with it. Tiers bound a constraint's size and depth
(`TierConfig.max_schema_nodes`, `max_schema_depth`), and may send constrained requests
to replicas of their own (`grammar_replicas`, the bulkhead in `gateway/bulkhead.py`).

Where vLLM 0.33 reads a constraint (its `structured_outputs_from_response_format`,
`ResponsesRequest.extract_structured_outputs`, the Anthropic converter's
`_handle_output_config`); the removed `guided_*` fields are ignored by vLLM 0.33 and so
constrain nothing:
- chat and completions: `response_format` (`json_schema.schema`, `json_object`,
  `structural_tag`), `structured_outputs` (`json`, `regex`, `choice`, `grammar`,
  `json_object`, `structural_tag`), and chat's named `tool_choice` (the tool's
  `parameters` schema becomes the grammar);
- `/v1/responses`: `text.format` (`json_schema`'s `schema`, `json_object`) and
  `structured_outputs`;
- `/v1/messages`: `output_config.format.schema`.

Size is measured as `seawall sim` costs it (`sim/scheduler.py` `schema_shape`): every
object, array and scalar of a JSON schema is a node, depth is the deepest nesting of
objects and arrays; a regex, grammar or structural tag given as text counts its
characters as nodes and its bracket nesting + 1 as depth.

Pure: no I/O; the walk is iterative (a schema nested a thousand deep is fine) and bounded
by the body, which the tier's byte bound has already limited.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from seawall.errors import ApiError


@dataclass(frozen=True, slots=True)
class Constraint:
    """One structured-output constraint of a request."""

    param: str  # where the request put it (named in a refusal)
    value: object  # a JSON schema or value (or its JSON text), or a regex/grammar/tag
    text: bool = False  # `value` is text to be compiled (regex, grammar, tag)


@dataclass(frozen=True, slots=True)
class Shape:
    nodes: int
    depth: int


def json_shape(value: object) -> Shape:
    """Nodes and depth of a JSON value (as the sim's `schema_shape` counts them)."""
    nodes = 0
    depth = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        nodes += 1
        if level > depth:
            depth = level
        if isinstance(item, dict):
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, level + 1) for v in item)
    return Shape(nodes, depth)


def text_shape(text: str) -> Shape:
    """A pattern's characters, and its bracket nesting + 1 (as the sim counts them)."""
    depth = deepest = 0
    for ch in text:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth -= 1
    return Shape(len(text), deepest + 1)


def shape(constraint: Constraint) -> Shape:
    value = constraint.value
    if constraint.text:
        return text_shape(str(value))
    if isinstance(value, str):
        # `structured_outputs.json` may be a schema's JSON text: measured only when a
        # limit asks, so a request without one never pays for decoding it
        try:
            return json_shape(orjson.loads(value))
        except orjson.JSONDecodeError:
            return text_shape(value)
    return json_shape(value)


def _structured_outputs(obj: dict[str, Any], found: list[Constraint]) -> None:
    so = obj.get("structured_outputs")
    if not isinstance(so, dict):
        return
    if so.get("json") is not None:
        found.append(Constraint("structured_outputs.json", so["json"]))
    for key in ("regex", "grammar", "structural_tag"):
        value = so.get(key)
        if value is not None:
            text = value if isinstance(value, str) else orjson.dumps(value).decode()
            found.append(Constraint(f"structured_outputs.{key}", text, text=True))
    if so.get("choice") is not None:
        found.append(Constraint("structured_outputs.choice", so["choice"]))
    if so.get("json_object"):
        found.append(Constraint("structured_outputs.json_object", {"type": "object"}))


def _response_format(obj: dict[str, Any], found: list[Constraint]) -> None:
    rf = obj.get("response_format")
    if not isinstance(rf, dict):
        return
    kind = rf.get("type")
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if isinstance(spec, dict) and spec.get("schema") is not None:
            found.append(Constraint("response_format", spec["schema"]))
    elif kind == "json_object":
        found.append(Constraint("response_format", {"type": "object"}))
    elif kind == "structural_tag":
        found.append(Constraint("response_format", {k: v for k, v in rf.items() if k != "type"}))


def _named_tool(obj: dict[str, Any], found: list[Constraint]) -> None:
    choice = obj.get("tool_choice")
    if not isinstance(choice, dict):
        return
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    for tool in obj.get("tools") or ():
        fn = tool.get("function") if isinstance(tool, dict) else None
        if isinstance(fn, dict) and fn.get("name") == name and fn.get("parameters") is not None:
            found.append(Constraint("tool_choice", fn["parameters"]))


def constraints_of(route: str, obj: dict[str, Any]) -> tuple[Constraint, ...]:
    """Every structured-output constraint `obj` (a request of `route`) carries. Cheap:
    key lookups only; `shape` does the walk."""
    found: list[Constraint] = []
    if route in ("chat", "completions"):
        _response_format(obj, found)
        _structured_outputs(obj, found)
        if route == "chat":
            _named_tool(obj, found)
    elif route == "responses":
        text = obj.get("text")
        fmt = text.get("format") if isinstance(text, dict) else None
        if isinstance(fmt, dict):
            if fmt.get("type") == "json_schema" and fmt.get("schema") is not None:
                found.append(Constraint("text.format", fmt["schema"]))
            elif fmt.get("type") == "json_object":
                found.append(Constraint("text.format", {"type": "object"}))
        _structured_outputs(obj, found)
    elif route == "messages":
        config = obj.get("output_config")
        fmt = config.get("format") if isinstance(config, dict) else None
        if isinstance(fmt, dict) and fmt.get("schema") is not None:
            found.append(Constraint("output_config.format", fmt["schema"]))
    return tuple(found)


def check_constraints(
    constraints: tuple[Constraint, ...], max_nodes: int | None, max_depth: int | None
) -> ApiError | None:
    """A 400 for the first constraint over a tier's size or depth limit (None: within).
    The walk happens only when a limit is set."""
    if max_nodes is None and max_depth is None:
        return None
    for constraint in constraints:
        got = shape(constraint)
        if max_nodes is not None and got.nodes > max_nodes:
            return ApiError(
                400,
                f"The structured-output constraint in `{constraint.param}` has {got.nodes} "
                f"nodes; this tier allows at most {max_nodes} (max_schema_nodes). Every decode "
                "step that samples it pays for its grammar, so a large one slows the other "
                "requests sharing those steps.",
                param=constraint.param,
                code="schema_too_large",
            )
        if max_depth is not None and got.depth > max_depth:
            return ApiError(
                400,
                f"The structured-output constraint in `{constraint.param}` is nested "
                f"{got.depth} levels deep; this tier allows at most {max_depth} "
                "(max_schema_depth).",
                param=constraint.param,
                code="schema_too_deep",
            )
    return None
