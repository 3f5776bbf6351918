"""The example configurations in examples/ are valid: an example that does not load
teaches the wrong thing."""

from __future__ import annotations

import pytest

from seawall.config import load_config
from seawall.up.config import load_up_config
from tests.support.procs import REPO


def test_the_regions_example_is_a_valid_gateway_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WEST_API_KEY", "from-the-environment")
    config = load_config(REPO / "examples" / "regions.yaml")
    assert {r.pool for r in config.replicas} == {"east", "west"}
    assert config.pools["west"].mode == "passive"
    assert config.tiers["free"].pools.failover is False
    west = next(r for r in config.replicas if r.pool == "west")
    assert west.api_key == "from-the-environment"


def test_the_fleet_example_is_a_valid_up_config() -> None:
    load_up_config(REPO / "examples" / "fleet.yaml")
