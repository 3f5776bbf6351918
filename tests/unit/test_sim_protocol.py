"""The emulator's request validation reproduces vLLM 0.33.0's texts exactly (no server:
vLLM's captured answers, tests/data/vllm/captured.json, against `seawall.sim.protocol`)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from seawall.errors import ApiError
from seawall.sim import protocol as p
from tests.support import vllm_schema as V

MODELS: dict[str, Any] = {
    "/v1/completions": p.CompletionRequest,
    "/v1/chat/completions": p.ChatCompletionRequest,
    "/v1/responses": p.ResponsesRequest,
    "/detokenize": p.DetokenizeRequest,
}


def _validation_cases() -> list[str]:
    """vLLM's 400s raised while reading the body: pydantic's, and its before-validators'."""
    names = []
    for name, case in V.captured().items():
        req = case["request"]
        if case["status"] != 400 or req["path"] not in (*MODELS, "/tokenize"):
            continue
        if not isinstance(V.expand(req["body"]), dict | list):
            continue
        names.append(name)
    return sorted(names)


def _validate(path: str, body: Any) -> None:
    if path == "/tokenize":
        p.validate_tokenize(body)
    else:
        p.validate(MODELS[path], body)


@pytest.mark.parametrize("name", _validation_cases())
def test_body_validation_errors_are_vllms(name: str) -> None:
    case = V.case(name)
    want = case["json"]["error"]
    raised_in_validation = "validation error" in want["message"] or want["type"] == "Bad Request"
    try:
        _validate(case["request"]["path"], V.expand(case["request"]["body"]))
    except ApiError as e:
        assert e.body() == case["json"]
        return
    # not a body error in vLLM either: raised later (context length, sampling params)
    assert not raised_in_validation, want


@pytest.mark.parametrize(
    ("name", "raw", "content_type"),
    [
        ("err.invalid_json", b"{not json", "application/json"),
        ("err.content_type_text", json.dumps({"prompt": "Hi"}).encode(), "text/plain"),
        ("err.content_type_missing", json.dumps({"prompt": "Hi"}).encode(), None),
    ],
)
def test_content_type_and_json_errors_are_vllms(
    name: str, raw: bytes, content_type: str | None
) -> None:
    with pytest.raises(ApiError) as e:
        p.parse_json_body(raw, content_type)
    assert e.value.body() == V.case(name)["json"]


def test_a_json_content_type_with_parameters_is_accepted() -> None:
    assert p.parse_json_body(b'{"a": 1}', "application/json; charset=utf-8") == {"a": 1}
    # FastAPI's parser reads what orjson refuses
    assert p.parse_json_body(b'{"t": NaN}', "application/json")["t"] != 0


def test_the_strict_validator_rejects_extra_missing_and_mistyped_keys() -> None:
    # the helper the sim's (and later the gateway's) answers are judged by can fail
    body = V.case("cmpl.basic")["json"]
    V.validate(body, "CompletionResponse")
    choice = body["choices"][0]
    broken = [
        {**body, "extra": 1},
        {k: v for k, v in body.items() if k != "metrics"},
        {**body, "choices": [{**choice, "logprobs": "none"}]},
        {**body, "usage": {**body["usage"], "prompt_tokens": "5"}},
    ]
    for bad in broken:
        with pytest.raises(AssertionError):
            V.validate(bad, "CompletionResponse")
    with pytest.raises(AssertionError):
        V.same_keys({**body, "extra": 1}, body)
    # data-keyed maps (completions' top_logprobs) compare by shape, not by their keys
    lp = V.case("cmpl.logprobs")["json"]
    other = json.loads(json.dumps(lp).replace('" ":', '"x":'))
    V.same_keys(other, lp)
