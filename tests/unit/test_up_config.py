"""`seawall up` configuration: defaults, the shipped example, and errors a user can act on."""

from __future__ import annotations

from pathlib import Path

import pytest

from seawall.up.config import (
    UpConfigError,
    check_gateway_config,
    demo_config,
    gateway_config,
    load_up_config,
    parse_up_config,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet.yaml"


def test_the_shipped_example_loads_and_its_gateway_section_is_valid() -> None:
    config = load_up_config(EXAMPLE)
    assert config.fleet.replicas == 3 and config.fleet.command is None
    assert config.traffic is not None and config.traffic.concurrency == 2
    check_gateway_config(config, str(EXAMPLE))


def test_an_empty_file_means_three_sim_replicas_behind_a_gateway() -> None:
    config = parse_up_config(None)
    assert (config.fleet.replicas, config.fleet.model) == (3, "sim-model")
    assert config.fleet.startup_allowance_s == 600
    assert config.gateway == {} and config.traffic is None


def test_the_demo_has_traffic_and_sims_that_accept_faults() -> None:
    config = demo_config()
    assert config.traffic is not None
    assert config.fleet.command is not None and "--enable-faults" in config.fleet.command


def error_for(data: object) -> str:
    with pytest.raises(UpConfigError) as e:
        parse_up_config(data, "fleet.yaml")
    return str(e.value)


def test_an_unknown_field_is_named_with_the_allowed_ones() -> None:
    msg = error_for({"fleet": {"replica": 2}})
    assert "fleet.replica: unknown field" in msg
    assert "allowed: replicas, model, command, startup_allowance_s" in msg
    assert "allowed: fleet, gateway, gateway_mode, gateways, traffic" in error_for({"fleeet": {}})
    assert "traffic.rate: unknown field; allowed: concurrency" in error_for(
        {"traffic": {"rate": 3}}
    )


def test_out_of_range_values_name_the_field_the_bound_and_the_value() -> None:
    msg = error_for({"fleet": {"replicas": 0, "startup_allowance_s": -1}})
    assert "fleet.replicas: Input should be greater than or equal to 1 (got 0)" in msg
    assert "fleet.startup_allowance_s: Input should be greater than 0 (got -1)" in msg


def test_a_command_with_an_unknown_placeholder_lists_the_allowed_ones() -> None:
    msg = error_for({"fleet": {"command": ["vllm", "serve", "--gpu", "{gpu}"]}})
    assert "fleet.command:" in msg and "{port}, {model}, {replica}, {index}" in msg


def test_a_file_that_is_not_a_mapping_or_not_yaml_is_refused(tmp_path: Path) -> None:
    assert "top level must be a mapping" in error_for(["fleet"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("fleet: [unclosed\n")
    with pytest.raises(UpConfigError, match="not valid YAML"):
        load_up_config(bad)
    with pytest.raises(UpConfigError, match="cannot read"):
        load_up_config(tmp_path / "missing.yaml")


def test_a_gateway_typo_is_caught_before_anything_starts() -> None:
    config = parse_up_config({"gateway": {"timeouts": {"ttft": 3}}})
    with pytest.raises(UpConfigError, match=r"timeouts\.ttft"):
        check_gateway_config(config, "fleet.yaml")


def test_started_replicas_and_the_listen_address_are_merged_into_the_gateway_config() -> None:
    ours = [{"url": "http://127.0.0.1:9001", "model": "m", "node": "local", "id": "r0"}]
    base = {
        "listen": {"port": 1},
        "replicas": [{"url": "http://10.0.0.9:8000"}],
        "retry": {"max_attempts": 2},
    }
    merged = gateway_config(base, ours, "127.0.0.1", 8080)
    assert merged["replicas"] == [*ours, {"url": "http://10.0.0.9:8000"}]
    assert merged["listen"] == {"port": 8080, "host": "127.0.0.1"}
    assert merged["retry"] == {"max_attempts": 2}
    assert base["listen"] == {"port": 1}  # the user's config is not modified


def test_seawall_up_with_a_bad_config_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from seawall.cli import main

    bad = tmp_path / "fleet.yaml"
    bad.write_text("fleet: {replicas: many}\n")
    assert main(["up", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "fleet.replicas: Input should be a valid integer" in err and "'many'" in err


def test_gateway_mode_names_its_allowed_values() -> None:
    msg = error_for({"gateway_mode": "sidecar"})
    assert "gateway_mode: Input should be 'in-process' or 'process' (got 'sidecar')" in msg


def test_an_actuator_that_cannot_reach_our_processes_is_refused() -> None:
    kube = parse_up_config({"gateway": {"fleet": {"actuator": "kubernetes"}}})
    with pytest.raises(
        UpConfigError, match=r"gateway\.fleet\.actuator: 'kubernetes'.*allowed: none, local"
    ):
        check_gateway_config(kube, "fleet.yaml")
    local_in_child = parse_up_config(
        {"gateway": {"fleet": {"actuator": "local"}}, "gateway_mode": "process"}
    )
    with pytest.raises(UpConfigError, match=r"allowed: none$"):
        check_gateway_config(local_in_child, "fleet.yaml")


def test_several_gateways_are_one_to_eight() -> None:
    assert parse_up_config(None).gateways == 1
    assert parse_up_config({"gateways": 2}).gateways == 2
    assert "gateways" in error_for({"gateways": 0})
    assert "gateways" in error_for({"gateways": 9})
