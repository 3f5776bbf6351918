"""The gateway's shell around the adaptive controller (gateway/admission_control.py): how a
request's demand travels, how its reservation follows the in-flight ledger's holds, and
how a completion's length is read. No sockets: a Gateway object is built, not started."""

from __future__ import annotations

from typing import Any

import pytest

from seawall.config import GatewayConfig, Timeouts
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.gateway.admission_control import (
    AdmissionControl,
    ReserveTokens,
    completion_tokens,
)
from seawall.gateway.app import Gateway
from seawall.gateway.context import RequestCtx
from seawall.gateway.inflight import InFlight
from seawall.policy.adaptive_admission import ControlConfig
from seawall.protocol.sse import Event, Kind

CAPACITY = 199 * 16


def ctx(model: str = "m") -> RequestCtx:
    c = RequestCtx("id", "completions", 0.0, Timeouts())
    c.tenant, c.tier = "acme", "default"

    class _Req:  # the parsed request, as far as the shell reads it
        pass

    req: Any = _Req()
    req.model = model
    c.req = req
    return c


def load(at: float, kv: float = 0.2) -> EngineLoad:
    return EngineLoad(
        running=1,
        waiting=0,
        kv_usage=kv,
        preemptions_total=0,
        kv_capacity_tokens=CAPACITY,
        kv_block_size=16,
        scraped_at=at,
    )


def reserved_blocks(control: AdmissionControl, replica: str, now: float) -> float:
    state = control.state(replica, now)
    assert state is not None
    return state.reserved_blocks


def test_the_demand_rides_on_an_int_worth_todays_worst_case() -> None:
    control = AdmissionControl(ControlConfig())
    c = ctx()
    control.attach(c, prompt_tokens=100, max_tokens=1000, worst_tokens=1100, priority=1)
    assert isinstance(c.reserve_tokens, ReserveTokens) and c.reserve_tokens == 1100
    assert c.reserve_tokens.demand.expected_tokens == 1000  # nothing learned: worst case
    assert c.reserve_tokens.demand.priority == 1
    # A context-length clamp (worst < prompt + max_tokens) clamps the output ceiling too.
    control.attach(c, prompt_tokens=100, max_tokens=1000, worst_tokens=512, priority=0)
    assert c.reserve_tokens.demand.max_tokens == 412


def test_a_reservation_follows_the_ledger_hold_and_the_end_teaches_the_length() -> None:
    control = AdmissionControl(ControlConfig())
    ledger = InFlight()
    control.observe("r0", load(1.0), 1.0)
    c = ctx()
    control.attach(c, 100, 1000, 1100, 0)
    assert c.admission is not None
    hold = ledger.hold("r0")
    c.admission.bind("r0", hold)
    assert reserved_blocks(control, "r0", 1.0) == 69
    # The attempt ends (its hold released): the next decision there sees the room again.
    hold.release()
    other = ctx()
    control.attach(other, 100, 1000, 1100, 0)
    in_flight = ledger.counts("r0").requests
    assert control.saturation("r0", load(1.0), 1.0, other.reserve_tokens, in_flight) is None
    assert reserved_blocks(control, "r0", 1.0) == 0
    # The request's end learns its length from the engine's usage; a second end is a no-op.
    c.status, c.usage = 200, {"prompt_tokens": 100, "completion_tokens": 321}
    control.finish(c, 2.0)
    control.finish(c, 2.0)
    learned = control.lengths_view()["m/default/acme/<=1024"]
    assert learned["expected_tokens"] == 321 and learned["samples"] == 1


def test_requests_admitted_before_any_estimate_take_the_first_one_that_arrives() -> None:
    """A fresh gateway knows no lengths: its first requests reserve the worst case. When
    the first completion teaches one, those still in flight, and those still waiting for
    room, are re-estimated: an EOS-sampled one otherwise held 69 blocks for its whole run,
    and the requests behind it waited for room the engine had."""
    control = AdmissionControl(ControlConfig())
    ledger = InFlight()
    control.observe("r0", load(1.0), 1.0)
    first, running, waiting = ctx(), ctx(), ctx()
    for c in (first, running, waiting):
        control.attach(c, 100, 1000, 1100, 0)
    assert first.admission is not None and running.admission is not None
    first.admission.bind("r0", ledger.hold("r0"))
    running.admission.bind("r0", ledger.hold("r0"))
    assert reserved_blocks(control, "r0", 1.0) == 2 * 69
    assert waiting.reserve_tokens.demand.expected_tokens == 1000
    first.status, first.usage = 200, {"completion_tokens": 50}
    control.finish(first, 2.0)
    # One sample, shrunk toward max_tokens (a third of the way: prior 0.5 of 1.5).
    expected = pytest.approx(50 + (1000 - 50) / 3)
    assert running.reserve_tokens.demand.expected_tokens == expected
    assert waiting.reserve_tokens.demand.expected_tokens == expected
    # 100 prompt + 366.7 expected tokens: 30 blocks at level 0 (no spread from one sample).
    assert reserved_blocks(control, "r0", 2.0) == 30
    # Its end gives back exactly what it holds now.
    running.status, running.usage = 200, {"completion_tokens": 700}
    control.finish(running, 3.0)
    assert reserved_blocks(control, "r0", 3.0) == 0


def test_a_request_that_ends_badly_gives_its_reservation_back_and_teaches_nothing() -> None:
    control = AdmissionControl(ControlConfig())
    c = ctx()
    control.attach(c, 100, 1000, 1100, 0)
    assert c.admission is not None
    c.admission.bind("r0", InFlight().hold("r0"))
    c.status, c.error = 200, "upstream_reset"  # the stream ended badly: not a length
    c.usage = {"completion_tokens": 3}
    control.finish(c, 1.0)
    assert control.lengths_view() == {}
    assert reserved_blocks(control, "r0", 1.0) == 0


def test_completion_length_from_usage_or_relayed_events() -> None:
    c = ctx()
    c.usage = {"completion_tokens": 42}
    assert completion_tokens(c) == 42
    c.usage = None
    assert completion_tokens(c) is None  # nothing was relayed

    class _Opened:
        head = [
            Event(Kind.PRELUDE, b"data: {}\n\n", None),
            Event(Kind.TOKEN, b"data: {}\n\n", None),
        ]

    c.stream.opened = _Opened()  # type: ignore[assignment]
    c.stream.events = 30  # 29 token events and [DONE] after the head
    assert completion_tokens(c) == 30


def test_fleet_admission_follows_every_snapshot_and_refuses_with_the_reason() -> None:
    gw = Gateway(
        GatewayConfig(replicas=[{"url": "http://127.0.0.1:1", "model": "m", "id": "r0"}]),
        access_log=False,
    )
    fleet = gw.fleet_admission
    assert fleet.control is not None  # adaptive is the default
    replica = gw.replicas.all()[0]
    view = ReplicaView("r0", replica.url, "m", "local", load=load(10.0, kv=0.97))
    fleet.on_snapshot(FleetSnapshot({"r0": view}, 10.0))  # the monitor's listener
    state = fleet.control.state("r0", 10.0)
    assert state is not None and state.kv_usage == 0.97
    for _ in range(20):  # learned: ~300-token outputs, far under max_tokens
        fleet.control.lengths.observe(("m", "default", "acme"), 1000, 300)
    c = ctx()
    fleet.control.attach(c, 100, 1000, 1100, 0)
    assert c.admission is not None
    c.admission.bind("r0", gw.ledger.hold("r0"))
    for _ in range(2):  # three in flight could outgrow the cache (3 x 69 of 199 blocks)
        more = ctx()
        fleet.control.attach(more, 100, 1000, 1100, 0)
        assert more.admission is not None
        more.admission.bind("r0", gw.ledger.hold("r0"))
    other = ctx()
    fleet.control.attach(other, 100, 1000, 1100, 0)
    reason = fleet.saturation(replica, view, now=10.0, need_tokens=other.reserve_tokens)
    assert reason is not None and "kv cache 97% used" in reason
    # Today's mode is one setting away and builds no controller.
    legacy = Gateway(
        GatewayConfig(
            replicas=[{"url": "http://127.0.0.1:1", "model": "m"}],
            admission={"mode": "reserve"},
        ),
        access_log=False,
    )
    assert legacy.fleet_admission.control is None
