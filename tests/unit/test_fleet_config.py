"""The `fleet:` config section: documented defaults, and typos rejected rather than ignored."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from seawall.fleet.config import FleetMonitorConfig


def test_defaults_are_the_documented_ones() -> None:
    c = FleetMonitorConfig()
    assert (c.liveness_interval_s, c.startup_allowance_s) == (1.0, 600.0)
    assert (c.deep_probe_interval_s, c.deep_probe_timeout_s) == (5.0, 5.0)
    assert c.deep_probe_idle_interval_s < c.deep_probe_interval_s  # idle replicas more often
    assert c.deep_probe_failures_threshold == 3
    assert c.watchdog_window_s == 60.0
    assert (c.restart_limit, c.restart_window_s) == (3, 3600.0)
    assert c.actuator == "none" and c.hardware_ticket_webhook_url is None


def test_a_misspelled_field_is_an_error() -> None:
    with pytest.raises(ValidationError, match="liveness_interval"):
        FleetMonitorConfig.model_validate({"liveness_interval": 2})


def test_nonsense_values_are_rejected() -> None:
    with pytest.raises(ValidationError):
        FleetMonitorConfig(deep_probe_timeout_s=0)
    with pytest.raises(ValidationError):
        FleetMonitorConfig(restart_limit=0)
    with pytest.raises(ValidationError):
        FleetMonitorConfig.model_validate({"discovery": {"mode": "consul", "service": "v"}})
