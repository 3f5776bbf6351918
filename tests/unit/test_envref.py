"""Environment references in the gateway's configuration: `os.environ/NAME` (LiteLLM's
form) and `${NAME}`, resolved before validation, with no resolved value ever printed."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from seawall import envref
from seawall.config import ConfigError, load_config, parse_config
from seawall.gateway.serve_cli import build_config

SECRET = "sk-live-5ecret-value-do-not-print"


def _replica(api_key: str) -> dict[str, object]:
    return {"replicas": [{"url": "http://127.0.0.1:8001", "api_key": api_key}]}


def test_dollar_brace_reference_becomes_the_variable_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    config = parse_config(_replica("${VLLM_API_KEY}"))
    assert config.replicas[0].api_key == SECRET


def test_litellm_os_environ_form_becomes_the_variable_value(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    config = parse_config(_replica("os.environ/VLLM_API_KEY"))
    assert config.replicas[0].api_key == SECRET


def test_a_reference_inside_a_string_and_the_escaped_literal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", "pw")
    monkeypatch.setenv("REDIS_HOST", "redis.seawall.svc")
    config = parse_config(
        {"ratelimit": {"redis_url": "redis://:${REDIS_PASSWORD}@${REDIS_HOST}:6379/0"}}
    )
    assert config.ratelimit.redis_url == "redis://:pw@redis.seawall.svc:6379/0"
    literal = parse_config(_replica("price$${not_a_ref}"))
    assert literal.replicas[0].api_key == "price${not_a_ref}"


def test_strings_without_references_and_non_strings_are_untouched() -> None:
    data = {"a": "plain $5 value", "b": 3, "c": [True, None, "x"], "d": {"e": 1.5}}
    assert envref.resolve(data, env={}) == data


def test_an_unset_variable_is_an_error_naming_the_field_and_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    with pytest.raises(ConfigError) as e:
        parse_config(_replica("${VLLM_API_KEY}"), "gateway.yaml")
    assert str(e.value) == (
        "gateway.yaml: replicas.0.api_key: environment variable VLLM_API_KEY is not set"
    )


def test_an_empty_variable_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_API_KEY", "")
    with pytest.raises(ConfigError, match="VLLM_API_KEY is set but empty"):
        parse_config(_replica("os.environ/VLLM_API_KEY"))


@pytest.mark.parametrize(
    "value", ["${VLLM_API_KEY", "${1BAD}", "${}", "os.environ/", "os.environ/A-B"]
)
def test_a_malformed_reference_is_an_error_not_a_literal(value: str) -> None:
    with pytest.raises(ConfigError, match=r"replicas\.0\.api_key"):
        parse_config(_replica(value))


def test_validation_errors_never_echo_a_resolved_value(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fields whose names do not look secret are echoed by the validator ("got ..."):
    # a value that came from the environment must show where it came from instead.
    monkeypatch.setenv("GW_PORT", SECRET)
    monkeypatch.setenv("ENGINE_URL", SECRET)
    with pytest.raises(ConfigError) as e:
        parse_config({"listen": {"port": "${GW_PORT}"}, "replicas": [{"url": "${ENGINE_URL}"}]})
    text = str(e.value)
    assert SECRET not in text
    assert "listen.port" in text and "replicas.0.url" in text
    assert "<from ${GW_PORT}>" in text and "<from ${ENGINE_URL}>" in text


def test_nested_sections_never_echo_a_resolved_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIL_MODE", SECRET)
    monkeypatch.setenv("ACTUATOR", SECRET)
    with pytest.raises(ConfigError) as e:
        parse_config(
            {
                "ratelimit": {"backend": "redis", "fail_mode": "${FAIL_MODE}"},
                "fleet": {"actuator": "os.environ/ACTUATOR"},
            }
        )
    assert "ratelimit.fail_mode" in str(e.value) and "fleet.actuator" in str(e.value)
    assert SECRET not in str(e.value)


def test_a_config_file_through_serve_keeps_the_resolved_secret(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # `seawall serve --config` parses the file, dumps it and parses it again with the
    # command-line overrides: the second pass must not change or re-resolve anything.
    monkeypatch.setenv("VLLM_API_KEY", SECRET)
    monkeypatch.setenv("SEAWALL_REDIS_URL", "redis://127.0.0.1:6390/0")
    path = tmp_path / "gateway.yaml"
    path.write_text(
        "replicas:\n  - url: http://127.0.0.1:8001\n    api_key: ${VLLM_API_KEY}\n"
        "ratelimit:\n  backend: redis\n  redis_url: os.environ/SEAWALL_REDIS_URL\n"
    )
    assert load_config(path).replicas[0].api_key == SECRET
    args = argparse.Namespace(
        config=str(path),
        replica=[],
        host=None,
        port=9999,
        ttft_timeout=None,
        itl_timeout=None,
        total_timeout=None,
    )
    config = build_config(args)
    assert config.replicas[0].api_key == SECRET
    assert config.ratelimit.redis_url == "redis://127.0.0.1:6390/0"


def test_a_resolved_value_reads_as_its_source_in_repr() -> None:
    value = envref.resolve_string("${A}-${B}", "x", env={"A": "1", "B": "2"})
    assert value == "1-2"
    assert repr(value) == "<from ${A, B}>"
    assert f"{value}" == "1-2"


def test_a_parsed_config_never_shows_a_secret_in_its_repr(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once validated, a resolved key is a plain str: the config's repr (what a debug
    log or a traceback prints) leaves every secret field out."""
    monkeypatch.setenv("ENGINE_KEY", SECRET)
    monkeypatch.setenv("REDIS_PASSWORD", SECRET)
    cfg = parse_config(
        {
            **_replica("${ENGINE_KEY}"),
            "model_list": [
                {
                    "model_name": "m",
                    "litellm_params": {
                        "model": "hosted_vllm/m",
                        "api_base": "http://127.0.0.1:8002",
                        "api_key": "os.environ/ENGINE_KEY",
                    },
                }
            ],
            "ratelimit": {"redis_url": "redis://:${REDIS_PASSWORD}@127.0.0.1:6379/0"},
            "cluster": {"redis_url": "redis://:${REDIS_PASSWORD}@127.0.0.1:6379/0"},
        }
    )
    assert cfg.replicas[0].api_key == SECRET  # resolved, and used
    assert SECRET not in repr(cfg) and SECRET not in str(cfg)


def test_seawall_ups_own_traffic_key_reads_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from seawall.up.config import parse_up_config

    monkeypatch.setenv("DEMO_KEY", SECRET)
    cfg = parse_up_config({"traffic": {"api_key": "os.environ/DEMO_KEY"}})
    assert cfg.traffic.api_key == SECRET and SECRET not in repr(cfg)
