"""Fault bodies parse into what they say; the CLI refuses what vLLM would refuse."""

from __future__ import annotations

import argparse

import pytest

from seawall.sim import cli
from seawall.sim import faults as fl


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_fault_bodies_parse_with_their_defaults() -> None:
    assert fl.parse_fault({"kind": "crash"}) == fl.Crash()
    assert fl.parse_fault({"kind": "crash", "after_tokens": 5}) == fl.Crash(after_tokens=5)
    assert fl.parse_fault({"kind": "engine_dead"}) == fl.EngineDead(grace_s=5.0)
    assert fl.parse_fault({"kind": "hang", "running": "zero"}) == fl.Hang(running="zero")
    assert fl.parse_fault({"kind": "slow", "factor": 3}) == fl.Slow(factor=3.0)
    assert fl.parse_fault({"kind": "errors", "rate": 0.25}) == fl.Errors(rate=0.25)
    assert fl.parse_fault({"kind": "dcgm", "xid": 79}) == fl.Dcgm(
        fields={"DCGM_FI_DEV_XID_ERRORS": 79.0}
    )


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"kind": 3},
        {"kind": "meteor"},
        {"kind": "slow"},
        {"kind": "slow", "factor": -1},
        {"kind": "errors", "rate": 2},
        {"kind": "errors", "rate": 0.5, "when": "sometimes"},
        {"kind": "hang", "running": "maybe"},
        {"kind": "dcgm"},
        {"kind": "dcgm", "fields": {"NOT_A_FIELD": 1}},
        {"kind": "crash", "after_tokens": True},
    ],
)
def test_bad_fault_bodies_are_refused(body: object) -> None:
    with pytest.raises(fl.FaultError):
        fl.parse_fault(body)


def test_clear_resets_every_fault_and_hardware_signal() -> None:
    state = fl.FaultState()
    for body in (
        {"kind": "hang"},
        {"kind": "slow", "factor": 4},
        {"kind": "errors", "rate": 1},
        {"kind": "dcgm", "xid": 48, "ecc_dbe": 3},
        {"kind": "engine_dead"},
    ):
        state.apply(fl.parse_fault(body))
    assert state.hang and state.slow_factor == 4 and state.errors and state.engine_dead
    assert state.dcgm_values(0)["DCGM_FI_DEV_XID_ERRORS"] == 48
    assert state.dcgm_values(1)["DCGM_FI_DEV_XID_ERRORS"] == 0
    state.apply(fl.Clear())
    assert state == fl.FaultState()


def test_error_draws_are_deterministic_and_spread() -> None:
    draws = [fl.error_draw(0, i) for i in range(2000)]
    assert draws == [fl.error_draw(0, i) for i in range(2000)]
    assert all(0.0 <= d < 1.0 for d in draws)
    assert 0.45 < sum(d < 0.5 for d in draws) / len(draws) < 0.55


def test_cli_defaults_and_start_faults() -> None:
    config = cli.config_from_args(_args())
    assert (config.port, config.model, config.max_model_len, config.kv_blocks) == (
        8000,
        "sim-model",
        4096,
        2048,
    )
    assert config.shutdown_timeout_s == 0.0  # vLLM's default: abort in-flight on SIGTERM
    config = cli.config_from_args(
        _args(
            "--enable-faults",
            "--fault",
            '{"kind":"load_time","seconds":3}',
            "--fault",
            '{"kind":"hang"}',
        )
    )
    assert config.load_time_s == 3 and config.faults == (fl.Hang(),)


def test_cli_refuses_faults_without_enable_faults_and_a_kv_cache_too_small() -> None:
    with pytest.raises(ValueError, match="--enable-faults"):
        cli.config_from_args(_args("--fault", '{"kind":"hang"}'))
    with pytest.raises(ValueError, match="max seq len"):
        cli.config_from_args(_args("--kv-blocks", "100", "--max-model-len", "4096"))
    # exactly enough: 256 usable blocks of 16 tokens hold 4,096 tokens
    assert cli.config_from_args(_args("--kv-blocks", "257")).kv_blocks == 257
