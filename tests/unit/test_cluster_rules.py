"""The pure rules of a fleet of instances: stepping down, fail-static, the fail-over
bound, passive outlier detection, and the view and report encodings (with their clock)."""

from __future__ import annotations

import dataclasses
import random

import orjson
import pytest

from seawall import clock
from seawall.cluster.report import InstanceReport, ReplicaReport, decode_report, encode_report
from seawall.config import ClusterConfig, ConfigError, parse_config
from seawall.fleet.published import (
    PublishedReplica,
    PublishedView,
    ViewClock,
    decode_view,
    encode_view,
    view_order,
)
from seawall.fleet.tracked import ReplicaSpec
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.gateway.inflight import InFlight
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.policy import outlier
from seawall.policy.leadership import failover_bound_s, must_step_down, standing

# ------------------------------------------------------------------------- leadership


def test_a_leader_stops_a_full_renew_interval_before_its_lease_can_expire() -> None:
    ttl, renew = 4.0, 1.0
    assert not must_step_down(
        now=102.9, last_renewed_at=100.0, lease_ttl_s=ttl, renew_interval_s=renew
    )
    assert must_step_down(now=103.0, last_renewed_at=100.0, lease_ttl_s=ttl, renew_interval_s=renew)
    assert must_step_down(now=0.0, last_renewed_at=None, lease_ttl_s=ttl, renew_interval_s=renew)


def test_the_promised_failover_bound_with_the_defaults_is_five_seconds() -> None:
    cc = ClusterConfig()
    assert failover_bound_s(cc.lease_ttl_s, cc.renew_interval_s) == 5.0


def test_standing() -> None:
    kw = {"store_error": "", "view_stale_s": 3.0}
    assert not standing(
        leading=True, now=10.0, store_failing_since=None, view_taken_at=None, **kw
    ).fail_static
    down = standing(leading=True, now=10.0, store_failing_since=8.5, view_taken_at=9.0, **kw)
    assert down.fail_static and "unreachable for 1.5 s" in down.reason
    fresh = standing(leading=False, now=10.0, store_failing_since=None, view_taken_at=7.5, **kw)
    assert not fresh.fail_static
    stale = standing(leading=False, now=10.0, store_failing_since=None, view_taken_at=6.9, **kw)
    assert stale.fail_static and "3.1 s old" in stale.reason
    never = standing(leading=False, now=10.0, store_failing_since=None, view_taken_at=None, **kw)
    assert never.fail_static and "no fleet view" in never.reason


# -------------------------------------------------------------------------- outliers

RULE = outlier.OutlierRule(
    consecutive_failures=3, ejection_s=5.0, max_ejection_s=12.0, max_ejected_fraction=0.5
)


def test_consecutive_failures_eject_and_a_success_resets() -> None:
    s = outlier.OutlierState()
    for _ in range(2):
        s, eject = outlier.observe(s, False, RULE)
        assert not eject
    s, _ = outlier.observe(s, True, RULE)
    assert s == outlier.OutlierState()
    for _ in range(2):
        s, eject = outlier.observe(s, False, RULE)
    s, eject = outlier.observe(s, False, RULE)
    assert eject and s.ejections == 1


def test_repeated_ejections_double_up_to_the_cap() -> None:
    assert [outlier.ejection_s(n, RULE) for n in (1, 2, 3, 4)] == [5.0, 10.0, 12.0, 12.0]


def test_never_the_only_replica_and_never_more_than_the_fraction() -> None:
    assert not outlier.may_eject(0, 1, RULE)
    assert outlier.may_eject(0, 2, RULE) and not outlier.may_eject(1, 2, RULE)
    assert outlier.may_eject(1, 4, RULE) and not outlier.may_eject(2, 4, RULE)


# ---------------------------------------------------------------------- the wire forms


def _view(epoch: int, seq: int, wall: float, scraped_at: float) -> PublishedView:
    spec = ReplicaSpec(
        "vllm-0", "http://10.0.0.7:8000", "m", "node-a", "vllm", "vllm-0", "ns", "u1"
    )
    load = EngineLoad(
        running=3, waiting=0, kv_usage=0.5, kv_capacity_tokens=1584, scraped_at=scraped_at
    )
    view = ReplicaView("vllm-0", spec.url, "m", "node-a", True, "ready", "", 0.9, load, held=True)
    return PublishedView(
        "a",
        epoch,
        seq,
        wall,
        0.0,
        (PublishedReplica(spec, view, restarts=2, failures=1, started_at=scraped_at - 60.0),),
        {"node-b": ("3 restarts within 3600 s",)},
        {"b": {"vllm-0": {"kv_blocks": 40}}},
    )


def test_a_view_travels_as_ages_and_lands_on_the_receivers_clock() -> None:
    # The leader's monotonic clock reads 500 when it publishes; it scraped at 499.25.
    raw = encode_view(_view(3, 7, wall=1_700_000_000.0, scraped_at=499.25), now=500.0)
    assert view_order(raw) == (3, 7)
    # The follower's monotonic clock is elsewhere entirely: 9000 when it receives it.
    got = decode_view(raw, ViewClock(), received_at=9000.0)
    [p] = got.replicas
    assert got.taken_at == 9000.0
    assert p.view.load is not None and p.view.load.scraped_at == 8999.25
    assert p.started_at == 8999.25 - 60.0
    assert p.spec.uid == "u1" and p.view.held and (p.restarts, p.failures) == (2, 1)
    assert got.cordons == {"node-b": ("3 restarts within 3600 s",)}
    assert got.quotas == {"b": {"vllm-0": {"kv_blocks": 40}}}
    assert got.snapshot().cordoned == frozenset({"node-b"})


def test_one_scrape_republished_maps_to_one_time_whatever_the_polling_delay() -> None:
    """Admission computes rates between scrapes: the same scrape seen in two views with
    different transit delays must not look like two scrapes."""
    clock = ViewClock()
    # Scraped at leader wall time 100.0; published at 100.5 and again at 101.5.
    first = decode_view(encode_view(_view(1, 1, 100.5, 0.0), now=0.5), clock, received_at=50.7)
    second = decode_view(encode_view(_view(1, 2, 101.5, 0.0), now=1.5), clock, received_at=51.6)
    a, b = first.replicas[0].view.load, second.replicas[0].view.load
    assert a is not None and b is not None
    assert b.scraped_at == pytest.approx(a.scraped_at - 0.1)  # the earliest receipt rules...
    third = decode_view(encode_view(_view(1, 3, 102.5, 0.0), now=2.5), clock, received_at=52.9)
    c = third.replicas[0].view.load
    assert c is not None and c.scraped_at == pytest.approx(b.scraped_at)  # ...and stays


def test_a_leader_whose_wall_clock_steps_back_resets_the_estimate() -> None:
    clock = ViewClock()
    assert clock.local_time(1, 100.0, 50.0) == 50.0
    assert clock.local_time(1, 90.0, 51.0) == 51.0  # 10 s back: not transit delay


def test_reports_round_trip_and_carry_the_demand_seam() -> None:
    report = InstanceReport(
        "b",
        "http://b:8081",
        "follower",
        3,
        9,
        1.5,
        {"r0": ReplicaReport(2, 1, 40, 1234, 0.05, 0.01, 0.1, {"kv_blocks_wanted": 12.0})},
        {"retry_spent": 3},
    )
    back = decode_report(encode_report(report))
    assert back == report and back.view_applied == (3, 9)


# ----------------------------------------- a follower's replica set, and its configuration


def _replica_set(n: int) -> tuple[ReplicaSet, list[Replica]]:
    rs = ReplicaSet(InFlight(), random.Random(0))
    replicas = [Replica(f"r{i}", f"http://127.0.0.1:{9000 + i}", "m", None) for i in range(n)]
    for r in replicas:
        rs.add(r)
    return rs, replicas


def test_a_follower_ejects_a_replica_its_requests_keep_failing_on() -> None:
    rs, (bad, good) = _replica_set(2)
    rs.outlier_rule = RULE
    for _ in range(3):
        bad.observe_outcome(False)
    now = clock.monotonic()
    assert not rs.usable(bad, now, FleetSnapshot()) and rs.usable(good, now, FleetSnapshot())
    assert bad.outlier_until - now == pytest.approx(5.0, abs=0.5)
    # The other one failing too is ejected no further: never more than half of a model.
    for _ in range(3):
        good.observe_outcome(False)
    assert rs.usable(good, now, FleetSnapshot())
    # On promotion the leader's probes judge instead: the ejections are lifted.
    rs.outlier_rule = None
    assert rs.usable(bad, now, FleetSnapshot())


def test_a_leader_or_a_single_instance_ejects_nothing_by_outliers() -> None:
    rs, (bad, _) = _replica_set(2)
    for _ in range(10):
        bad.observe_outcome(False)
    assert rs.usable(bad, clock.monotonic(), FleetSnapshot())


def test_the_cluster_section_resolves_secrets_and_refuses_incoherent_timings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REDIS_PASSWORD", "s3cret")
    cfg = parse_config(
        {"cluster": {"store": "redis", "redis_url": "redis://:${REDIS_PASSWORD}@r:6379/0"}}
    )
    assert cfg.cluster.enabled and cfg.cluster.redis_url == "redis://:s3cret@r:6379/0"
    assert not parse_config({}).cluster.enabled  # a single instance leads itself
    with pytest.raises(ConfigError, match="needs a shared store"):
        parse_config({"cluster": {"election": "kubernetes"}})
    with pytest.raises(ConfigError, match="at least twice"):
        parse_config({"cluster": {"store": "redis", "lease_ttl_s": 1.5, "renew_interval_s": 1.0}})
    with pytest.raises(ConfigError, match=r"cluster\.stroe: unknown field"):
        parse_config({"cluster": {"stroe": "redis"}})


def test_a_view_says_which_replicas_have_no_metrics_and_an_older_one_keeps_its_meaning() -> None:
    """Followers admit on a replica without a load only if the leader says its engine has
    no metrics; otherwise they wait for its first scrape. A view from a leader that
    predates the field meant "no load, admit on own counts", and keeps meaning it."""
    base = _view(1, 1, wall=1_700_000_000.0, scraped_at=499.0)
    [p] = base.replicas
    for no_metrics in (False, True):
        view = dataclasses.replace(p.view, load=None, no_metrics=no_metrics)
        raw = encode_view(
            dataclasses.replace(base, replicas=(dataclasses.replace(p, view=view),)), 500.0
        )
        [got] = decode_view(raw, ViewClock(), received_at=10.0).replicas
        assert got.view.load is None and got.view.no_metrics is no_metrics
    older = orjson.loads(raw)
    del older["replicas"][0]["view"]["no_metrics"]
    [got] = decode_view(orjson.dumps(older), ViewClock(), received_at=10.0).replicas
    assert got.view.no_metrics
