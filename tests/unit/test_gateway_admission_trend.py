"""Admission reads the waiting queue over two scrapes: a one-scrape spike (a burst landing
at a step boundary) must not shed, a queue that stays must. Time is passed in."""

from seawall.config import AdmissionConfig
from seawall.fleet.view import EngineLoad, ReplicaView
from seawall.gateway.fleet_admission import FleetAdmission
from seawall.gateway.inflight import InFlight
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.metrics import Metrics


def guard_and_replica() -> tuple[FleetAdmission, Replica]:
    replicas = ReplicaSet(InFlight())
    replica = Replica("r0", "http://127.0.0.1:1", "m", "local")
    replicas.add(replica)
    return FleetAdmission(AdmissionConfig(), replicas, Metrics(process=False)), replica


def view(waiting: float, at: float) -> ReplicaView:
    load = EngineLoad(running=4, waiting=waiting, kv_usage=0.2, preemptions_total=0, scraped_at=at)
    return ReplicaView("r0", "http://127.0.0.1:1", "m", "local", load=load)


def test_one_scrape_spike_does_not_saturate() -> None:
    guard, replica = guard_and_replica()
    for t in range(5):
        assert guard.saturation(replica, view(0, t), now=t) is None
    assert guard.saturation(replica, view(20, 5), now=5) is None
    assert guard.saturation(replica, view(0, 6), now=6) is None


def test_a_queue_seen_in_two_scrapes_in_a_row_saturates() -> None:
    guard, replica = guard_and_replica()
    assert guard.saturation(replica, view(0, 0), now=0) is None
    first = guard.saturation(replica, view(20, 1), now=1)
    second = guard.saturation(replica, view(20, 2), now=2)
    assert first is None
    assert second is not None and "waiting" in second
