"""The gateway passes through what vLLM serves, and answers as vLLM would (issue 13).

Every case vLLM 0.33.0's own server answered (`tests/data/vllm/captured.json`) is sent
through a real `seawall serve` in front of a real `seawall sim` (which answers as vLLM
does, `test_sim_vllm_fidelity.py`), and the gateway's answer is checked strictly against
vLLM's (`tests/support/vllm_schema.py`: status, error bodies byte for byte, bodies and
chunks against vLLM's schemas and keys, stream order). Where the gateway answers first
(it must read a field to route, count or limit, or it owns the route), the case is listed
in `GATEWAY_FIRST` with the reason, its answer is an OpenAI-shaped error with vLLM's
status, and the list is kept honest: a listed case whose answer became vLLM's fails.
"""

from __future__ import annotations

import email.message
import email.parser
import email.policy
import json
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from aiohttp import web

from seawall.auth import hash_key, new_key
from seawall.protocol.routes import ROUTES
from seawall.sim.openai import VOCAB_SIZE
from tests.support import vllm_schema as V
from tests.support.chop import ChoppingRelay
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    set_fault,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.llamacpp import MODEL as LLAMA_MODEL
from tests.support.llamacpp import (
    LlamaServer,
    make_model,
    require_llama_server,
    start_llama_server,
)
from tests.support.procs import Proc
from tests.support.served import ServedDouble

pytestmark = pytest.mark.integration

# Facts of the model, not of the server: the vocabulary `logprobs: -1` asks for.
SUBSTITUTE = {"err.chat.top_logprobs_negative": {"512": str(VOCAB_SIZE)}}

# Cases the gateway answers itself, with why; each is vLLM's status, OpenAI-shaped.
GATEWAY_FIRST: dict[str, str] = {
    # The body must be a JSON object the gateway can read (model, stream, limits).
    "err.invalid_json": "the body is parsed to route and limit it",
    "err.body_list": "the body is parsed to route and limit it",
    # Fields the gateway relies on: a value it cannot read could slip past a limit.
    "err.max_tokens_fraction": "max_tokens bounds the KV reservation and the tier's ceiling",
    "err.max_tokens_string": "max_tokens bounds the KV reservation and the tier's ceiling",
    "err.max_tokens_negative": "max_tokens bounds the KV reservation (llama.cpp reads -1 "
    "as unlimited)",
    "err.chat.max_tokens_string": "max_tokens bounds the KV reservation",
    "err.resp.max_output_tokens_string": "max_output_tokens bounds the KV reservation",
    "err.n_zero": "n multiplies the sequences reserved",
    "err.n_string": "n multiplies the sequences reserved",
    "err.chat.n_zero": "n multiplies the sequences reserved",
    "err.no_prompt": "the prompt is counted for limits and reservations",
    "err.prompt_int": "the prompt is counted: a shape it cannot count is refused",
    "err.prompt_negative_id": "the prompt is counted: a shape it cannot count is refused",
    "err.chat.no_messages": "the messages are counted for limits and reservations",
    "err.chat.messages_string": "the messages are counted for limits and reservations",
    # The fleet's models are the gateway's to know (and its 404 names them).
    "err.unknown_model": "the gateway routes by model",
    "err.chat.unknown_model": "the gateway routes by model",
    "err.resp.unknown_model": "the gateway routes by model",
    "err.tok.unknown_model": "the gateway routes by model",
    "err.detok.unknown_model": "the gateway routes by model",
    # Routes the gateway owns: its 404/405 are OpenAI-shaped, vLLM's are Starlette's.
    "err.unknown_route": "unknown routes: the gateway's OpenAI-shaped 404",
    "err.unknown_route_get": "unknown routes: the gateway's OpenAI-shaped 404",
    "err.method_not_allowed": "wrong method: the gateway's OpenAI-shaped 405",
    "err.method_not_allowed_chat": "wrong method: the gateway's OpenAI-shaped 405",
    "err.tok.method_not_allowed": "wrong method: the gateway's OpenAI-shaped 405",
}
# The gateway answers 200 where vLLM refuses: a JSON body without a Content-Type is sent
# on as application/json (the gateway has read it as JSON).
GATEWAY_SERVES = {"err.content_type_missing"}
# Answered by the gateway with vLLM's shape but its own values.
GATEWAY_OWN = {"misc.version"}  # the gateway's version, as vLLM's {"version": ...}
# The engine's error about a body the gateway edited: the tier's default output bound
# (`max_output_tokens`) was added, so pydantic's summary counts one more key.
EDITED = {"err.resp.no_input": {"<dict of 2 items>": "<dict of 3 items>"}}
# Request-level engine errors need the sim's `errors` fault (a fleet of their own, below);
# a failure before the first token is retried on another replica (no vLLM case to match).
ENGINE_ERROR_CASES = ("cmpl.generation_error", "cmpl.generation_error_stream",
                      "chat.generation_error_stream")  # fmt: skip
ENGINE_FAULT = {*ENGINE_ERROR_CASES, "cmpl.generation_error_first_stream"}


def assert_openai_error(body: Any) -> None:
    """`{"error": {"message", "type", "param", "code"}}`, as vLLM's `ErrorResponse` but
    for `code`: vLLM's is the status, the gateway's own errors say which refusal it was
    (`model_not_found`, `rate_limit_exceeded`, ...), as OpenAI's API does."""
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str) and isinstance(error["type"], str)
    assert error["param"] is None or isinstance(error["param"], str)
    assert isinstance(error["code"], int | str)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, Proc]]:
    logs = tmp_path_factory.mktemp("passthrough")
    sim = start_sim(logs, "--step-base-ms", "1", "--max-model-len", "4096")
    gw = start_gateway(logs, [sim])
    with running(gw, sim):
        yield sim, gw


@pytest.mark.parametrize("name", sorted(set(V.captured()) - ENGINE_FAULT))
def test_every_case_vllm_answered_passes_through_as_vllm_answered(
    fleet: tuple[Proc, Proc], name: str
) -> None:
    _, gw = fleet
    got = V.replay(gw.url, name)
    want = V.case(name)
    if name in GATEWAY_FIRST:
        assert got["status"] == want["status"], (name, got)
        assert_openai_error(got["json"])
        assert got["json"] != want["json"], f"{name} is now vLLM's answer: unlist it"
    elif name in GATEWAY_SERVES:
        assert want["status"] == 400 and got["status"] == 200, (name, got)
        V.validate(got["json"], "CompletionResponse")
    elif name in GATEWAY_OWN:
        assert got["status"] == want["status"]
        V.same_keys(got["json"], want["json"], name)
    else:
        V.assert_like_vllm(name, got, SUBSTITUTE.get(name) or EDITED.get(name))


@pytest.fixture(scope="module")
def failing_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    logs = tmp_path_factory.mktemp("passthrough-errors")
    fault = '{"kind": "errors", "rate": 1.0, "when": "mid_stream", "after_tokens": 2}'
    sim = start_sim(logs, "--step-base-ms", "1", "--fault", fault)
    gw = start_gateway(logs, [sim])
    with running(gw, sim):
        yield gw


@pytest.mark.parametrize("name", ENGINE_ERROR_CASES)
def test_engine_errors_pass_through_as_vllm_sent_them(failing_fleet: Proc, name: str) -> None:
    got = V.replay(failing_fleet.url, name)
    V.assert_like_vllm(name, got)
    if "sse" in got:
        # the outputs before the failure, vLLM's own error event, then [DONE]
        assert got["sse"][-2] == V.case(name)["sse"][-2]
        assert len(got["sse"]) == len(V.case(name)["sse"])


def test_a_bodys_request_id_names_the_response_as_vllm_names_it(fleet: tuple[Proc, Proc]) -> None:
    _, gw = fleet
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1, "request_id": "abc"}
    r = httpx.post(gw.url + "/v1/completions", json=body, timeout=30)
    assert r.json()["id"] == "cmpl-abc" and r.headers["X-Request-Id"] == "abc"
    # the header still wins, as in vLLM
    r = httpx.post(gw.url + "/v1/completions", json=body, headers={"X-Request-Id": "hdr"},
                   timeout=30)  # fmt: skip
    assert r.json()["id"] == "cmpl-hdr"
    # with neither, the gateway's own id, in vLLM's shape (16 hex), named in the header
    r = httpx.post(gw.url + "/v1/completions", json={"model": MODEL, "prompt": "Hi",
                   "max_tokens": 1}, timeout=30)  # fmt: skip
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", r.json()["id"])
    assert r.json()["id"] == "cmpl-" + r.headers["X-Request-Id"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    r = httpx.post(gw.url + "/v1/chat/completions", json=chat, timeout=30)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", r.json()["id"])


# ------------------------------------------------------------------ with a real client


def client(gw: Proc, api_key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gw.url}/v1", api_key=api_key, max_retries=0, timeout=30)


def test_the_openai_sdk_reads_responses_through_the_gateway(fleet: tuple[Proc, Proc]) -> None:
    _, gw = fleet
    c = client(gw)
    whole = c.responses.create(model=MODEL, input="Say something.", max_output_tokens=5)
    assert whole.status == "incomplete" and whole.output_text
    assert whole.usage is not None and whole.usage.output_tokens == 5
    events = list(c.responses.create(model=MODEL, input="Hi", max_output_tokens=8, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" in kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == events[-1].response.output_text
    # A generative model serves no embeddings: vLLM's own 404, relayed as it wrote it.
    with pytest.raises(openai.NotFoundError) as e:
        c.embeddings.create(model=MODEL, input="Hi")
    assert e.value.response.json() == {"detail": "Not Found"}
    m = scrape(gw.url)
    assert metric_sum(m, "seawall_requests_total", route="responses", status="200") >= 2
    assert metric_sum(m, "seawall_requests_total", route="embeddings", status="404") >= 1
    # the engine's "not here" is not the replica's fault
    assert metric_sum(m, "seawall_upstream_attempts_total", outcome="http_4xx") >= 1


def sse_events(body: bytes) -> list[Any]:
    return V.parse_sse(body.decode())


TERMINAL = ("response.completed", "response.incomplete")


# Adaptive admission (the default) reads the usage in these dialects' events, so their
# streams are relayed event by event; with `reserve` they are relayed raw (`EndWatch`).
RELAYS = {"events": {}, "raw": {"admission": {"mode": "reserve"}}}


@pytest.mark.parametrize("relay_kind", list(RELAYS))
def test_a_responses_stream_split_anywhere_on_the_wire_ends_cleanly(
    artifacts: Path, relay_kind: str
) -> None:
    sim = start_sim(artifacts, "--step-base-ms", "1")
    with running(sim), ChoppingRelay(sim.port or 0, piece=5) as relay:
        gw = start_gateway(artifacts, [relay.url], RELAYS[relay_kind])
        with running(gw):
            body = {"model": MODEL, "input": "Hi", "max_output_tokens": 40, "stream": True}
            for _ in range(3):
                got = httpx.post(gw.url + "/v1/responses", json=body, timeout=30)
                events = sse_events(got.content)
                assert events[-1]["event"] in TERMINAL, events[-3:]
                assert all(e["event"] != "error" for e in events)
            assert metric_sum(scrape(gw.url), "seawall_stream_errors_total") == 0


def fault_fleet(
    artifacts: Path, step_ms: int, config: dict[str, Any] | None = None
) -> tuple[Proc, Proc]:
    """A sim whose steps take `step_ms` (a stream lasts long enough to break or leave
    mid-way), behind a gateway."""
    sim = start_sim(artifacts, "--step-base-ms", str(step_ms))
    return sim, start_gateway(artifacts, [sim], {"fleet": FLEET_FAST, **(config or {})})


FLEET_FAST = {"liveness_interval_s": 0.25, "deep_probe_idle_interval_s": 30,
              "deep_probe_interval_s": 30}  # fmt: skip


def read_until(r: httpx.Response, marker: bytes, count: int) -> bytes:
    got = b""
    chunks = r.iter_raw()
    while got.count(marker) < count:
        got += next(chunks)
    return got + b"".join(chunks)


@pytest.mark.parametrize("relay_kind", list(RELAYS))
@pytest.mark.parametrize(
    ("fault", "code"), [({"kind": "crash"}, "upstream_reset"), ({"kind": "hang"}, "itl_timeout")]
)
def test_a_broken_responses_stream_ends_with_an_error_event_of_its_own_dialect(
    artifacts: Path, fault: dict[str, Any], code: str, relay_kind: str
) -> None:
    config = {"timeouts": {"itl_s": 1.0}, **RELAYS[relay_kind]}
    sim, gw = fault_fleet(artifacts, 100, config=config)
    with running(gw, sim):
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 400, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=30) as r:
            got = b""
            chunks = r.iter_raw()
            while got.count(b"response.output_text.delta\n") < 3:
                got += next(chunks)
            set_fault(sim, fault)
            got += b"".join(chunks)
        events = sse_events(got)
        last = events[-1]
        # Not done: the client is told, in the Responses API's own error event, numbered
        # after the engine's events, and nothing follows it (no [DONE] in this dialect).
        assert last["event"] == "error" and last["data"]["type"] == "error"
        assert last["data"]["code"] == code
        numbers = [e["data"]["sequence_number"] for e in events]
        assert numbers == list(range(len(events)))
        assert not got.endswith(b"data: [DONE]\n\n")
        m = scrape(gw.url)
        assert metric_sum(m, "seawall_stream_errors_total", reason=code) == 1


def test_a_responses_stream_is_held_until_its_first_token(artifacts: Path) -> None:
    sim, gw = fault_fleet(artifacts, 100, config={"timeouts": {"ttft_s": 1.0}})
    with running(gw, sim):
        set_fault(sim, {"kind": "hang"})  # the engine takes the request and never steps
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 8, "stream": True}
        r = httpx.post(gw.url + "/v1/responses", json=body, timeout=30)
        # No first token: nothing was committed, so the client gets a clean error
        # (not a 200 stream cut short), after the time-to-first-token timeout.
        assert r.status_code == 504 and r.json()["error"]["code"] == "ttft_timeout"
        assert metric_sum(scrape(gw.url), "seawall_timeouts_total", kind="ttft") >= 1


def test_cancelling_a_passed_through_stream_frees_the_engines_blocks(artifacts: Path) -> None:
    sim, gw = fault_fleet(artifacts, 100)
    with running(gw, sim):
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 1000, "stream": True}
        with httpx.stream("POST", gw.url + "/v1/responses", json=body, timeout=30) as r:
            assert r.status_code == 200
            chunks = r.iter_raw()  # kept: a dropped iterator closes the stream
            next(chunks)  # the head: the first output delta has arrived
            wait_until(
                lambda: metric_sum(scrape(sim.url), "vllm:num_requests_running") == 1,
                10,
                what="the engine running the stream",
            )
            assert metric_sum(scrape(sim.url), "vllm:kv_cache_usage_perc") > 0
        # the client went away
        wait_until(
            lambda: metric_sum(scrape(sim.url), "vllm:num_requests_running") == 0,
            5,
            what="the engine aborting the stream",
        )
        assert metric_sum(scrape(sim.url), "vllm:kv_cache_usage_perc") == 0
        assert metric_sum(scrape(gw.url), "seawall_client_cancellations_total") == 1


# ------------------------------------------------------------------ auth, limits, rates, retries


def test_passed_through_routes_get_auth_limits_and_rates(artifacts: Path) -> None:
    key = new_key()
    sim = start_sim(artifacts, "--step-base-ms", "1")
    gw = start_gateway(artifacts, [sim], {
        "tenants": {"acme": {"api_key_hashes": [hash_key(key)], "tier": "small"}},
        "tiers": {"small": {"max_prompt_tokens": 40, "requests_per_min": 7,
                            "prompt_tokens_per_min": 100000}},
    })  # fmt: skip
    with running(gw, sim):
        auth = {"Authorization": f"Bearer {key}"}
        long_text = "the quick brown fox jumps " * 40
        # No key: refused before the body is read, on every route.
        for spec in ROUTES.values():
            r = httpx.post(gw.url + spec.path, content=b"{}", timeout=10)
            assert r.status_code == 401, (spec.path, r.text)
            assert_openai_error(r.json())
        # The tier's prompt limit, counted by each route's own rule, names its field.
        for path, body, param in (
            ("/v1/responses", {"model": MODEL, "input": long_text}, "input"),
            ("/v1/responses", {"model": MODEL, "input": "x", "instructions": long_text}, "input"),
            ("/v1/messages", {"model": MODEL, "max_tokens": 4,
                              "messages": [{"role": "user", "content": long_text}]}, "messages"),
            ("/v1/embeddings", {"model": MODEL, "input": [long_text]}, "input"),
            ("/rerank", {"model": MODEL, "query": long_text, "documents": ["a"]}, "documents"),
        ):  # fmt: skip
            r = httpx.post(gw.url + path, json=body, headers=auth, timeout=10)
            assert r.status_code == 400, (path, r.text)
            assert r.json()["error"]["code"] == "prompt_too_long"
            assert r.json()["error"]["param"] == param
        # The tokenizer counts no prompt tokens (a client checking whether its prompt fits).
        r = httpx.post(gw.url + "/tokenize", json={"prompt": long_text}, headers=auth, timeout=10)
        assert r.status_code == 200 and r.json()["count"] > 40
        # A Responses stream with token-rate reconciliation (its usage read from the
        # terminal event) still passes through as vLLM sent it.
        got = V.replay(gw.url, "resp.stream", headers=auth)
        V.assert_like_vllm("resp.stream", got)
        # The request rate counts every route: 7 a minute, the refusals above included.
        r = httpx.post(gw.url + "/detokenize", json={"tokens": [72, 105]}, headers=auth, timeout=10)
        assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["Retry-After"]) >= 1


def test_a_passed_through_stream_is_retried_before_its_first_token(artifacts: Path) -> None:
    bad = start_sim(artifacts, "--step-base-ms", "1", name="bad")
    good = start_sim(artifacts, "--step-base-ms", "1", name="good")
    set_fault(bad, {"kind": "errors", "rate": 1.0, "when": "before_first_token"})
    gw = start_gateway(artifacts, [bad, good], {"fleet": FLEET_FAST})
    with running(gw, bad, good):
        body = {"model": MODEL, "input": "Hi", "max_output_tokens": 8}
        for stream in (True, False):
            for _ in range(6):
                r = httpx.post(gw.url + "/v1/responses", json={**body, "stream": stream},
                               timeout=30)  # fmt: skip
                assert r.status_code == 200, r.text
                if stream:
                    assert sse_events(r.content)[-1]["event"] == "response.incomplete"
        assert metric_sum(scrape(gw.url), "seawall_retries_total") >= 1


# ------------------------------------------------------------------ n > 1


def test_n_choices_stream_every_role_chunk_first_and_never_migrate(artifacts: Path) -> None:
    sims = [start_sim(artifacts, "--step-base-ms", "20", name=f"s{i}") for i in range(2)]
    gw = start_gateway(
        artifacts, sims, {"tiers": {"default": {"migrate": True}}, "fleet": FLEET_FAST}
    )
    with running(gw, *sims):
        for name in ("chat.n2_stream", "cmpl.n2_stream", "chat.n2", "cmpl.n2"):
            V.assert_like_vllm(name, V.replay(gw.url, name))  # all role chunks first
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story."}],
                "max_tokens": 300, "n": 2, "stream": True, "ignore_eos": True}  # fmt: skip
        with httpx.stream("POST", gw.url + "/v1/chat/completions", json=body, timeout=30) as r:
            got = b""
            chunks = r.iter_raw()
            while got.count(b"data: ") < 12:
                got += next(chunks)
            (victim,) = [s for s in sims if metric_sum(scrape(s.url), "vllm:num_requests_running")]
            set_fault(victim, {"kind": "crash"})
            got += b"".join(chunks)
        # Two interleaved choices cannot be continued as one text: the stream ends with
        # the gateway's error, and no continuation was tried.
        events = sse_events(got)
        assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "upstream_reset"
        m = scrape(gw.url)
        assert metric_sum(m, "seawall_migrations_total") == 0
        assert metric_sum(m, "seawall_stream_errors_total", reason="upstream_reset") == 1


# ------------------------------------------------------------------ a real llama.cpp server

# llama.cpp's server serves Anthropic's Messages API, the Responses API, embeddings and
# reranking for real (a tiny random-weight model: gibberish text, real tokens and slots).


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, LlamaServer]]:
    require_llama_server()
    logs = tmp_path_factory.mktemp("passthrough-llama")
    model = make_model(logs / "tiny.gguf")
    servers = [
        start_llama_server(logs, model, name="gen", slots=2, ctx_per_slot=2048),
        start_llama_server(logs, model, "--embeddings", "--pooling", "mean", "--alias",
                           "tiny-embed", name="embed", slots=1, ctx_per_slot=512),
        start_llama_server(logs, model, "--reranking", "--alias", "tiny-rerank",
                           name="rerank", slots=1, ctx_per_slot=512),
    ]  # fmt: skip
    models = (LLAMA_MODEL, "tiny-embed", "tiny-rerank")
    gw = start_gateway(logs, [], {
        "fleet": FLEET_FAST,
        "replicas": [{"url": s.url, "id": f"l{i}", "model": m, "engine": "llamacpp"}
                     for i, (s, m) in enumerate(zip(servers, models, strict=True))],
    })  # fmt: skip
    try:
        yield gw, servers[0]
    finally:
        gw.stop()
        for s in servers:
            s.stop()


def test_a_messages_stream_gets_the_first_token_hold_and_the_idle_timeout(
    artifacts: Path,
) -> None:
    """/v1/messages streams as chat does: an engine that never starts is a clean 504
    before any byte of the stream (the client can retry), and one that stops mid-stream
    ends it with an Anthropic `error` event after the inter-token timeout."""
    require_llama_server()
    model = make_model(artifacts / "tiny.gguf")
    server = start_llama_server(artifacts, model, name="msgs", slots=1, ctx_per_slot=2048)
    gw = start_gateway(artifacts, [], {
        "fleet": {**FLEET_FAST, "liveness_timeout_s": 30, "liveness_interval_s": 30},
        "timeouts": {"ttft_s": 2, "itl_s": 2},
        "replicas": [{"url": server.url, "id": "l0", "model": LLAMA_MODEL, "engine": "llamacpp"}],
    })  # fmt: skip
    body = {"model": LLAMA_MODEL, "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    try:
        server.signal(signal.SIGSTOP)  # takes the connection, never answers
        try:
            r = httpx.post(gw.url + "/v1/messages", json=body, timeout=30)
        finally:
            server.signal(signal.SIGCONT)
        assert r.status_code == 504 and r.json()["error"]["code"] == "ttft_timeout"
        with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=30) as s:
            assert s.status_code == 200
            events = s.iter_raw()
            seen = next(events)  # the stream has begun
            server.signal(signal.SIGSTOP)
            for chunk in events:
                seen += chunk
        server.signal(signal.SIGCONT)
        last = seen.rstrip().split(b"\n\n")[-1]
        assert last.startswith(b"event: error"), seen[-400:]
        assert b"inter-token timeout" in last
    finally:
        gw.stop()
        server.signal(signal.SIGCONT)
        server.stop()


def test_anthropic_messages_stream_through_the_gateway(llama: tuple[Proc, LlamaServer]) -> None:
    gw, server = llama
    body = {"model": LLAMA_MODEL, "max_tokens": 6,
            "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    whole = httpx.post(gw.url + "/v1/messages", json=body, timeout=30)
    assert whole.status_code == 200 and whole.json()["type"] == "message"
    assert whole.json()["usage"]["output_tokens"] == 6
    # llama-server's own stream is not always whole: with this random-weight model its
    # `message_start` and the text events of tokens that are not yet valid UTF-8 are
    # sometimes missing (at temperature 0, always: only message_delta and message_stop).
    # So the gateway's stream is held to llama-server's own, event for event, at
    # temperature 0, and to what the gateway itself needs (the end event) at 1.
    greedy = {**body, "stream": True, "temperature": 0}
    direct = httpx.post(server.url + "/v1/messages", json=greedy, timeout=30)
    relayed = httpx.post(gw.url + "/v1/messages", json=greedy, timeout=30)
    assert relayed.status_code == 200
    assert sse_events(relayed.content) == sse_events(direct.content)
    r = httpx.post(gw.url + "/v1/messages", json={**body, "stream": True}, timeout=30)
    events = sse_events(r.content)
    kinds = [e["event"] for e in events]
    assert kinds[-1] == "message_stop" and "error" not in kinds
    assert all(e["data"]["type"] == e["event"] for e in events)
    counted = httpx.post(gw.url + "/v1/messages/count_tokens", json=body, timeout=30)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0
    assert metric_sum(scrape(gw.url), "seawall_stream_errors_total") == 0


def test_responses_embeddings_and_rerank_from_a_real_engine(
    llama: tuple[Proc, LlamaServer],
) -> None:
    gw, _ = llama
    c = client(gw)
    events = list(c.responses.create(model=LLAMA_MODEL, input="Hi", max_output_tokens=5,
                                     stream=True))  # fmt: skip
    assert events[-1].type == "response.completed"
    assert events[-1].response.usage is not None
    emb = c.embeddings.create(model="tiny-embed", input=["sea", "wall"])
    assert len(emb.data) == 2 and len(emb.data[0].embedding) > 8
    assert emb.usage.prompt_tokens > 0
    rr = httpx.post(gw.url + "/v1/rerank", json={"model": "tiny-rerank", "query": "sea",
                    "documents": ["wall", "sand", "tide"]}, timeout=30)  # fmt: skip
    assert rr.status_code == 200 and len(rr.json()["results"]) == 3
    # The engine's "not here" (no audio model) is relayed, and is not the replica's fault.
    audio = httpx.post(gw.url + "/v1/audio/transcriptions", data={"model": LLAMA_MODEL},
                       files={"file": ("a.wav", b"RIFF\x00\x00\x00\x00WAVE", "audio/wav")},
                       timeout=30)  # fmt: skip
    assert audio.status_code == 501 and "audio" in audio.json()["error"]["message"]
    m = scrape(gw.url)
    assert metric_sum(m, "seawall_upstream_attempts_total", outcome="http_5xx") == 0


def test_cancelling_a_messages_stream_frees_the_engines_slot(
    llama: tuple[Proc, LlamaServer],
) -> None:
    gw, server = llama
    body = {"model": LLAMA_MODEL, "max_tokens": 1500, "stream": True,
            "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
    with httpx.stream("POST", gw.url + "/v1/messages", json=body, timeout=30) as r:
        assert r.status_code == 200
        chunks = r.iter_raw()  # kept: a dropped iterator closes the stream
        next(chunks)  # the head: the first content_block_delta has arrived
        wait_until(lambda: server.busy_slots() == 1, 10, what="the slot busy")
    wait_until(lambda: server.busy_slots() == 0, 10, what="the slot freed after the client left")


# ------------------------------------------------------------------ audio uploads


class RecordingAudioEngine(ServedDouble):
    """A test double, because no engine that transcribes audio can run here (vLLM needs a
    GPU and Whisper's weights; llama.cpp's tiny model has no audio encoder, see above).
    It records each upload exactly as it arrived and answers as vLLM's transcription
    serving does: a JSON body, or OpenAI chunks with `delta.content` and `data: [DONE]`."""

    name = "audio-engine"

    def __init__(self) -> None:
        super().__init__()
        self.uploads: list[tuple[str, bytes]] = []

    async def _upload(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        ctype = request.headers["Content-Type"]
        self.uploads.append((ctype, raw))
        message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(
            b"Content-Type: " + ctype.encode() + b"\r\n\r\n" + raw
        )
        assert isinstance(message, email.message.EmailMessage)
        form = {
            part.get_param("name", header="content-disposition"): part.get_payload(decode=True)
            for part in message.iter_parts()
        }
        words = ["sea", " wall", " at", " dawn"]
        if form.get("stream") != b"true":
            return web.json_response({"text": "".join(words)})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, word in enumerate(words):
            chunk = {"id": "trsc-1", "object": "transcription.chunk", "created": 1,
                     "model": form["model"].decode(), "choices": [{"delta": {"content": word},
                     "finish_reason": "stop" if i == len(words) - 1 else None}]}  # fmt: skip
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    def app(self) -> web.Application:
        async def health(request: web.Request) -> web.Response:
            return web.Response()

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": "whisper-test"}]})

        app = web.Application(client_max_size=64 << 20)
        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
            app.router.add_post(path, self._upload)
        return app


def test_an_upload_is_routed_by_its_form_and_forwarded_byte_for_byte(artifacts: Path) -> None:
    key = new_key()
    audio = bytes(range(256)) * 4096  # 1 MiB, every byte value
    with RecordingAudioEngine() as engine:
        gw = start_gateway(artifacts, [], {
            "fleet": FLEET_FAST,
            "replicas": [{"url": engine.url, "id": "w0", "model": "whisper-test",
                          "engine": "openai"}],
            "tenants": {"acme": {"api_key_hashes": [hash_key(key)], "tier": "t"}},
            "tiers": {"t": {"max_prompt_tokens": 2000}},
        })  # fmt: skip
        with running(gw):
            auth = {"Authorization": f"Bearer {key}"}
            for path, stream in (("/v1/audio/transcriptions", False),
                                 ("/v1/audio/translations", True)):  # fmt: skip
                request = httpx.Request(
                    "POST",
                    gw.url + path,
                    headers=auth,
                    data={"model": "whisper-test", "stream": str(stream).lower()},
                    files={"file": ("a.wav", audio, "audio/wav")},
                )
                sent = request.read()
                r = httpx.Client(timeout=30).send(request)
                assert r.status_code == 200, r.text
                ctype, received = engine.uploads[-1]
                assert received == sent  # the upload, byte for byte
                assert ctype == request.headers["Content-Type"]  # with its boundary
                if stream:
                    events = sse_events(r.content)
                    assert events[-1] == "[DONE]"
                    assert "".join(e["choices"][0]["delta"]["content"] for e in events[:-1]) == (
                        "sea wall at dawn"
                    )
                else:
                    assert r.json() == {"text": "sea wall at dawn"}
            # One file is charged a fixed 1,500 tokens: two files pass 2,000 only as one.
            two = httpx.post(gw.url + "/v1/audio/transcriptions", headers=auth,
                             data={"model": "whisper-test"},
                             files=[("file", ("a.wav", audio, "audio/wav")),
                                    ("file", ("b.wav", audio, "audio/wav"))],
                             timeout=30)  # fmt: skip
            assert two.status_code == 400 and two.json()["error"]["code"] == "prompt_too_long"
            assert len(engine.uploads) == 2
