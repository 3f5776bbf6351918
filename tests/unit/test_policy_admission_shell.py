"""The gateway's shell around the adaptive controller (gateway/admission_control.py): how a
request's demand travels, how its reservation is bound and released once per replica, and
how a completion's length is read. No sockets: a Gateway object is built, not started."""

from __future__ import annotations

from typing import Any

from seawall.config import GatewayConfig
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.gateway.admission_control import (
    AdmissionControl,
    ReserveTokens,
    completion_tokens,
)
from seawall.gateway.app import Gateway
from seawall.gateway.proxy import RequestCtx
from seawall.gateway.tenancy import TenancyGuard
from seawall.policy.adaptive_admission import ControlConfig
from seawall.protocol.sse import Event, Kind

CAPACITY = 199 * 16


def ctx(model: str = "m") -> RequestCtx:
    from seawall.config import Timeouts

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


class _Opened:
    def __init__(self, body: bytes | None = None, head: list[Event] | None = None) -> None:
        self.body = body
        self.head = head or []


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


def test_a_reservation_is_bound_and_released_once_per_replica_and_teaches_the_length() -> None:
    control = AdmissionControl(ControlConfig())
    control.observe("r0", load(1.0), 1.0)
    c = ctx()
    control.attach(c, 100, 1000, 1100, 0)
    assert c.admission is not None
    c.admission.bind("r0")
    c.admission.bind("r0")  # a second bind of the same attempt changes nothing
    state = control.state("r0", 1.0)
    assert state is not None and state.reserved_blocks == 69
    c.status = 200
    body = b'{"usage": {"prompt_tokens": 100, "completion_tokens": 321}}'
    c.admission.release("r0", c, _Opened(body=body), 2.0)  # type: ignore[arg-type]
    c.admission.release("r0", c, _Opened(body=body), 2.0)  # type: ignore[arg-type]
    after = control.state("r0", 2.0)
    assert after is not None and after.reserved_blocks == 0
    assert control.lengths_view()["m/default/acme/<=1024"]["expected_tokens"] == 321
    assert control.lengths_view()["m/default/acme/<=1024"]["samples"] == 1


def test_failed_or_cut_attempts_release_without_teaching() -> None:
    control = AdmissionControl(ControlConfig())
    c = ctx()
    control.attach(c, 100, 1000, 1100, 0)
    assert c.admission is not None
    c.admission.bind("r0")
    c.status, c.error = 200, "upstream_reset"  # the stream ended badly: not a length
    c.admission.release("r0", c, _Opened(body=b'{"completion_tokens": 3}'), 1.0)  # type: ignore[arg-type]
    assert control.lengths_view() == {}
    state = control.state("r0", 1.0)
    assert state is not None and state.reserved_blocks == 0


def test_completion_length_from_usage_body_or_relayed_events() -> None:
    c = ctx()
    c.usage = {"completion_tokens": 42}
    assert completion_tokens(c, _Opened(body=None)) == 42  # type: ignore[arg-type]
    c.usage = None
    unary = _Opened(body=b'{"choices": [], "usage": {"completion_tokens": 7}}')
    assert completion_tokens(c, unary) == 7  # type: ignore[arg-type]
    token = Event(Kind.TOKEN, b"data: {}\n\n", None)
    prelude = Event(Kind.PRELUDE, b"data: {}\n\n", None)
    streamed = _Opened(body=None, head=[prelude, token])
    c.stream_events = 30  # 29 token events and [DONE] after the head
    assert completion_tokens(c, streamed) == 30  # type: ignore[arg-type]


def test_the_guard_feeds_every_snapshot_and_refuses_with_the_controllers_reason() -> None:
    gw = Gateway(
        GatewayConfig(replicas=[{"url": "http://127.0.0.1:1", "model": "m", "id": "r0"}]),
        access_log=False,
    )
    guard = gw.guard
    assert isinstance(guard, TenancyGuard) and guard.control is not None
    replica = gw.replicas.all()[0]
    view = ReplicaView("r0", replica.url, "m", "local", load=load(10.0, kv=0.97))
    guard._on_snapshot(FleetSnapshot({"r0": view}, 10.0))  # the monitor's listener
    state = guard.control.state("r0", 10.0)
    assert state is not None and state.kv_usage == 0.97
    c = ctx()
    guard.control.attach(c, 100, 1000, 1100, 0)
    assert c.admission is not None
    c.admission.bind("r0")
    other = ctx()
    guard.control.attach(other, 100, 1000, 1100, 0)
    reason = guard.saturation(replica, view, now=10.0, need_tokens=other.reserve_tokens)
    assert reason is not None and "kv cache 97% used" in reason
    # Today's mode is one setting away and does not build a controller.
    legacy = Gateway(
        GatewayConfig(
            replicas=[{"url": "http://127.0.0.1:1", "model": "m"}],
            admission={"mode": "reserve"},
        ),
        access_log=False,
    )
    assert isinstance(legacy.guard, TenancyGuard) and legacy.guard.control is None
