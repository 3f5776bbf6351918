"""The role manager step by step, over one `MemoryStore` whose clock the test steps (and
`seawall.clock.monotonic` stepped with it): who leads, what followers apply, fencing of a
deposed leader, fail-static and its recovery, drains that wait for every instance; and
the fleet monitor's roles (a follower's snapshot is the view; a promotion keeps every
state). The loops themselves run in tests/integration/test_cluster_fleet.py."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest

from seawall import clock
from seawall.cluster.report import InstanceReport, ReplicaReport
from seawall.cluster.roles import (
    ActHere,
    ForwardTo,
    NoLeader,
    Peers,
    RoleHooks,
    RoleManager,
)
from seawall.cluster.store import MemoryStore, StoreUnavailable
from seawall.config import ClusterConfig
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.monitor import FleetMonitor
from seawall.fleet.published import PublishedReplica, PublishedView
from seawall.fleet.tracked import ReplicaSpec
from seawall.fleet.view import EngineLoad, ReplicaView
from seawall.state.ledger import StoreLedger

TIMING = ClusterConfig(min_publish_interval_s=1e-9)  # the defaults; publish without delay


class Time:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.now = 1000.0
        monkeypatch.setattr(clock, "monotonic", lambda: self.now)

    def __call__(self) -> float:
        return self.now


class FlakyStore(MemoryStore):
    """A MemoryStore that can be made unreachable."""

    down = False

    def __getattribute__(self, name: str) -> Any:
        attr = super().__getattribute__(name)
        if name in _STORE_CALLS and super().__getattribute__("down"):

            async def refuse(*args: object, **kwargs: object) -> Any:
                raise StoreUnavailable("connection refused")

            return refuse
        return attr


_STORE_CALLS = frozenset(
    {"acquire", "release", "leader", "heartbeat", "members", "put", "get", "append", "range"}
)


@dataclass
class Hooks:
    """What the composition root would do, recorded."""

    name: str
    applied: list[PublishedView] = field(default_factory=list)
    roles: list[str] = field(default_factory=list)
    inflight: dict[str, ReplicaReport] = field(default_factory=dict)

    async def promote(self) -> None:
        self.roles.append("leader")

    async def demote(self) -> None:
        self.roles.append("follower")

    def export(
        self, leader: str, epoch: int, seq: int, wall: float, quotas: Mapping[str, Any]
    ) -> PublishedView:
        return PublishedView(leader, epoch, seq, wall, clock.monotonic(), (), {}, dict(quotas))

    def hooks(self) -> RoleHooks:
        return RoleHooks(
            promote=self.promote,
            demote=self.demote,
            apply_view=self.applied.append,
            export_view=self.export,
            replica_reports=lambda: dict(self.inflight),
            admin_url=lambda: f"http://{self.name}:8081",
            quotas=lambda reports: {n: {"r0": 10} for n in reports},
        )


def _manager(name: str, store: MemoryStore) -> tuple[RoleManager, Hooks]:
    h = Hooks(name)
    return RoleManager(instance=name, store=store, elector=None, hooks=h.hooks(), timing=TIMING), h


async def test_one_leads_the_others_follow_its_view(monkeypatch: pytest.MonkeyPatch) -> None:
    t = Time(monkeypatch)
    store = MemoryStore(t)
    (a, ha), (b, hb) = _manager("a", store), _manager("b", store)
    await a._elect()
    await b._elect()
    assert (a.leading, b.leading) == (True, False) and ha.roles == ["leader"]
    assert a.operator_route() == ActHere()
    assert b.operator_route() == ForwardTo("http://a:8081", "a")
    await a._beat()
    await b._beat()
    await a._beat()  # a now sees b
    assert (a.instance_count(), b.instance_count()) == (2, 2)

    a.changed()
    await a._publish_when_due()
    await b._follow_once()
    [view] = hb.applied
    assert (view.leader, view.epoch, view.seq) == ("a", 1, 1)
    assert b.quotas() == {"r0": 10}  # the seam: the leader's grant for b
    await b._follow_once()
    assert len(hb.applied) == 1  # the same view is applied once
    assert not b.status().fail_static


async def test_a_new_leader_after_the_ttl_and_the_old_one_is_fenced_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = Time(monkeypatch)
    store = MemoryStore(t)
    (a, ha), (b, hb) = _manager("a", store), _manager("b", store)
    await a._elect()
    a.changed()
    await a._publish_when_due()
    await b._elect()
    await b._follow_once()
    # a stalls (its loop blocked): no renewal. Its lease runs out on the store's clock.
    t.now += TIMING.lease_ttl_s
    await b._elect()
    assert b.leading and b.epoch == a.epoch + 1 and hb.roles == ["leader"]
    b.changed()
    await b._publish_when_due()
    # a wakes up still believing it leads and publishes what it had: refused, demoted.
    a.changed()
    await a._publish_when_due()
    assert not a.leading and ha.roles == ["leader", "follower"]
    raw = await store.get("fleet:view")
    assert raw is not None
    await a._follow_once()
    assert ha.applied[-1].leader == "b"


async def test_a_leader_that_cannot_renew_steps_down_before_its_lease_could_expire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = Time(monkeypatch)
    store = FlakyStore(t)
    (a, ha), (b, _) = _manager("a", store), _manager("b", store)
    await a._elect()
    await b._elect()
    await b._follow_once()
    await a._beat()
    await b._beat()
    await a._beat()
    store.down = True
    await a._beat()
    await b._beat()
    for s in (a.status(), b.status()):
        assert s.fail_static and "cluster store unreachable" in s.reason
    assert isinstance(b.operator_route(), NoLeader)
    t.now += 2.9
    await a._elect()
    assert a.leading  # 2.9 s without renewal: still inside lease_ttl_s - renew_interval_s
    t.now += 0.1
    await a._elect()
    assert not a.leading and ha.roles == ["leader", "follower"]
    # The store comes back: nothing restarts, the loops simply succeed again.
    assert (a.instance_count(), b.instance_count()) == (2, 2)  # the last known count
    store.down = False
    t.now += 5.0  # every membership has expired meanwhile, as in a restarted Redis
    await b._elect()
    await a._elect()
    await b._beat()
    assert b.instance_count() == 2  # a has not heartbeated yet: not news
    await a._beat()
    assert b.leading and not a.leading
    b.changed()
    await b._publish_when_due()
    await a._follow_once()
    assert not a.status().fail_static and not b.status().fail_static


async def test_a_follower_whose_view_stops_changing_is_fail_static(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = Time(monkeypatch)
    store = MemoryStore(t)
    (a, _), (b, _) = _manager("a", store), _manager("b", store)
    await a._elect()
    a.changed()
    await a._publish_when_due()
    await b._elect()
    await b._follow_once()
    assert not b.status().fail_static
    t.now += TIMING.view_stale_s + 0.1  # no new view: the leader stopped publishing
    status = b.status()
    assert status.fail_static and "no leader publishing" in status.reason
    assert status.view_age_s == pytest.approx(TIMING.view_stale_s + 0.1)


# ------------------------------------------------------------------ fleet-wide drains


def _report(name: str, applied: tuple[int, int], requests: int) -> InstanceReport:
    return InstanceReport(
        name, view_epoch=applied[0], view_seq=applied[1], replicas={"r0": ReplicaReport(requests)}
    )


async def test_a_drain_waits_for_every_instance_to_see_the_change_and_to_be_idle() -> None:
    needed = (3, 8)  # the first view published after r0 left routing
    peers = Peers(needed=lambda: needed)
    # b has nothing on r0, but has not applied that view yet: it might still send some.
    peers.update({"b": _report("b", (3, 7), 0), "c": _report("c", (3, 8), 2)}, 0.0)
    waiting = asyncio.ensure_future(peers.wait_idle("r0", clock.monotonic() + 10))
    await asyncio.sleep(0)
    peers.update({"b": _report("b", (3, 8), 1), "c": _report("c", (3, 8), 1)}, 0.0)
    await asyncio.sleep(0)
    assert not waiting.done()
    peers.update({"b": _report("b", (3, 8), 0), "c": _report("c", (3, 8), 0)}, 0.0)
    assert await asyncio.wait_for(waiting, 5) == 0
    # At the deadline it answers with what is still in flight.
    peers.update({"b": _report("b", (3, 8), 2)}, 0.0)
    assert await peers.wait_idle("r0", clock.monotonic() - 1) == 2


async def test_an_instance_that_may_not_lead_never_takes_the_lease(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`may_lead: false` (an instance with no actuator): it follows, even with nobody
    leading, and forwards operator actions to whoever takes the lease later."""
    t = Time(monkeypatch)
    store = MemoryStore(t)
    h = Hooks("f")
    follower = RoleManager(
        instance="f",
        store=store,
        elector=None,
        hooks=h.hooks(),
        timing=TIMING.model_copy(update={"may_lead": False}),
    )
    await follower._elect()
    assert not follower.leading and await store.leader() is None and h.roles == []
    assert isinstance(follower.operator_route(), NoLeader)
    (a, _) = _manager("a", store)
    await a._elect()
    await follower._elect()
    assert a.leading and follower.operator_route() == ForwardTo("http://a:8081", "a")
    await a.stop()  # hands the lease back: still nobody else takes it
    await follower._elect()
    assert not follower.leading and await store.leader() is None


async def test_a_draining_instance_keeps_its_lease_but_takes_no_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = Time(monkeypatch)
    store = MemoryStore(t)
    (a, _), (b, _), (c, _) = _manager("a", store), _manager("b", store), _manager("c", store)
    await a._elect()
    a.withdraw()  # the leader drains: it keeps renewing while it drains
    t.now += TIMING.lease_ttl_s - TIMING.renew_interval_s / 2
    await a._elect()
    t.now += TIMING.renew_interval_s
    await b._elect()
    assert a.leading and not b.leading
    b.withdraw()  # b drains too; when a leaves, the lease goes to c, which stays
    await a.stop()
    await b._elect()
    await c._elect()
    assert not b.leading and c.leading


async def test_reports_carry_extra_figures_and_the_leader_can_wait_for_fresh_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    t = Time(monkeypatch)
    wall = [5000.0]
    monkeypatch.setattr(clock, "wall", lambda: wall[0])
    store = MemoryStore(t)
    (a, _), (b, _) = _manager("a", store), _manager("b", store)
    b.hooks = dataclasses.replace(b.hooks, report_extra=lambda: {"streams_dropped": 2})
    await b._beat()
    await a._beat()
    assert a.peers.reports["b"].extra == {"streams_dropped": 2}
    # Figures as of a later moment: not in until b reports again.
    waiting = asyncio.ensure_future(a.peers.wait_reports_since(5001.0, clock.monotonic() + 10))
    await asyncio.sleep(0)
    assert not waiting.done()
    wall[0] = 5001.5
    await b._beat()
    await a._beat()
    assert await asyncio.wait_for(waiting, 5) is True
    assert await a.peers.wait_reports_since(6000.0, clock.monotonic() - 1) is False


def test_peers_remember_when_each_instance_was_last_seen() -> None:
    """What a new leader counts a departed instance's holds from (policy.quota.inherit)."""
    peers = Peers()
    peers.update({"b": InstanceReport("b"), "c": InstanceReport("c")}, 10.0)
    peers.update({"b": InstanceReport("b")}, 11.0)
    assert peers.last_seen == {"b": 11.0, "c": 10.0}  # c has left; its sighting stays
    peers.update({"b": InstanceReport("b")}, 10.0 + 601.0)
    assert peers.last_seen == {"b": 611.0}  # long gone: forgotten


def test_chunks_relayed_never_go_down_when_an_instance_leaves() -> None:
    peers = Peers()
    r = {"r0": ReplicaReport(chunks_relayed=500)}
    peers.update({"b": InstanceReport("b", replicas=r), "c": InstanceReport("c", replicas=r)}, 0.0)
    assert peers.chunks_relayed_total("r0") == 1000
    peers.update(
        {"b": InstanceReport("b", replicas={"r0": ReplicaReport(chunks_relayed=510)})}, 0.0
    )
    assert peers.chunks_relayed_total("r0") == 1010


# ------------------------------------------------------------------- the monitor's roles

SPEC = ReplicaSpec("r0", "http://127.0.0.1:9", "m", "node-a")
SPEC_DRAINING = ReplicaSpec("r1", "http://127.0.0.1:9", "m", "node-b")


def _published(state: str, routable: bool, spec: ReplicaSpec = SPEC) -> PublishedReplica:
    view = ReplicaView(spec.replica_id, spec.url, "m", spec.domain, routable, state, "why")
    return PublishedReplica(spec, view, restarts=1, started_at=clock.monotonic() - 30.0)


async def test_a_follower_monitor_shows_the_view_and_a_promotion_keeps_every_state() -> None:
    store = MemoryStore()
    lease = await store.acquire("b", "", 10.0)
    assert lease is not None
    monitor = FleetMonitor(
        FleetMonitorConfig(), ledger=StoreLedger(store, lambda: lease.epoch), leading=False
    )
    await monitor.start()
    try:
        monitor.add_replica(SPEC)
        monitor.add_replica(SPEC_DRAINING)
        assert monitor.snapshot().replicas == {}  # nothing judged here: no view yet
        view = PublishedView(
            "a",
            1,
            5,
            0.0,
            clock.monotonic(),
            (_published("ready", True), _published("draining", False, SPEC_DRAINING)),
            {"node-c": ("3 restarts within 3600 s",)},
        )
        monitor.apply_view(view)
        snap = monitor.snapshot()
        assert snap.replicas["r0"].routable and not snap.replicas["r1"].routable
        assert snap.cordoned == frozenset({"node-c"})
        assert all(rep.tasks == [] for rep in monitor._replicas.values())  # no probes

        await monitor.lead()
        snap = monitor.snapshot()
        # A ready replica does not drop to `starting` because leadership moved.
        assert snap.replicas["r0"].routable and snap.replicas["r0"].state == "ready"
        assert monitor._replicas["r1"].action_kind == "drain"  # the drain goes on here
        assert all(len(rep.tasks) == 3 for rep in monitor._replicas.values())
        assert monitor._replicas["r0"].restarts == 1

        monitor.follow()
        assert all(rep.tasks == [] for rep in monitor._replicas.values())
    finally:
        await monitor.stop()


async def test_a_view_held_past_its_freshness_keeps_its_states_but_not_its_readings() -> None:
    monitor = FleetMonitor(
        FleetMonitorConfig(), ledger=StoreLedger(MemoryStore(), lambda: 0), leading=False
    )
    await monitor.start()
    try:
        monitor.add_replica(SPEC)
        old = clock.monotonic() - 60.0  # scraped a minute ago by a leader now gone
        load = EngineLoad(
            running=9,
            waiting=40,
            kv_usage=0.97,
            kv_capacity_tokens=1584,
            kv_block_size=16,
            scraped_at=old,
        )
        view = ReplicaView(
            "r0", SPEC.url, "m", "node-a", True, "ready", "", 0.5, load, saturated=True
        )
        monitor.apply_view(PublishedView("a", 1, 1, 0.0, old, (PublishedReplica(SPEC, view),)))
        monitor.hold_view()
        held = monitor.snapshot().replicas["r0"]
        assert held.routable and held.state == "ready" and held.score == 0.5
        assert not held.saturated  # a minute-old queue says nothing about now
        assert held.load is not None
        assert (held.load.kv_capacity_tokens, held.load.kv_block_size) == (1584, 16)
        assert held.load.kv_usage is None and held.load.waiting is None
        assert clock.monotonic() - held.load.scraped_at < 1.0
    finally:
        await monitor.stop()
