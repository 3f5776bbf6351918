"""Capture vLLM 0.33.0's truth into tests/data/vllm/ (run by capture.sh, in its venv).

Writes three fixtures, all data produced by vLLM's own code:
- `schemas.json`: JSON Schemas from vLLM's pydantic request/response/stream models
  (`model_json_schema`, serialization mode for what vLLM writes, validation mode for
  what it reads).
- `captured.json`: for every case in `CASES`, the request sent and what vLLM's real HTTP
  server (harness.py: vLLM's app, serving classes and AsyncLLM, a stand-in engine core)
  answered: status, content type, and the body (parsed JSON, or the list of SSE events).
- `versions.json`: the versions of vLLM and of the libraries whose behaviour shows in
  the texts (pydantic, pydantic-core, fastapi, starlette).

Values that are random or timed (ids, `created`) are kept as vLLM wrote them; the tests
compare shapes, statuses and error texts, not those values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import typing
from importlib.metadata import version
from pathlib import Path
from typing import Any

import harness

M = harness.MODEL_NAME
LONG_TEXT = "word " * 5000  # > 4096 tokens with any tokenizer, < 4096 * 13 characters
CHAT = [{"role": "user", "content": "Say something."}]

# (name, method, path, body or None, headers)
Case = tuple[str, str, str, Any, dict[str, str]]
JSON_CT = {"Content-Type": "application/json"}


def _c(name: str, body: Any, path: str = "/v1/completions", **headers: str) -> Case:
    return (name, "POST", path, body, {**JSON_CT, **headers})


def _chat(name: str, body: dict[str, Any], **headers: str) -> Case:
    return _c(name, {"model": M, "messages": CHAT, **body}, "/v1/chat/completions", **headers)


def _cmpl(name: str, body: dict[str, Any], **headers: str) -> Case:
    return _c(name, {"model": M, "prompt": "Hello", **body}, **headers)


CASES: list[Case] = [
    # ---- completions: shapes
    _cmpl("cmpl.basic", {"max_tokens": 5}),
    _cmpl("cmpl.default_max_tokens", {}),
    _cmpl("cmpl.stream", {"max_tokens": 3, "stream": True}),
    _cmpl(
        "cmpl.stream_usage",
        {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    ),
    _cmpl(
        "cmpl.stream_continuous",
        {
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    _cmpl("cmpl.n2", {"max_tokens": 3, "n": 2}),
    _cmpl(
        "cmpl.n2_stream",
        {"max_tokens": 3, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
    ),
    _c("cmpl.batch", {"model": M, "prompt": ["Hello", "World"], "max_tokens": 2}),
    _c(
        "cmpl.batch_stream",
        {"model": M, "prompt": ["Hello", "World"], "max_tokens": 2, "stream": True},
    ),
    _c("cmpl.token_ids", {"model": M, "prompt": [72, 101, 108], "max_tokens": 2}),
    _cmpl("cmpl.echo", {"max_tokens": 3, "echo": True}),
    _cmpl("cmpl.echo_stream", {"max_tokens": 3, "echo": True, "stream": True}),
    _cmpl("cmpl.echo_max0", {"max_tokens": 0, "echo": True}),
    _cmpl("cmpl.logprobs", {"max_tokens": 3, "logprobs": 2}),
    _cmpl("cmpl.logprobs_stream", {"max_tokens": 3, "logprobs": 2, "stream": True}),
    _cmpl("cmpl.logprobs0", {"max_tokens": 2, "logprobs": 0}),
    _cmpl("cmpl.echo_logprobs", {"max_tokens": 2, "logprobs": 1, "echo": True}),
    _cmpl("cmpl.prompt_logprobs", {"max_tokens": 2, "prompt_logprobs": 1}),
    _cmpl("cmpl.return_token_ids", {"max_tokens": 3, "return_token_ids": True}),
    _cmpl(
        "cmpl.return_token_ids_stream", {"max_tokens": 3, "return_token_ids": True, "stream": True}
    ),
    # the stand-in generates " the quick ...": token 86 is "t" (byte ids follow 3 specials)
    _cmpl("cmpl.stop_token_ids", {"max_tokens": 20, "stop_token_ids": [86]}),
    _cmpl("cmpl.stop_token_ids_stream", {"max_tokens": 20, "stop_token_ids": [86], "stream": True}),
    _cmpl("cmpl.stop_string", {"max_tokens": 20, "stop": [" quick"]}),
    _cmpl("cmpl.stop_string_stream", {"max_tokens": 20, "stop": [" quick"], "stream": True}),
    _cmpl("cmpl.body_request_id", {"max_tokens": 1, "request_id": "my-body-id"}),
    _cmpl(
        "cmpl.header_request_id",
        {"max_tokens": 1, "request_id": "my-body-id"},
        **{"X-Request-Id": "my-header-id"},
    ),
    _cmpl("cmpl.max_tokens_float_whole", {"max_tokens": 2.0}),
    _cmpl("cmpl.max_tokens_true", {"max_tokens": True}),
    _cmpl("cmpl.max_tokens_numeric_string", {"max_tokens": "2"}),
    _cmpl("cmpl.max_tokens_null", {"max_tokens": None}),
    _cmpl("cmpl.clamped_max_tokens", {"max_tokens": 4095, "prompt": "Hello"}),
    _cmpl("cmpl.extra_field", {"max_tokens": 1, "not_a_field": 1}),
    _cmpl("cmpl.guided_json_removed", {"max_tokens": 1, "guided_json": {"type": "object"}}),
    _cmpl(
        "cmpl.response_format_json",
        {
            "max_tokens": 1,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        },
    ),
    # a request-level engine error (FinishReason.ERROR), before and during a stream
    _cmpl("cmpl.generation_error", {"max_tokens": 10, "vllm_xargs": {"fake_error_after": 2}}),
    _cmpl(
        "cmpl.generation_error_stream",
        {"max_tokens": 10, "stream": True, "vllm_xargs": {"fake_error_after": 2}},
    ),
    _cmpl(
        "cmpl.generation_error_first_stream",
        {"max_tokens": 10, "stream": True, "vllm_xargs": {"fake_error_after": 0}},
    ),
    _chat(
        "chat.generation_error_stream",
        {"max_tokens": 10, "stream": True, "vllm_xargs": {"fake_error_after": 2}},
    ),
    # ---- completions: errors
    _cmpl("err.max_tokens_fraction", {"max_tokens": 2.5}),
    _cmpl("err.max_tokens_string", {"max_tokens": "abc"}),
    _cmpl("err.max_tokens_negative", {"max_tokens": -1}),
    _cmpl("err.max_tokens_over_len", {"max_tokens": 5000}),
    _cmpl("err.n_zero", {"max_tokens": 1, "n": 0}),
    _cmpl("err.n_string", {"max_tokens": 1, "n": "two"}),
    _cmpl("err.temperature_negative", {"max_tokens": 1, "temperature": -1}),
    _cmpl("err.temperature_string", {"max_tokens": 1, "temperature": "hot"}),
    _cmpl("err.temperature_3", {"max_tokens": 1, "temperature": 3}),
    _cmpl("err.top_p_0", {"max_tokens": 1, "top_p": 0}),
    _cmpl("err.top_k_negative", {"max_tokens": 1, "top_k": -2}),
    _cmpl("err.min_p_2", {"max_tokens": 1, "min_p": 2}),
    _cmpl("err.presence_penalty_3", {"max_tokens": 1, "presence_penalty": 3}),
    _cmpl("err.frequency_penalty_3", {"max_tokens": 1, "frequency_penalty": -3}),
    _cmpl("err.repetition_penalty_0", {"max_tokens": 1, "repetition_penalty": 0}),
    _cmpl("err.min_tokens_negative", {"max_tokens": 1, "min_tokens": -1}),
    _chat("err.chat.temperature_3", {"max_tokens": 1, "temperature": 3}),
    _cmpl("err.logprobs_21", {"max_tokens": 1, "logprobs": 21}),
    _cmpl("err.logprobs_negative", {"max_tokens": 1, "logprobs": -2}),
    _cmpl("err.logprobs_string", {"max_tokens": 1, "logprobs": "x"}),
    _cmpl("err.prompt_logprobs_stream", {"max_tokens": 1, "prompt_logprobs": 1, "stream": True}),
    _cmpl("err.prompt_logprobs_21", {"max_tokens": 1, "prompt_logprobs": 21}),
    _cmpl(
        "err.stream_options_without_stream",
        {"max_tokens": 1, "stream_options": {"include_usage": True}},
    ),
    _cmpl("err.suffix", {"max_tokens": 1, "suffix": "end"}),
    _cmpl("err.seed_string", {"max_tokens": 1, "seed": "x"}),
    _cmpl("err.stop_int", {"max_tokens": 1, "stop": 5}),
    _cmpl("err.unknown_model", {"max_tokens": 1, "model": "nope"}),
    _c("err.no_prompt", {"model": M, "max_tokens": 1}),
    _c("err.empty_prompt", {"model": M, "prompt": "", "max_tokens": 1}),
    _c("err.prompt_int", {"model": M, "prompt": 5, "max_tokens": 1}),
    _c("err.prompt_negative_id", {"model": M, "prompt": [1, -1], "max_tokens": 1}),
    _c("err.prompt_ids_too_long", {"model": M, "prompt": [72] * 5000, "max_tokens": 1}),
    _c("err.prompt_ids_exact_len", {"model": M, "prompt": [72] * 4096, "max_tokens": 1}),
    _c("err.prompt_text_too_long", {"model": M, "prompt": LONG_TEXT, "max_tokens": 1}),
    _c("err.prompt_text_too_many_chars", {"model": M, "prompt": "x" * 60000, "max_tokens": 1}),
    _c("err.prompt_empty_list", {"model": M, "prompt": [], "max_tokens": 1}),
    _c("err.prompt_empty_in_batch", {"model": M, "prompt": [[]], "max_tokens": 1}),
    _c("err.prompt_empty_string_in_batch", {"model": M, "prompt": [""], "max_tokens": 1}),
    _c("err.prompt_id_out_of_vocab", {"model": M, "prompt": [72, 2147483647], "max_tokens": 1}),
    _c("err.body_list", [1, 2]),
    ("err.invalid_json", "POST", "/v1/completions", b"{not json", JSON_CT),
    (
        "err.content_type_text",
        "POST",
        "/v1/completions",
        json.dumps({"model": M, "prompt": "Hi"}).encode(),
        {"Content-Type": "text/plain"},
    ),
    (
        "err.content_type_missing",
        "POST",
        "/v1/completions",
        json.dumps({"model": M, "prompt": "Hi"}).encode(),
        {},
    ),
    ("err.unknown_route", "POST", "/v1/nope", {"model": M}, JSON_CT),
    ("err.unknown_route_get", "GET", "/nope", None, {}),
    ("err.method_not_allowed", "GET", "/v1/completions", None, {}),
    ("err.method_not_allowed_chat", "GET", "/v1/chat/completions", None, {}),
    # ---- chat
    _chat("chat.basic", {"max_tokens": 3}),
    _chat("chat.max_completion_tokens", {"max_completion_tokens": 3}),
    _c(
        "chat.default_max_tokens",
        {"model": M, "messages": [{"role": "user", "content": "x" * 4070}]},
        "/v1/chat/completions",
    ),
    _chat("chat.stream", {"max_tokens": 3, "stream": True}),
    _chat(
        "chat.stream_usage",
        {"max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    ),
    _chat(
        "chat.stream_continuous",
        {
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        },
    ),
    _chat("chat.n2", {"max_tokens": 2, "n": 2}),
    _chat(
        "chat.n2_stream",
        {"max_tokens": 2, "n": 2, "stream": True, "stream_options": {"include_usage": True}},
    ),
    _chat("chat.logprobs", {"max_tokens": 2, "logprobs": True, "top_logprobs": 2}),
    _chat(
        "chat.logprobs_stream",
        {"max_tokens": 2, "logprobs": True, "top_logprobs": 2, "stream": True},
    ),
    _chat("chat.logprobs_no_top", {"max_tokens": 2, "logprobs": True}),
    _chat("chat.prompt_logprobs", {"max_tokens": 2, "prompt_logprobs": 1}),
    _chat("chat.return_token_ids", {"max_tokens": 2, "return_token_ids": True}),
    _chat(
        "chat.return_token_ids_stream", {"max_tokens": 2, "return_token_ids": True, "stream": True}
    ),
    _chat("chat.stop_token_ids", {"max_tokens": 20, "stop_token_ids": [86]}),
    _chat("chat.stop_token_ids_stream", {"max_tokens": 20, "stop_token_ids": [86], "stream": True}),
    _chat("chat.echo", {"max_tokens": 2, "echo": True}),
    _chat("chat.echo_stream", {"max_tokens": 2, "echo": True, "stream": True}),
    _chat("chat.header_request_id", {"max_tokens": 1}, **{"X-Request-Id": "hdr-1"}),
    _chat(
        "chat.tools_none",
        {
            "max_tokens": 1,
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
        },
    ),
    _chat(
        "chat.continue_final",
        {
            "max_tokens": 2,
            "add_generation_prompt": False,
            "continue_final_message": True,
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hel"},
            ],
        },
    ),
    _chat("err.chat.top_logprobs_without_logprobs", {"max_tokens": 1, "top_logprobs": 2}),
    _chat("err.chat.top_logprobs_21", {"max_tokens": 1, "logprobs": True, "top_logprobs": 21}),
    _chat(
        "err.chat.top_logprobs_negative", {"max_tokens": 1, "logprobs": True, "top_logprobs": -1}
    ),
    _chat(
        "err.chat.stream_options_without_stream",
        {"max_tokens": 1, "stream_options": {"include_usage": True}},
    ),
    _chat(
        "err.chat.tools_auto",
        {
            "max_tokens": 1,
            "tool_choice": "auto",
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
        },
    ),
    _chat(
        "err.chat.tools_required",
        {
            "max_tokens": 1,
            "tool_choice": "required",
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            ],
        },
    ),
    _chat("err.chat.max_tokens_string", {"max_tokens": "abc"}),
    _chat("err.chat.max_tokens_over_len", {"max_tokens": 5000}),
    _chat("err.chat.max_completion_tokens_over_len", {"max_completion_tokens": 5000}),
    _chat("err.chat.n_zero", {"max_tokens": 1, "n": 0}),
    _chat("err.chat.unknown_model", {"max_tokens": 1, "model": "nope"}),
    _chat(
        "err.chat.both_generation_flags",
        {"max_tokens": 1, "add_generation_prompt": True, "continue_final_message": True},
    ),
    _c(
        "err.chat.empty_messages",
        {"model": M, "messages": [], "max_tokens": 1},
        "/v1/chat/completions",
    ),
    _c(
        "chat.message_without_content",
        {"model": M, "messages": [{"role": "user"}], "max_tokens": 2},
        "/v1/chat/completions",
    ),
    _c("err.chat.no_messages", {"model": M, "max_tokens": 1}, "/v1/chat/completions"),
    _c("err.chat.messages_string", {"model": M, "messages": "hi"}, "/v1/chat/completions"),
    _c(
        "err.chat.prompt_too_long",
        {"model": M, "max_tokens": 1, "messages": [{"role": "user", "content": LONG_TEXT}]},
        "/v1/chat/completions",
    ),
    (
        "err.chat.content_type_text",
        "POST",
        "/v1/chat/completions",
        json.dumps({"model": M, "messages": CHAT}).encode(),
        {"Content-Type": "text/plain"},
    ),
    # ---- responses
    _c(
        "resp.basic",
        {"model": M, "input": "Say something.", "max_output_tokens": 3},
        "/v1/responses",
    ),
    _c(
        "resp.messages",
        {
            "model": M,
            "input": [{"role": "user", "content": "Hi"}],
            "max_output_tokens": 3,
            "instructions": "Be brief.",
        },
        "/v1/responses",
    ),
    _c(
        "resp.stream",
        {"model": M, "input": "Say something.", "max_output_tokens": 3, "stream": True},
        "/v1/responses",
    ),
    _c("resp.completed", {"model": M, "input": "Hi", "max_output_tokens": 100}, "/v1/responses"),
    _c(
        "resp.stream_completed",
        {"model": M, "input": "Hi", "max_output_tokens": 100, "stream": True},
        "/v1/responses",
    ),
    _cmpl("cmpl.eos", {"max_tokens": 100}),
    _cmpl("cmpl.eos_stream", {"max_tokens": 100, "stream": True}),
    _cmpl("cmpl.ignore_eos", {"max_tokens": 50, "ignore_eos": True}),
    _c("resp.default_max_tokens", {"model": M, "input": "x" * 4070}, "/v1/responses"),
    _c("err.resp.unknown_model", {"model": "nope", "input": "Hi"}, "/v1/responses"),
    _c("err.resp.no_input", {"model": M}, "/v1/responses"),
    _c(
        "err.resp.max_output_tokens_string",
        {"model": M, "input": "Hi", "max_output_tokens": "x"},
        "/v1/responses",
    ),
    _c("err.resp.too_long", {"model": M, "input": LONG_TEXT}, "/v1/responses"),
    # ---- tokenize / detokenize
    _c("tok.prompt", {"model": M, "prompt": "Hello world"}, "/tokenize"),
    _c("tok.prompt_no_model", {"prompt": "Hello world"}, "/tokenize"),
    _c(
        "tok.prompt_token_strs",
        {"model": M, "prompt": "Hi", "return_token_strs": True},
        "/tokenize",
    ),
    _c("tok.messages", {"model": M, "messages": CHAT}, "/tokenize"),
    _c(
        "tok.messages_no_gen",
        {"model": M, "messages": CHAT, "add_generation_prompt": False},
        "/tokenize",
    ),
    _c("detok.basic", {"model": M, "tokens": [75, 104, 105]}, "/detokenize"),
    _c("err.tok.unknown_model", {"model": "nope", "prompt": "Hi"}, "/tokenize"),
    _c("err.tok.no_prompt", {"model": M}, "/tokenize"),
    _c("err.tok.prompt_int", {"model": M, "prompt": 5}, "/tokenize"),
    _c("tok.longer_than_context", {"model": M, "prompt": LONG_TEXT}, "/tokenize"),
    _c("err.detok.unknown_model", {"model": "nope", "tokens": [75]}, "/detokenize"),
    _c("err.detok.tokens_strings", {"model": M, "tokens": ["a"]}, "/detokenize"),
    _c("err.detok.no_tokens", {"model": M}, "/detokenize"),
    _c("detok.out_of_vocab", {"model": M, "tokens": [2147483647]}, "/detokenize"),
    ("err.tok.method_not_allowed", "GET", "/tokenize", None, {}),
    # ---- pooling routes: vLLM registers them only for pooling models, not for generate
    _c("misc.embeddings_on_generate_model", {"model": M, "input": "Hi"}, "/v1/embeddings"),
    _c("misc.pooling_on_generate_model", {"model": M, "input": "Hi"}, "/pooling"),
    _c("misc.score_on_generate_model", {"model": M, "text_1": "a", "text_2": "b"}, "/score"),
    _c("misc.rerank_on_generate_model", {"model": M, "query": "a", "documents": ["b"]}, "/rerank"),
    # ---- misc routes
    ("misc.models", "GET", "/v1/models", None, {}),
    ("misc.version", "GET", "/version", None, {}),
    ("misc.health", "GET", "/health", None, {}),
]


def _compact(value: Any) -> Any:
    """Long repetitive request values, written as {"$repeat": unit, "times": n} (a string
    repeated, or a list of one repeated item) so the fixture stays small; the test
    support's `replay` expands them."""
    if isinstance(value, dict):
        return {k: _compact(v) for k, v in value.items()}
    if isinstance(value, list):
        if len(value) > 64 and all(v == value[0] for v in value):
            return {"$repeat": [value[0]], "times": len(value)}
        return [_compact(v) for v in value]
    if isinstance(value, str) and len(value) > 256:
        for size in range(1, 17):
            unit = value[:size]
            if len(value) % size == 0 and unit * (len(value) // size) == value:
                return {"$repeat": unit, "times": len(value) // size}
    return value


def _sse_events(text: str) -> list[Any]:
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block.strip():
            continue
        event: dict[str, Any] = {}
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            event[field] = value
        if "data" in event and event["data"] != "[DONE]":
            event["data"] = json.loads(event["data"])
        events.append(event if set(event) != {"data"} else event["data"])
    return events


async def _capture(port: int) -> dict[str, Any]:
    import aiohttp

    out: dict[str, Any] = {}
    timeout = aiohttp.ClientTimeout(total=60)
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(
        f"http://127.0.0.1:{port}", timeout=timeout, connector=connector
    ) as session:
        for name, method, path, body, headers in CASES:
            data = body if isinstance(body, bytes) or body is None else json.dumps(body)
            if isinstance(data, str):
                data = data.encode()
            async with session.request(
                method, path, data=data, headers=headers, skip_auto_headers=["Content-Type"]
            ) as r:
                raw = await r.text()
                ctype = r.headers.get("Content-Type", "")
                parsed: Any
                if ctype.startswith("text/event-stream"):
                    parsed = {"sse": _sse_events(raw)}
                else:
                    try:
                        parsed = {"json": json.loads(raw)}
                        tokens = parsed["json"].get("tokens")
                        if isinstance(tokens, list) and len(tokens) > 64:
                            # keep the fixture small: the count field says how many
                            parsed["json"]["tokens"] = [*tokens[:8], "...elided"]
                    except ValueError:
                        parsed = {"text": raw}
            shown = _compact(body.decode() if isinstance(body, bytes) else body)
            out[name] = {
                "request": {"method": method, "path": path, "headers": headers, "body": shown},
                "status": r.status,
                "content_type": ctype,
                "x_request_id": r.headers.get("X-Request-Id"),
                **parsed,
            }
            print(f"{r.status} {name}", file=sys.stderr)
    return out


def _schemas(seen_event_types: set[str]) -> dict[str, Any]:
    from vllm.entrypoints.openai.chat_completion import protocol as chat
    from vllm.entrypoints.openai.completion import protocol as cmpl
    from vllm.entrypoints.openai.responses import protocol as resp
    from vllm.entrypoints.serve.engine import protocol as engine
    from vllm.entrypoints.serve.tokenize import protocol as tok

    written = {
        "CompletionResponse": cmpl.CompletionResponse,
        "CompletionStreamResponse": cmpl.CompletionStreamResponse,
        "ChatCompletionResponse": chat.ChatCompletionResponse,
        "ChatCompletionStreamResponse": chat.ChatCompletionStreamResponse,
        "ResponsesResponse": resp.ResponsesResponse,
        "TokenizeResponse": tok.TokenizeResponse,
        "DetokenizeResponse": tok.DetokenizeResponse,
        "ErrorResponse": engine.ErrorResponse,
        "ModelList": engine.ModelList,
    }
    read = {
        "CompletionRequest": cmpl.CompletionRequest,
        "ChatCompletionRequest": chat.ChatCompletionRequest,
        "ResponsesRequest": resp.ResponsesRequest,
        "TokenizeCompletionRequest": tok.TokenizeCompletionRequest,
        "TokenizeChatRequest": tok.TokenizeChatRequest,
        "DetokenizeRequest": tok.DetokenizeRequest,
    }
    out: dict[str, Any] = {}
    for name, model in written.items():
        out[name] = model.model_json_schema(mode="serialization")
    for name, model in read.items():
        try:
            out[name] = model.model_json_schema(mode="validation")
        except Exception as e:  # a request model with a type pydantic cannot describe
            out[name] = {"unavailable": f"{type(e).__name__}: {e}"}
    # The Responses stream: vLLM's event union (~24 members, tool and reasoning events
    # included) and the openai event types its streaming code builds, narrowed to the
    # `type`s the captured streams show; one schema, `type` tells the members apart.
    from pydantic import TypeAdapter
    from vllm.entrypoints.openai.responses import streaming_events

    members = list(typing.get_args(resp.StreamingResponsesResponse))
    members += [
        obj
        for name in dir(streaming_events)
        if name.endswith("Event") and isinstance(obj := getattr(streaming_events, name), type)
    ]
    by_type: dict[str, Any] = {}
    for member in members:
        field = getattr(member, "model_fields", {}).get("type")
        literal = typing.get_args(field.annotation) if field is not None else ()
        if len(literal) == 1:
            by_type.setdefault(literal[0], member)  # vLLM's own subclass first
    chosen = tuple(by_type[t] for t in sorted(seen_event_types) if t in by_type)
    missing = sorted(seen_event_types - set(by_type))
    if missing:
        raise SystemExit(f"no model found for streamed event types {missing}")
    events = TypeAdapter(typing.Union[chosen]).json_schema(mode="serialization")  # noqa: UP007
    out["ResponsesStreamEvents"] = events
    return out


# the schema each route's answers are checked against: (non-stream, stream chunk)
ROUTE_MODELS = {
    "/v1/completions": ("CompletionResponse", "CompletionStreamResponse"),
    "/v1/chat/completions": ("ChatCompletionResponse", "ChatCompletionStreamResponse"),
    "/v1/responses": ("ResponsesResponse", "ResponsesStreamEvents"),
    "/tokenize": ("TokenizeResponse", None),
    "/detokenize": ("DetokenizeResponse", None),
    "/v1/models": ("ModelList", None),
}


def _learn_required(schemas: dict[str, Any], captured: dict[str, Any]) -> None:
    """Set each object schema's `required` to the keys vLLM's dumps always wrote.

    Pydantic's own `required` lists only fields without defaults, but vLLM writes every
    field (`model_dump()`), drops some by custom serializers (`tool_calls` when empty) and
    omits unset ones in stream chunks (`exclude_unset`). What the captured answers show is
    the truth: a key present in every captured instance of a model is required, and the
    properties stay the list of keys that may appear."""
    seen: dict[int, set[str]] = {}
    nodes: dict[int, dict[str, Any]] = {}

    def resolve(root: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = root["$defs"][node["$ref"].rsplit("/", 1)[1]]
        return node

    def walk(root: dict[str, Any], node: dict[str, Any], value: Any) -> None:
        node = resolve(root, node)
        branches = node.get("anyOf") or node.get("oneOf")
        if branches:
            for branch in branches:
                b = resolve(root, branch)
                props = b.get("properties")
                if isinstance(value, dict) and isinstance(props, dict):
                    type_field = props.get("type", {})
                    if "const" in type_field and value.get("type") != type_field["const"]:
                        continue
                    if set(value) <= set(props):
                        walk(root, b, value)
                        return
                elif isinstance(value, list) and b.get("type") == "array":
                    walk(root, b, value)
                    return
                elif not isinstance(value, dict | list) and value is not None:
                    continue
            return
        if isinstance(value, dict) and isinstance(node.get("properties"), dict):
            key = id(node)
            nodes[key] = node
            seen[key] = set(value) if key not in seen else seen[key] & set(value)
            for k, v in value.items():
                if k in node["properties"]:
                    walk(root, node["properties"][k], v)
            extra = node.get("additionalProperties")
            if isinstance(extra, dict):
                for k, v in value.items():
                    if k not in node["properties"]:
                        walk(root, extra, v)
        elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
            for v in value.values():
                walk(root, node["additionalProperties"], v)
        elif isinstance(value, list) and isinstance(node.get("items"), dict):
            for v in value:
                walk(root, node["items"], v)

    errors = schemas["ErrorResponse"]
    for case in captured.values():
        body = case.get("json")
        if case["status"] != 200 and isinstance(body, dict) and "error" in body:
            walk(errors, errors, body)
        for event in case.get("sse", []):
            if isinstance(event, dict) and set(event) == {"error"}:
                walk(errors, errors, event)
        if case["status"] != 200:
            continue
        unary, chunk = ROUTE_MODELS.get(case["request"]["path"], (None, None))
        if "json" in case and unary is not None:
            walk(schemas[unary], schemas[unary], case["json"])
        for event in case.get("sse", []):
            if chunk is None or event == "[DONE]":
                continue
            data = event["data"] if isinstance(event, dict) and "event" in event else event
            if isinstance(data, dict) and set(data) == {"error"}:
                continue  # a mid-stream error event is an ErrorResponse, not a chunk
            walk(schemas[chunk], schemas[chunk], data)
    for key, node in nodes.items():
        node["required"] = sorted(seen[key])


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    app, engine = await harness.build_server()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = await harness.serve(app, port)
    try:
        captured = await _capture(port)
    finally:
        server.should_exit = True
        await asyncio.sleep(0.2)
    args.out.mkdir(parents=True, exist_ok=True)
    dump = {"indent": 1, "sort_keys": False, "ensure_ascii": False}
    (args.out / "captured.json").write_text(json.dumps(captured, **dump) + "\n")
    seen = {e["event"] for case in captured.values() for e in case.get("sse", []) if "event" in e}
    schemas = _schemas(seen)
    _learn_required(schemas, captured)
    (args.out / "schemas.json").write_text(json.dumps(schemas, **dump) + "\n")
    versions = {
        p: version(p)
        for p in (
            "vllm",
            "pydantic",
            "pydantic_core",
            "fastapi",
            "starlette",
            "uvicorn",
            "torch",
            "transformers",
        )
    }
    (args.out / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")
    engine.shutdown()


if __name__ == "__main__":
    asyncio.run(main())
