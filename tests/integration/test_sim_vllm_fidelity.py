"""`seawall sim` answers as vLLM 0.33.0 does, checked against vLLM's own answers.

Every case of tools/vllm/capture.py is replayed against a real `seawall sim` on loopback
and compared with what vLLM's real HTTP server answered (tests/data/vllm/captured.json):
status, error bodies byte for byte, success bodies and stream chunks strictly against
vLLM's schemas and keys (tests/support/vllm_schema.py). The semantic tests below check
what keys cannot: the values and their order (continuous usage, echo, stop tokens, ids,
the fingerprint, defaults), which vLLM's code in the capture showed.
"""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from seawall.sim.openai import VOCAB_SIZE
from tests.support import vllm_schema as V
from tests.support.procs import ARTIFACTS, Proc, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration

MAX_MODEL_LEN = 4096  # the capture's --max-model-len


def start_sim(name: str, *flags: str) -> Proc:
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--port", str(port), *flags),
        ARTIFACTS / name / "sim.log",
        port=port,
    )
    wait_http(proc.url + "/health", proc=proc)
    return proc


@pytest.fixture(scope="module")
def sim() -> Iterator[Proc]:
    # vLLM's defaults where the capture used them: max_model_len 4096, model sim-model
    proc = start_sim(
        "test_sim_vllm_fidelity", "--step-base-ms", "1", "--max-model-len", str(MAX_MODEL_LEN)
    )
    try:
        yield proc
    finally:
        proc.stop()


def post(
    sim: Proc, path: str, body: Any, headers: dict[str, str] | None = None
) -> tuple[int, Any, dict[str, str]]:
    req = urllib.request.Request(
        sim.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            raw, status, hdrs = r.read().decode(), r.status, dict(r.headers)
    except urllib.error.HTTPError as e:
        raw, status, hdrs = e.read().decode(), e.code, dict(e.headers)
    if hdrs.get("Content-Type", "").startswith("text/event-stream"):
        return status, V.parse_sse(raw), hdrs
    return status, json.loads(raw), hdrs


# ------------------------------------------------------------------ every captured case


# Cases where the capture's stand-in engine failed the request after 2 outputs
# (`FinishReason.ERROR`, vLLM's GenerationError); the sim's `errors` fault does the same.
# `cmpl.generation_error_first_stream` (a failure on the first output) has no sim fault:
# the fault's `after_tokens` is at least 1.
ENGINE_ERROR_CASES = ("cmpl.generation_error", "cmpl.generation_error_stream",
                      "chat.generation_error_stream")  # fmt: skip
NEEDS_ENGINE_FAULT = {*ENGINE_ERROR_CASES, "cmpl.generation_error_first_stream"}


@pytest.mark.parametrize("name", sorted(set(V.captured()) - NEEDS_ENGINE_FAULT))
def test_answers_each_case_as_vllm_does(sim: Proc, name: str) -> None:
    # `logprobs: -1` asks for the whole vocabulary, whose size is the model's
    substitute = {"512": str(VOCAB_SIZE)} if name == "err.chat.top_logprobs_negative" else None
    V.assert_like_vllm(name, V.replay(sim.url, name), substitute)


@pytest.fixture(scope="module")
def failing_sim() -> Iterator[Proc]:
    proc = start_sim("test_sim_vllm_fidelity_errors", "--step-base-ms", "1", "--enable-faults",
                     "--fault", '{"kind": "errors", "rate": 1.0, "when": "mid_stream", '
                     '"after_tokens": 2}')  # fmt: skip
    try:
        yield proc
    finally:
        proc.stop()


@pytest.mark.parametrize("name", ENGINE_ERROR_CASES)
def test_request_level_engine_errors_as_vllm(failing_sim: Proc, name: str) -> None:
    got = V.replay(failing_sim.url, name)
    V.assert_like_vllm(name, got)
    if "sse" in got:
        # the outputs before the failure, vLLM's error event, then [DONE]
        assert got["sse"][-2] == V.case(name)["sse"][-2]
        assert len(got["sse"]) == len(V.case(name)["sse"])


# ------------------------------------------------------------------ values vLLM's code showed

FINGERPRINT = re.compile(r"vllm-0\.33\.0-[0-9a-f]{8}")


def test_ids_fingerprint_and_request_id_as_vllm(sim: Proc) -> None:
    _, body, _ = post(sim, "/v1/completions", {"prompt": "Hi", "max_tokens": 1})
    assert re.fullmatch(r"cmpl-[0-9a-f]{16}", body["id"])
    assert FINGERPRINT.fullmatch(body["system_fingerprint"])
    _, chat, _ = post(
        sim,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
    )
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{16}", chat["id"])
    assert chat["system_fingerprint"] == body["system_fingerprint"]  # one per server

    # the body's request_id names the response; X-Request-Id wins over it
    _, named, _ = post(
        sim, "/v1/completions", {"prompt": "Hi", "max_tokens": 1, "request_id": "abc"}
    )
    assert named["id"] == "cmpl-abc"
    _, both, hdrs = post(
        sim,
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 1, "request_id": "abc"},
        {"X-Request-Id": "from-header"},
    )
    assert both["id"] == "cmpl-from-header"
    assert "X-Request-Id" not in hdrs  # echoed only with --enable-request-id-headers

    # streams: the fingerprint rides on the terminal chunk, or on the usage chunk if any
    _, chunks, _ = post(sim, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "stream": True})
    assert [
        FINGERPRINT.fullmatch(c.get("system_fingerprint", "")) is not None for c in chunks[:-1]
    ] == [False] * (len(chunks) - 2) + [True]
    _, chunks, _ = post(
        sim,
        "/v1/completions",
        {
            "prompt": "Hi",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert [("system_fingerprint" in c) for c in chunks[:-1]] == [False] * (len(chunks) - 2) + [
        True
    ]
    assert chunks[-2]["choices"] == [] and chunks[-2]["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_counts_the_tokens_each_chunk_carries(sim: Proc, path: str) -> None:
    body: dict[str, Any] = {
        "max_tokens": 12,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    if path == "/v1/completions":
        body["prompt"] = "Hello there"
    else:
        body["messages"] = [{"role": "user", "content": "Hello there"}]
    _, chunks, _ = post(sim, path, body)
    data = [c for c in chunks[:-1] if c["choices"]]
    if path == "/v1/chat/completions":
        role, data = data[0], data[1:]
        assert role["choices"][0]["delta"]["role"] == "assistant"
        assert role["usage"]["completion_tokens"] == 0  # usage on the role chunk too
    sent = 0
    prompt_tokens = data[0]["usage"]["prompt_tokens"]
    for chunk in data:
        sent += len(chunk["choices"][0]["token_ids"])
        # what the client has been sent, not what the engine has made meanwhile
        assert chunk["usage"] == {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + sent,
            "completion_tokens": sent,
        } | ({"completion_tokens_details": None} if path == "/v1/chat/completions" else {})
    assert sent == 12
    assert chunks[-2]["usage"]["completion_tokens"] == 12


def test_n_streams_send_every_role_chunk_first(sim: Proc) -> None:
    _, chunks, _ = post(
        sim,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "n": 3,
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
        },
    )
    kinds = ["role" if "role" in c["choices"][0]["delta"] else "content" for c in chunks[:-1]]
    assert kinds[:3] == ["role"] * 3 and "role" not in kinds[3:]
    assert [c["choices"][0]["index"] for c in chunks[:3]] == [0, 1, 2]
    finals = [c for c in chunks[:-1] if c["choices"][0]["finish_reason"] is not None]
    assert sorted(c["choices"][0]["index"] for c in finals) == [0, 1, 2]


def test_echo_and_return_token_ids(sim: Proc) -> None:
    prompt = "Echo me"
    _, tok, _ = post(sim, "/tokenize", {"prompt": prompt})
    _, body, _ = post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True})
    assert body["choices"][0]["text"].startswith(prompt)
    assert body["usage"]["completion_tokens"] == 3 or body["choices"][0]["finish_reason"] == "stop"

    _, chunks, _ = post(
        sim, "/v1/completions", {"prompt": prompt, "max_tokens": 3, "echo": True, "stream": True}
    )
    first, rest = chunks[0]["choices"][0], [c["choices"][0] for c in chunks[1:-1]]
    assert first["text"].startswith(prompt)
    assert first["prompt_token_ids"] == tok["tokens"]  # on the first chunk only
    assert all(c["prompt_token_ids"] is None for c in rest)

    _, body, _ = post(sim, "/v1/completions", {"prompt": prompt, "max_tokens": 0, "echo": True})
    assert body["choices"][0]["text"] == prompt  # the prompt alone; one token is made
    assert body["usage"]["completion_tokens"] == 1

    _, body, _ = post(
        sim,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 5, "ignore_eos": True, "return_token_ids": True},
    )
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == tok["tokens"] and len(choice["token_ids"]) == 5
    _, detok, _ = post(sim, "/detokenize", {"tokens": choice["token_ids"]})
    assert detok["prompt"] == choice["text"]


def test_logprobs_have_vllms_counts(sim: Proc) -> None:
    _, body, _ = post(
        sim,
        "/v1/completions",
        {"prompt": "Hi", "max_tokens": 4, "ignore_eos": True, "logprobs": 2, "prompt_logprobs": 1},
    )
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"]
    assert [len(t) for t in lp["top_logprobs"]] == [3] * 4  # the sampled token + 2
    assert lp["text_offset"][0] == 0
    prompt_lp = choice["prompt_logprobs"]
    assert len(prompt_lp) == body["usage"]["prompt_tokens"] and prompt_lp[0] is None
    assert all(len(p) == 2 for p in prompt_lp[1:])

    _, chat, _ = post(
        sim,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 2,
        },
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    assert "".join(c["token"] for c in content) == chat["choices"][0]["message"]["content"]


def test_stop_token_ids_end_the_output_with_the_token_as_stop_reason(sim: Proc) -> None:
    common = {"prompt": "Stop here", "temperature": 0, "ignore_eos": True}
    _, free, _ = post(sim, "/v1/completions", {**common, "max_tokens": 8, "return_token_ids": True})
    ids = free["choices"][0]["token_ids"]
    stop_id = ids[3]
    first = ids.index(stop_id)  # it may occur earlier too
    _, body, _ = post(
        sim, "/v1/completions", {**common, "max_tokens": 8, "stop_token_ids": [stop_id]}
    )
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    assert body["usage"]["completion_tokens"] == first + 1  # counted, but not in the text
    _, detok, _ = post(sim, "/detokenize", {"tokens": ids[:first]})
    assert choice["text"] == detok["prompt"]

    _, chunks, _ = post(
        sim,
        "/v1/completions",
        {**common, "max_tokens": 8, "stream": True, "stop_token_ids": [stop_id]},
    )
    final = chunks[-2]["choices"][0]
    assert final["finish_reason"] == "stop" and final["stop_reason"] == stop_id
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == detok["prompt"]


def test_default_max_tokens_and_lax_integers(sim: Proc) -> None:
    _, body, _ = post(sim, "/v1/completions", {"prompt": "Hi", "ignore_eos": True})
    assert body["usage"]["completion_tokens"] == 16  # completions' default
    messages = [{"role": "user", "content": "word " * 1300}]
    _, chat, _ = post(sim, "/v1/chat/completions", {"messages": messages, "ignore_eos": True})
    usage = chat["usage"]
    assert usage["total_tokens"] == MAX_MODEL_LEN  # chat's default: the rest of the context
    assert chat["choices"][0]["finish_reason"] == "length"
    # pydantic's lax mode, as vLLM's FastAPI validates: 2.0 -> 2, true -> 1, "2" -> 2
    for value, expected in ((2.0, 2), (True, 1), ("2", 2)):
        status, body, _ = post(
            sim, "/v1/completions", {"prompt": "Hi", "max_tokens": value, "ignore_eos": True}
        )
        assert status == 200 and body["usage"]["completion_tokens"] == expected, value


def test_responses_text_and_events_agree(sim: Proc) -> None:
    req = {"input": "Tell me.", "max_output_tokens": 6, "instructions": "Be brief."}
    _, body, _ = post(sim, "/v1/responses", req)
    assert re.fullmatch(r"resp_[0-9a-f]{16}", body["id"])
    text = body["output"][0]["content"][0]["text"]
    assert body["usage"]["output_tokens"] <= 6 and body["instructions"] == "Be brief."
    assert body["status"] in ("completed", "incomplete")
    _, events, _ = post(sim, "/v1/responses", {**req, "stream": True})
    deltas = "".join(
        e["data"]["delta"] for e in events if e["event"] == "response.output_text.delta"
    )
    done = next(e for e in events if e["event"] == "response.output_text.done")
    assert deltas == done["data"]["text"]
    assert [e["data"]["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["data"]["response"]["output"][0]["content"][0]["text"] == deltas
    assert isinstance(text, str)


def test_guided_json_is_ignored_as_in_vllm_033(sim: Proc) -> None:
    # vLLM 0.33 removed guided_*: an extra field, ignored (a 200, unconstrained)
    status, body, _ = post(
        sim, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "guided_json": {"type": "object"}}
    )
    assert status == 200 and body["choices"][0]["text"] is not None
