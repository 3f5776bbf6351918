"""Quotas in the gateway (gateway/fleet_quota.py, gateway/fleet_admission.py): what the
leader issues from the instances' reports, and how one instance admits against its own
grant. No sockets: the parts are built and called with literal loads and times."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

from seawall.cluster.report import (
    KV_HELD,
    KV_WANTED,
    InstanceReport,
    ReplicaReport,
    decode_report,
    encode_report,
)
from seawall.config import AdmissionConfig
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.gateway.fleet_admission import NO_GRANT, FleetAdmission
from seawall.gateway.fleet_quota import KV, SEQS, Grants, QuotaIssuer, parse_entry
from seawall.gateway.inflight import InFlight
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.metrics import Metrics

MODEL = "m"
CACHE = 159  # blocks of 16 tokens
NOW = 100.0


def _load() -> EngineLoad:
    return EngineLoad(
        running=0,
        waiting=0,
        kv_usage=0.1,
        preemptions_total=0,
        generation_tokens_total=0,
        kv_capacity_tokens=CACHE * 16,
        kv_block_size=16,
        scraped_at=NOW,
    )


class Fleet:
    """One replica, its ledger and fleet admission, with a view entry the test sets."""

    def __init__(self, **admission: Any) -> None:
        self.ledger = InFlight()
        self.replicas = ReplicaSet(self.ledger, random.Random(0))
        self.replica = Replica("r0", "http://127.0.0.1:9", MODEL, "n0")
        self.replicas.add(self.replica)
        view = ReplicaView("r0", "", MODEL, "n0", load=_load())
        snap = FleetSnapshot({"r0": view}, NOW)
        self.replicas.snapshot = lambda: snap
        self.view = view
        self.admission = FleetAdmission(
            AdmissionConfig.model_validate(admission), self.replicas, Metrics()
        )
        self.entry: Any = None
        self.cut_off_share: float | None = None  # the store unreachable: an even share

    def clustered(self) -> Fleet:
        self.admission.use_grants(Grants(lambda: self.entry, lambda: self.cut_off_share))
        return self

    def why(self, tokens: int) -> str | None:
        return self.admission.saturation(self.replica, self.view, NOW, tokens)


def test_an_entry_is_parsed_once_per_view() -> None:
    entry = {"r0": {KV: [53, 159, 60], SEQS: [2, 8, 2]}, "r1": {KV: [159, 159, 0]}}
    seen = [entry]
    grants = Grants(lambda: seen[0])
    g = grants.get("r0")
    assert g is not None and (g.kv_blocks, g.kv_of, g.seqs, g.seqs_of) == (53, 159, 2, 8)
    assert g.kv_shared and abs(g.kv_share - 53 / 159) < 1e-9
    whole = grants.get("r1")
    assert whole is not None and not whole.kv_shared and whole.kv_share == 1.0
    assert grants.get("r0") is g  # the same view: not parsed again
    seen[0] = {"r0": {KV: [10, 159, 10]}}
    new = grants.get("r0")
    assert new is not None and new.kv_blocks == 10 and new.seqs is None
    assert parse_entry("garbage") == {} and parse_entry({"r0": {KV: "x"}})["r0"].kv_blocks is None


def test_alone_a_gateway_reserves_against_the_whole_cache_as_before() -> None:
    fleet = Fleet(mode="reserve")
    assert fleet.why(2048) is None  # nothing in flight: the engine queues what does not fit
    for _ in range(12):
        fleet.ledger.hold("r0", 13)
    assert fleet.why(48) is None  # 156 + 3 = 159
    assert "kv_reserve_max" in (fleet.why(64) or "")


def test_before_its_first_grant_an_instance_admits_nothing_and_says_why() -> None:
    fleet = Fleet(mode="reserve").clustered()
    assert fleet.why(16) == NO_GRANT
    fleet.entry = {"other-replica": {KV: [100, 159, 100]}}
    assert fleet.why(16) == NO_GRANT


def test_cut_off_from_the_store_before_a_grant_an_instance_admits_within_an_even_share() -> None:
    fleet = Fleet(mode="reserve", inflight_max=8).clustered()
    assert fleet.why(16) == NO_GRANT  # the store answers: a grant is on its way
    fleet.cut_off_share = 1 / 3  # the store is gone, three instances were last known
    assert fleet.why(53 * 16) is None  # a third of the 159 blocks
    why = fleet.why(54 * 16)
    assert why is not None and "over its grant of 53 of the replica's 159" in why
    for _ in range(2):
        fleet.ledger.hold("r0", 1)
    assert "share of 2 of the replica's 8" in (fleet.why(16) or "")  # a third of 8
    # An empty grant (a join the leader had not finished handing over) is no grant.
    fleet.entry = {"r0": {KV: [0, 159, 0], SEQS: [0, 8, 0]}}
    assert "share of 2 of the replica's 8" in (fleet.why(16) or "")  # the even share
    fleet.cut_off_share = None
    assert fleet.why(16) is not None  # the store answers: the grant is on its way
    fleet.cut_off_share = 1 / 3
    # A grant the leader did issue is kept as it was, whatever the even share says.
    fleet.entry = {"r0": {KV: [100, 159, 100], SEQS: [6, 8, 2]}}
    assert fleet.why(16) is None


def test_an_instance_reserves_within_its_grant_even_with_nothing_in_flight() -> None:
    fleet = Fleet(mode="reserve").clustered()
    fleet.entry = {"r0": {KV: [53, 159, 53]}}
    assert fleet.why(53 * 16) is None
    why = fleet.why(54 * 16)
    assert why is not None and "over its grant of 53 of the replica's 159" in why
    for _ in range(4):
        fleet.ledger.hold("r0", 13)  # 52 of 53
    assert fleet.why(16) is None
    assert fleet.why(17) is not None
    # The whole replica granted (the only instance): as alone.
    fleet.entry = {"r0": {KV: [159, 159, 52]}}
    assert fleet.why(107 * 16) is None
    assert fleet.why(108 * 16) is not None


def test_an_instance_holds_its_share_of_inflight_max() -> None:
    fleet = Fleet(mode="reserve", inflight_max=8).clustered()
    fleet.entry = {"r0": {KV: [159, 159, 0]}}
    assert fleet.why(16) == NO_GRANT  # no share of the sequences yet
    fleet.entry = {"r0": {KV: [159, 159, 0], SEQS: [3, 8, 3]}}
    for _ in range(2):
        fleet.ledger.hold("r0", 1)
    assert fleet.why(16) is None
    fleet.ledger.hold("r0", 1)
    why = fleet.why(16)
    assert why is not None and "its share of 3 of the replica's 8 (inflight_max)" in why


def test_adaptive_admission_judges_its_reservations_against_its_share() -> None:
    fleet = Fleet(mode="adaptive").clustered()
    assert fleet.why(16) == NO_GRANT
    fleet.entry = {"r0": {KV: [53, 159, 53]}}
    # Nothing of ours in flight, yet a share: a request over it is refused (alone, the
    # whole replica's controller would have admitted it).
    why = fleet.why(60 * 16)
    assert why is not None and "33% share" in why, why
    assert fleet.why(50 * 16) is None
    control = fleet.admission.control
    assert control is not None and abs(control.quota_of("r0") - 53 / 159) < 1e-9


def test_demand_counts_what_is_held_queued_and_lately_refused() -> None:
    fleet = Fleet(mode="reserve")
    fleet.ledger.hold("r0", 13)
    # Two requests of 200 tokens waiting in the queue; two refused, one too long ago.
    fleet.admission._queued[MODEL] = Counter({200: 2})
    fleet.admission._refused.append((NOW - 9.0, MODEL, 100))
    fleet.admission._refused.append((NOW - 0.5, MODEL, 100))
    d = fleet.admission.demand(fleet.replica, NOW)
    assert d[KV_HELD] == 13 and d[KV_WANTED] == 13 + 2 * 13 + 7
    assert d["seqs_held"] == 1 and d["seqs_wanted"] == 1 + 2 + 1


def _report(name: str, view: tuple[int, int], held: float, wanted: float) -> InstanceReport:
    r = ReplicaReport(requests=1, demand={KV_HELD: held, KV_WANTED: wanted})
    report = InstanceReport(name, view_epoch=view[0], view_seq=view[1], replicas={"r0": r})
    return decode_report(encode_report(report))  # as the leader reads it from the store


def test_the_leader_divides_by_the_reports_and_a_successor_inherits_the_holds() -> None:
    issuer = QuotaIssuer(lambda: {"r0": {KV: 159}}, release_after_s=6.0)
    reports = {n: _report(n, (0, 0), 0, 300) for n in ("a", "b", "c")}
    out = issuer.issue(reports, (1, 1), NOW, {})
    assert {n: e["r0"][KV] for n, e in out.items()} == {n: [53, 159, 53] for n in "abc"}
    assert issuer.figures()["r0"][KV]["exposed"] == 159
    # A new leader (reset) with the view above: a and b want little now, but until they
    # confirm a view of the new leader's, c cannot grow into what they held.
    successor = QuotaIssuer(lambda: {"r0": {KV: 159}}, release_after_s=6.0)
    reports = {"a": _report("a", (1, 1), 5, 5), "b": _report("b", (1, 1), 5, 5)}
    reports["c"] = _report("c", (1, 1), 53, 300)
    out2 = successor.issue(reports, (2, 2), NOW, out)
    assert out2["c"]["r0"][KV][0] == 53
    assert out2["a"]["r0"][KV][0] < 53 and out2["a"]["r0"][KV][2] == 53  # shrunk, held
    reports = {
        n: _report(n, (2, 2), r.replicas["r0"].demand[KV_HELD], 0) for n, r in reports.items()
    }
    reports["c"] = _report("c", (2, 2), 53, 300)
    out3 = successor.issue(reports, (2, 3), NOW + 1, out2)
    assert out3["c"]["r0"][KV][0] > 100
    assert sum(e["r0"][KV][2] for e in out3.values()) <= 159
