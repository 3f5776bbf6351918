"""Public model names: LiteLLM's `model_list` as config, and the restamp of responses.

The restamp runs on every read of a stream; here every split of a real stream into two
and three reads is tried, so a `"model"` field cut anywhere is still renamed."""

from __future__ import annotations

import itertools

import orjson
import pytest

from seawall.config import ConfigError, parse_config
from seawall.gateway.aliases import Restamp, upstream_body

SERVED, PUBLIC = "Qwen/Qwen3-8B", "qwen3-8b"

STREAM = (
    b"".join(
        b"data: " + orjson.dumps(obj) + b"\n\n"
        for obj in (
            {"id": "cmpl-1", "model": SERVED, "choices": [{"text": "Hello", "index": 0}]},
            # An answer that talks about a model field: escaped inside the string, kept.
            {"id": "cmpl-1", "model": SERVED, "choices": [{"text": '"model":"Qwen/Qwen3-8B"'}]},
            {"id": "cmpl-1", "model": SERVED, "choices": [], "usage": {"total_tokens": 3}},
        )
    )
    + b"data: [DONE]\n\n"
)
EXPECTED = STREAM.replace(b'"model":"Qwen/Qwen3-8B"', b'"model":"qwen3-8b"')


def restamped(reads: list[bytes]) -> bytes:
    r = Restamp(SERVED, PUBLIC)
    return b"".join(r.part(d) for d in reads)


def test_a_whole_stream_is_renamed_and_text_about_models_is_not() -> None:
    assert restamped([STREAM]) == EXPECTED
    assert b'\\"model\\":\\"Qwen/Qwen3-8B\\"' in EXPECTED  # the answer's own text, untouched
    assert EXPECTED.count(b'"model":"qwen3-8b"') == 3


def test_every_split_into_two_reads_renames_the_same() -> None:
    for i in range(len(STREAM) + 1):
        assert restamped([STREAM[:i], STREAM[i:]]) == EXPECTED, i


def test_every_split_into_three_reads_around_a_field_renames_the_same() -> None:
    start = STREAM.index(b'"model"')
    window = range(start - 2, start + len(b'"model":"Qwen/Qwen3-8B"') + 2)
    for i, j in itertools.combinations(window, 2):
        assert restamped([STREAM[:i], STREAM[i:j], STREAM[j:]]) == EXPECTED, (i, j)


def test_bytes_are_held_only_while_they_may_begin_the_field() -> None:
    r = Restamp(SERVED, PUBLIC)
    assert r.part(b'data: {"id":"x","model":"Qwen/Qw') == b'data: {"id":"x",'
    assert r.part(b'en3-8B","choices":[]}\n\n') == b'"model":"qwen3-8b","choices":[]}\n\n'
    assert r.part(b'data: {"text":"a"}') == b'data: {"text":"a"}'  # no prefix: all out
    assert r.part(b'data: {"model":"other"}\n\n') == b'data: {"model":"other"}\n\n'


def test_the_spaced_json_some_engines_write_is_renamed_too() -> None:
    body = b'{"id": "x", "model": "Qwen/Qwen3-8B", "choices": []}'
    assert Restamp(SERVED, PUBLIC).whole(body) == body.replace(SERVED.encode(), PUBLIC.encode())


def test_the_upstream_body_carries_the_served_name_and_nothing_else_changes() -> None:
    body = orjson.dumps({"model": PUBLIC, "prompt": "hi", "max_tokens": 3})
    assert orjson.loads(upstream_body(body, SERVED)) == {
        "model": SERVED,
        "prompt": "hi",
        "max_tokens": 3,
    }


LITELLM = {
    "model_list": [
        {
            "model_name": PUBLIC,
            "litellm_params": {
                "model": f"hosted_vllm/{SERVED}",
                "api_base": "http://10.0.0.5:8000/v1",
                "api_key": "os.environ/VLLM_API_KEY",
            },
            "model_info": {"id": "gpu-a", "node": "node-a"},
        },
        {
            "model_name": PUBLIC,
            "litellm_params": {"model": f"openai/{SERVED}", "api_base": "http://10.0.0.6:8000"},
        },
    ]
}


def test_a_litellm_model_list_becomes_one_pool_of_replicas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "sk-engine-secret")
    config = parse_config({"replicas": [{"url": "http://10.0.0.4:8000"}], **LITELLM})
    first, a, b = config.replicas
    assert first.model_name is None and first.model is None  # the native entry, first
    assert (a.url, a.model, a.model_name, a.id, a.node, a.engine) == (
        "http://10.0.0.5:8000",
        SERVED,
        PUBLIC,
        "gpu-a",
        "node-a",
        "vllm",
    )
    assert a.api_key == "sk-engine-secret"
    assert (b.url, b.model, b.model_name, b.engine) == (
        "http://10.0.0.6:8000",
        SERVED,
        PUBLIC,
        "auto",
    )
    # `seawall serve` merges its flags through a dump of the set fields: no duplicates.
    again = parse_config(config.model_dump(exclude_unset=True))
    assert [r.url for r in again.replicas] == [r.url for r in config.replicas]


def test_a_litellm_setting_seawall_does_not_take_is_an_error_naming_the_allowed_ones() -> None:
    entry = {
        "model_name": PUBLIC,
        "litellm_params": {"model": SERVED, "api_base": "http://h:1", "rpm": 5},
    }
    with pytest.raises(ConfigError) as e:
        parse_config({"model_list": [entry]})
    assert (
        "model_list.0.litellm_params.rpm: unknown field; allowed: model, api_base, api_key"
        in str(e.value)
    )


def test_a_model_list_entry_whose_names_agree_is_not_an_alias() -> None:
    entry = {"model_name": SERVED, "litellm_params": {"model": SERVED, "api_base": "http://h:1/v1"}}
    (replica,) = parse_config({"model_list": [entry]}).replicas
    assert replica.model == SERVED and replica.model_name is None
