"""The pure parts of passing every vLLM route through (issue 13, "the gateway passes through
what vLLM serves"; issue 11 item 11): the route table, each SSE dialect's classification
and raw end detection, multipart uploads read in place, structured-output shapes and
limits, the count rules of the new routes, and the grammar bulkhead's choice.

Streams are vLLM's own: the Responses events of `tests/data/vllm/captured.json`, written
back as vLLM writes them (`event: <type>\\ndata: <compact JSON>\\n\\n`), and Anthropic
events in the shapes of vLLM's `entrypoints/anthropic/serving.py` and llama.cpp's server.
"""

from __future__ import annotations

import tracemalloc
from typing import Any

import httpx
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seawall.config import ConfigError, GatewayConfig, TierConfig
from seawall.errors import ApiError
from seawall.gateway.bulkhead import Bulkhead
from seawall.protocol.multipart import boundary_of, scan
from seawall.protocol.openai import parse
from seawall.protocol.routes import ROUTES, Count
from seawall.protocol.sse import (
    CLASSIFY,
    DONE_EVENT,
    Dialect,
    EndWatch,
    Kind,
    SSEBuffer,
    error_event,
    event_usage,
    normalised_usage,
)
from seawall.protocol.structured import (
    Constraint,
    check_constraints,
    constraints_of,
    json_shape,
    shape,
)
from seawall.protocol.tokens import MEDIA_TOKENS, EstimateCounter, count_request
from seawall.sim.scheduler import schema_shape
from tests.support import vllm_schema as V

COUNTER = EstimateCounter()


# ------------------------------------------------------------------ streams as engines write them


def responses_stream(name: str) -> bytes:
    """A captured vLLM Responses stream, as vLLM's `_convert_stream_to_sse_events` writes it."""
    return b"".join(
        b"event: " + e["event"].encode() + b"\ndata: " + orjson.dumps(e["data"]) + b"\n\n"
        for e in V.case(name)["sse"]
    )


def openai_stream(name: str) -> bytes:
    out = b""
    for e in V.case(name)["sse"]:
        out += DONE_EVENT if e == "[DONE]" else b"data: " + orjson.dumps(e) + b"\n\n"
    return out


def _anthropic(kind: str, **fields: Any) -> bytes:
    return (
        b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"
    )


# vLLM's converter: message_start, a text block's start, deltas and stop, message_delta
# with the stop reason and usage, message_stop (`exclude_unset`: compact, typed).
ANTHROPIC = (
    _anthropic("message_start", message={"id": "chatcmpl-1", "type": "message",
               "role": "assistant", "content": [], "model": "m", "stop_reason": None,
               "stop_sequence": None, "usage": {"input_tokens": 9, "output_tokens": 0}})
    + _anthropic("content_block_start", index=0, content_block={"type": "text", "text": ""})
    + _anthropic("ping")
    + _anthropic("content_block_delta", index=0, delta={"type": "text_delta", "text": "Hi"})
    + _anthropic("content_block_delta", index=0, delta={"type": "text_delta", "text": "!"})
    + _anthropic("content_block_stop", index=0)
    + _anthropic("message_delta", delta={"stop_reason": "end_turn", "stop_sequence": None},
                 usage={"input_tokens": 9, "output_tokens": 2})
    + _anthropic("message_stop")
)  # fmt: skip

STREAMS = {
    Dialect.responses: (responses_stream("resp.stream"), responses_stream("resp.stream_completed")),
    Dialect.anthropic: (ANTHROPIC,),
    Dialect.openai: (openai_stream("chat.stream"), openai_stream("cmpl.n2_stream")),
}


def events_of(data: bytes) -> list[bytes]:
    buf = SSEBuffer()
    events = buf.feed(data)
    assert buf.pending == b""
    return events


@pytest.mark.parametrize(
    ("dialect", "first_token", "last"),
    [
        (Dialect.responses, "response.output_text.delta", "response.incomplete"),
        (Dialect.anthropic, "content_block_delta", "message_stop"),
    ],
)
def test_each_dialects_first_token_and_end_are_where_vllm_puts_them(
    dialect: Dialect, first_token: str, last: str
) -> None:
    stream = STREAMS[dialect][0]
    classified = [CLASSIFY[dialect](raw) for raw in events_of(stream)]
    kinds = [ev.kind for ev in classified]
    first = kinds.index(Kind.TOKEN)
    # Everything before the first output delta is held (the client sees nothing yet)...
    assert all(k in (Kind.PRELUDE, Kind.COMMENT) for k in kinds[:first])
    assert classified[first].obj is not None and classified[first].obj["type"] == first_token
    # ...and only the last event ends the stream.
    assert [ev.terminal for ev in classified] == [False] * (len(classified) - 1) + [True]
    assert classified[-1].obj is not None and classified[-1].obj["type"] == last


def test_a_vllm_responses_stream_ends_without_done() -> None:
    # What the relay must know: vLLM sends no `data: [DONE]` after response.completed.
    for name in ("resp.stream", "resp.stream_completed"):
        assert V.case(name)["sse"][-1]["event"] in ("response.completed", "response.incomplete")
        assert not responses_stream(name).endswith(DONE_EVENT)


def test_engine_errors_end_a_stream_in_every_dialect() -> None:
    failed = CLASSIFY[Dialect.responses](
        b'event: response.failed\ndata: {"type":"response.failed","response":{"error":'
        b'{"code":"server_error","message":"boom"}}}\n\n'
    )
    assert failed.kind is Kind.ERROR and failed.terminal
    anthropic = CLASSIFY[Dialect.anthropic](
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"x"}}\n\n'
    )
    assert anthropic.kind is Kind.ERROR and anthropic.terminal
    # the sim's (and vLLM's chat) mid-stream error: an error object, then [DONE]
    sim = CLASSIFY[Dialect.responses](b'data: {"error": {"message": "x", "code": 500}}\n\n')
    assert sim.kind is Kind.ERROR and not sim.terminal
    assert CLASSIFY[Dialect.responses](DONE_EVENT).terminal


@settings(max_examples=60, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("dialect", list(Dialect))
def test_raw_end_detection_is_right_however_the_stream_is_split_or_cut(
    dialect: Dialect, data: st.DataObject
) -> None:
    for stream in STREAMS[dialect]:
        # A whole stream, in reads split anywhere, ends cleanly and counts its events...
        cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
        watch = EndWatch(dialect)
        for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            watch.see(stream[a:b])
        assert watch.done
        assert watch.events == len(events_of(stream))
        # ...and the same stream cut anywhere before its last byte never does.
        cut = data.draw(st.integers(0, len(stream) - 1))
        watch = EndWatch(dialect)
        split = data.draw(st.integers(0, cut))
        watch.see(stream[:split])
        watch.see(stream[split:cut])
        assert not watch.done, (dialect, cut, stream[max(0, cut - 40) : cut])


def test_a_model_cannot_forge_an_end_in_its_text() -> None:
    # Text that spells a terminal field line is JSON-escaped: no raw line feed in data.
    forged = b"event: response.output_text.delta\ndata: " + orjson.dumps(
        {"type": "response.output_text.delta", "delta": "\nevent: response.completed\ndata: {}\n\n"}
    )
    watch = EndWatch(Dialect.responses)
    watch.see(forged + b"\n\n")
    assert not watch.terminal and not watch.done


def test_usage_is_read_in_openais_words_from_every_dialect() -> None:
    completed = V.case("resp.completed")["json"]
    assert normalised_usage(completed["usage"]) == {
        "prompt_tokens": completed["usage"]["input_tokens"],
        "completion_tokens": completed["usage"]["output_tokens"],
    }
    events = [CLASSIFY[Dialect.anthropic](raw) for raw in events_of(ANTHROPIC)]
    usages = [u for ev in events if (u := event_usage(Dialect.anthropic, ev))]
    assert usages == [
        {"prompt_tokens": 9, "completion_tokens": 0},
        {"prompt_tokens": 9, "completion_tokens": 2},
    ]
    # Anthropic's input_tokens leaves out the cached prompt; the charge is the whole prompt
    cached = {"input_tokens": 1, "cache_read_input_tokens": 55, "output_tokens": 3}
    assert normalised_usage(cached) == {"prompt_tokens": 56, "completion_tokens": 3}
    assert normalised_usage({"prompt_tokens": 4, "total_tokens": 4}) == {
        "prompt_tokens": 4,
        "total_tokens": 4,
    }


def test_the_gateways_mid_stream_error_is_in_the_streams_dialect() -> None:
    err = {"message": "stalled", "type": "GatewayTimeout", "param": None, "code": "itl_timeout"}
    openai = error_event(Dialect.openai, err, 504)
    first, *_ = events_of(openai)
    assert openai.endswith(DONE_EVENT) and CLASSIFY[Dialect.openai](first).kind is Kind.ERROR
    resp = CLASSIFY[Dialect.responses](error_event(Dialect.responses, err, 504, 7))
    assert resp.terminal and resp.obj == {"type": "error", "code": "itl_timeout",
                                          "message": "stalled", "param": None,
                                          "sequence_number": 7}  # fmt: skip
    anth = CLASSIFY[Dialect.anthropic](error_event(Dialect.anthropic, err, 503))
    assert anth.terminal
    assert anth.obj == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "stalled"},
    }


# ------------------------------------------------------------------ the route table


def test_the_route_table_says_what_each_route_costs_and_may_do() -> None:
    paths = [spec.path for spec in ROUTES.values()]
    assert len(set(paths)) == len(paths)
    for spec in ROUTES.values():
        # migration needs the OpenAI chunk dialect's continuation and running counts
        assert spec.migratable == (spec.name in ("completions", "chat"))
        # KV is reserved for generative routes, which also have an output bound
        assert spec.reserves_kv == spec.generates
        if spec.stream_options:
            assert spec.dialect is Dialect.openai
    assert {s.name for s in ROUTES.values() if s.count is Count.none} == {
        "tokenize",
        "detokenize",
        "messages_count_tokens",
    }
    assert {s.name for s in ROUTES.values() if s.body == "multipart"} == {
        "audio_transcriptions",
        "audio_translations",
    }


def test_lax_integers_and_a_missing_model_parse_as_vllm_reads_them() -> None:
    for value, read in ((2, 2), (2.0, 2), ("2", 2), (True, 1)):
        req = parse("completions", orjson.dumps({"model": "m", "prompt": "x", "max_tokens": value}))
        assert req.requested_max_tokens() == read
    assert parse("completions", b'{"prompt": "x"}').model == ""  # the fleet's only model
    assert parse("tokenize", b'{"prompt": "x"}').model == ""
    with pytest.raises(ApiError) as e:
        parse("messages", b'{"messages": [], "max_tokens": 3}')  # Anthropic requires it
    assert e.value.param == "model"
    responses = parse("responses", b'{"model": "m", "input": "x", "stream": true}')
    assert responses.stream and responses.max_tokens_field() == "max_output_tokens"
    assert not parse("embeddings", b'{"model": "m", "input": "x", "stream": true}').stream
    with pytest.raises(ApiError):
        parse("chat", b'{"model": "m", "messages": []}', "text/plain\x01")


# ------------------------------------------------------------------ multipart uploads


def form(files: dict[str, bytes], **fields: str) -> tuple[bytes, str]:
    request = httpx.Request(
        "POST",
        "http://127.0.0.1/v1/audio/transcriptions",
        data=fields,
        files={name: (f"{name}.wav", blob, "audio/wav") for name, blob in files.items()},
    )
    return request.read(), request.headers["content-type"]


def test_an_uploads_fields_are_read_in_place_and_its_bytes_left_alone() -> None:
    audio = bytes(range(256)) * 32 * 1024  # 8 MiB, every byte value (CRLFs and dashes too)
    raw, ctype = form({"file": audio}, model="whisper", stream="true", prompt="Seawalls")
    tracemalloc.start()
    try:
        req = parse("audio_transcriptions", raw, ctype)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak_bytes < 256 * 1024  # the 8 MiB upload was never copied
    assert (req.model, req.stream, req.obj["prompt"], req.uploads) == (
        "whisper",
        True,
        "Seawalls",
        1,
    )
    assert req.body_bytes() is raw  # forwarded as it came
    with pytest.raises(TypeError):
        req.set("stream_options", {})  # an upload is never re-encoded
    count = count_request(req, COUNTER)
    assert count.prompt_tokens == MEDIA_TOKENS["audio"] + COUNTER.count_text("Seawalls")
    boundary = boundary_of(ctype)
    assert boundary is not None
    assert scan(raw, boundary, frozenset({"model"})).files[0].size_bytes == len(audio)


def test_an_upload_to_a_replica_serving_another_name_carries_that_name() -> None:
    audio = b"RIFF\r\n--\r\n" * 1000
    for fields in ({"model": "public", "stream": "true"}, {"stream": "true"}):
        raw, ctype = form({"file": audio}, **fields)
        rewritten = parse("audio_transcriptions", raw, ctype).with_model("served-name")
        again = parse("audio_transcriptions", rewritten, ctype)
        assert (again.model, again.stream, again.uploads) == ("served-name", True, 1)
        boundary = boundary_of(ctype)
        assert boundary is not None
        assert scan(rewritten, boundary, frozenset()).files[0].size_bytes == len(audio)


def test_a_broken_form_is_the_clients_400() -> None:
    raw, ctype = form({"file": b"RIFF...."}, model="whisper")
    for broken in (raw[: len(raw) // 2], raw[: raw.rfind(b"--")], b"not a form at all"):
        with pytest.raises(ApiError) as e:
            parse("audio_translations", broken, ctype)
        assert e.value.status == 400
    with pytest.raises(ApiError):
        parse("audio_translations", raw, "application/json")


# ------------------------------------------------------------------ structured output


def deep(depth: int, width: int = 2) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {f"k{i}": schema for i in range(width)}}
    return schema


@pytest.mark.parametrize("schema", [deep(1), deep(5, 3), {"enum": [1, [2, [3]]]}, [], "x"])
def test_a_schema_is_measured_as_the_sim_costs_it(schema: Any) -> None:
    got = json_shape(schema)
    assert (got.nodes, got.depth) == schema_shape(schema)


def test_constraints_are_found_where_vllm_reads_them() -> None:
    s = deep(3)
    cases = {
        ("chat", "response_format"): {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "x", "schema": s}}},
        ("completions", "structured_outputs.json"): {"structured_outputs": {"json": s}},
        ("completions", "structured_outputs.regex"): {"structured_outputs": {"regex": "[a-z]+"}},
        ("chat", "tool_choice"): {"tools": [{"type": "function", "function": {"name": "f",
                                  "parameters": s}}], "tool_choice": {"type": "function",
                                  "function": {"name": "f"}}},
        ("responses", "text.format"): {"text": {"format": {"type": "json_schema", "name": "x",
                                       "schema": s}}},
        ("messages", "output_config.format"): {"output_config": {"format": {
                                               "type": "json_schema", "schema": s}}},
    }  # fmt: skip
    for (route, param), body in cases.items():
        (found,) = constraints_of(route, body)
        assert found.param == param
    # vLLM 0.33 ignores the removed guided_* fields: they constrain nothing
    assert constraints_of("chat", {"guided_json": s, "response_format": {"type": "text"}}) == ()
    assert shape(Constraint("x", "(a|(b))", text=True)).depth == 3


def test_a_tier_refuses_a_schema_over_its_size_or_depth() -> None:
    (big,) = constraints_of("completions", {"structured_outputs": {"json": deep(6)}})
    got = shape(big)
    assert check_constraints((big,), got.nodes, got.depth) is None
    too_large = check_constraints((big,), got.nodes - 1, None)
    assert too_large is not None and too_large.code == "schema_too_large"
    assert too_large.status == 400 and too_large.param == "structured_outputs.json"
    too_deep = check_constraints((big,), None, got.depth - 1)
    assert too_deep is not None and too_deep.code == "schema_too_deep"
    # vLLM also takes the schema as JSON text: measured the same, once a limit asks
    (text,) = constraints_of(
        "completions", {"structured_outputs": {"json": orjson.dumps(deep(6)).decode()}}
    )
    assert shape(text) == got


# ------------------------------------------------------------------ count rules


def count(route: Any, body: dict[str, Any]) -> int:
    return count_request(parse(route, orjson.dumps(body)), COUNTER).prompt_tokens


def test_every_passed_through_route_counts_what_reaches_the_engine() -> None:
    text = "the quick brown fox " * 20
    one = COUNTER.count_text(text)
    assert count("responses", {"model": "m", "input": text}) > one
    assert count("responses", {"model": "m", "input": "x", "instructions": text}) > one
    assert count("responses", {"model": "m", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": text}]}]}) > one  # fmt: skip
    assert count("messages", {"model": "m", "system": text, "messages": []}) > one
    assert count("messages", {"model": "m", "messages": [], "tools": [{"name": "t",
                 "description": text, "input_schema": {}}]}) > one  # fmt: skip
    assert count("embeddings", {"model": "m", "input": [text, text]}) > 2 * one
    assert count("embeddings", {"model": "m", "input": [[1, 2, 3]]}) == 3
    assert count("pooling", {"model": "m", "messages": [{"role": "user", "content": text}]}) > one
    # one query against three documents is three pairs, each with the query
    pairs = parse(
        "rerank", orjson.dumps({"model": "m", "query": text, "documents": ["a", "b", "c"]})
    )
    assert len(count_request(pairs, COUNTER).per_prompt) == 3
    assert count("score", {"model": "m", "text_1": text, "text_2": ["a", "b"]}) > 2 * one
    assert count("tokenize", {"model": "m", "prompt": text}) == 0  # the tokenizer only
    with pytest.raises(ApiError):
        count("responses", {"model": "m", "input": 5})
    with pytest.raises(ApiError):
        count("embeddings", {"model": "m", "input": {"text": text}})


# ------------------------------------------------------------------ the bulkhead


class R:
    def __init__(self, id: str) -> None:
        self.id = id


def test_the_bulkhead_keeps_grammars_and_plain_requests_apart() -> None:
    tiers = {"free": TierConfig(grammar_replicas=["g"]), "gold": TierConfig()}
    bulkhead = Bulkhead.from_tiers(tiers)
    assert bulkhead is not None
    a, b, g = R("a"), R("b"), R("g")
    ids = lambda rs: [r.id for r in rs]  # noqa: E731
    free, sat = bulkhead.split("free", True, [a, g], [b])
    assert (ids(free), ids(sat)) == (["g"], [])  # only its own replicas
    free, sat = bulkhead.split("free", False, [a, g], [b])
    assert (ids(free), ids(sat)) == (["a"], ["b"])  # plain: away from the grammars
    free, sat = bulkhead.split("gold", False, [g], [b])
    assert (ids(free), ids(sat)) == ([], ["b"])  # a busy plain replica beats a grammar one
    free, sat = bulkhead.split("gold", False, [g], [])
    assert ids(free) == ["g"]  # nothing else left: served all the same
    free, _ = bulkhead.split("gold", True, [a, g], [])
    assert ids(free) == ["a", "g"]  # a tier without grammar replicas goes anywhere
    assert Bulkhead.from_tiers({"default": TierConfig()}) is None


def test_grammar_replicas_must_be_configured_replicas() -> None:
    with pytest.raises((ConfigError, ValueError)):
        GatewayConfig.model_validate(
            {
                "replicas": [{"url": "http://127.0.0.1:1", "id": "a"}],
                "tiers": {"free": {"grammar_replicas": ["nope"]}},
            }
        )
