"""Trace context as the gateway reads it, and tracing's cost when it is off."""

from __future__ import annotations

import pytest

from seawall.config import ConfigError, TelemetryConfig, parse_config
from seawall.gateway.telemetry import incoming

VALID = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def test_a_valid_traceparent_and_tracestate_are_kept_as_sent() -> None:
    ctx = incoming({"traceparent": VALID, "tracestate": "congo=t61rcWkgMzE"})
    assert ctx is not None and ctx.trace_id == "4bf92f3577b34da6a3ce929d0e0e4736"
    assert dict(ctx.headers) == {"traceparent": VALID, "tracestate": "congo=t61rcWkgMzE"}


@pytest.mark.parametrize(
    "value",
    [
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # zero parent id
        "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # v00 has 4 fields
        "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
        "hello",
    ],
)
def test_a_malformed_traceparent_is_not_forwarded(value: str) -> None:
    assert incoming({"traceparent": value, "tracestate": "a=b"}) is None


def test_a_future_version_may_carry_more_fields() -> None:
    ctx = incoming({"traceparent": "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-ab"})
    assert ctx is not None


def test_an_oversized_or_binary_tracestate_is_dropped_and_the_traceparent_kept() -> None:
    for state in ("x=" + "a" * 600, "x=\x01"):
        ctx = incoming({"traceparent": VALID, "tracestate": state})
        assert ctx is not None and dict(ctx.headers) == {"traceparent": VALID}


def test_no_traceparent_costs_one_lookup_and_nothing_else() -> None:
    assert incoming({}) is None


def test_telemetry_is_off_by_default_and_validated() -> None:
    assert parse_config({}).telemetry == TelemetryConfig(enabled=False)
    with pytest.raises(ConfigError, match=r"telemetry\.sample_ratio"):
        parse_config({"telemetry": {"sample_ratio": 2}})
