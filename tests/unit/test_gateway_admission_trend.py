"""Admission reads the waiting queue over two scrapes: a one-scrape spike (a burst landing
at a step boundary) must not shed, a queue that stays must. Time is passed in."""

from seawall.config import GatewayConfig
from seawall.fleet.view import EngineLoad, ReplicaView
from seawall.gateway.app import Gateway
from seawall.gateway.tenancy import TenancyGuard


def guard_and_replica() -> tuple[TenancyGuard, object]:
    gw = Gateway(
        GatewayConfig(replicas=[{"url": "http://127.0.0.1:1", "model": "m"}]), access_log=False
    )
    assert isinstance(gw.guard, TenancyGuard)
    return gw.guard, gw.replicas.all()[0]


def view(waiting: float, at: float) -> ReplicaView:
    load = EngineLoad(running=4, waiting=waiting, kv_usage=0.2, preemptions_total=0, scraped_at=at)
    return ReplicaView("r0", "http://127.0.0.1:1", "m", "local", load=load)


def test_one_scrape_spike_does_not_saturate() -> None:
    guard, replica = guard_and_replica()
    for t in range(5):
        assert guard.saturation(replica, view(0, t), now=t) is None  # type: ignore[arg-type]
    assert guard.saturation(replica, view(20, 5), now=5) is None  # type: ignore[arg-type]
    assert guard.saturation(replica, view(0, 6), now=6) is None  # type: ignore[arg-type]


def test_a_queue_seen_in_two_scrapes_in_a_row_saturates() -> None:
    guard, replica = guard_and_replica()
    assert guard.saturation(replica, view(0, 0), now=0) is None  # type: ignore[arg-type]
    first = guard.saturation(replica, view(20, 1), now=1)  # type: ignore[arg-type]
    second = guard.saturation(replica, view(20, 2), now=2)  # type: ignore[arg-type]
    assert first is None
    assert second is not None and "waiting" in second
