"""Hedging is only for short prompts on a lightly loaded fleet."""

from __future__ import annotations

import itertools

from seawall.policy.hedge import HedgePolicy, should_hedge


def test_hedges_only_when_both_conditions_hold() -> None:
    prompts = [0, 511, 512, 513, 100_000]
    loads = [0.0, 0.69, 0.7, 0.71, 5.0]
    for prompt_tokens, load in itertools.product(prompts, loads):
        expected = prompt_tokens <= 512 and load <= 0.7
        assert should_hedge(prompt_tokens, 512, load, 0.7) is expected, (prompt_tokens, load)


def test_unknown_fleet_load_never_hedges() -> None:
    assert should_hedge(10, 512, float("nan"), 0.7) is False


def test_policy_applies_its_own_limits() -> None:
    policy = HedgePolicy(delay_s=0.5, max_prompt_tokens=256, max_fleet_load=0.5)
    assert policy.allows(prompt_tokens=100, fleet_load=0.2)
    assert not policy.allows(prompt_tokens=300, fleet_load=0.2)
    assert not policy.allows(prompt_tokens=100, fleet_load=0.6)
