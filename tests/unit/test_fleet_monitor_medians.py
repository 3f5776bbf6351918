"""A replica's health score is judged against fleet medians at most `MEDIANS_TTL_S` old.

Each replica rescores itself at its own scrape and liveness probe (each second); the
fleet's medians (deep-probe latency, TTFT, ITL) are recomputed at most once a
`MEDIANS_TTL_S` for those, so that N replicas rescoring once a second cost O(N) a second
rather than O(N²) (`bench_scrape.py --fleet`). A full rescore (a deep probe's, a GPU
event's) recomputes them at once. Time is passed in (the monitor reads `clock`); the
gateway's observations come from a scripted `GatewaySignals` (no gateway runs here: the
monitor is never started, nothing is fetched).
"""

from __future__ import annotations

import pytest

from seawall import clock
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.monitor import MEDIANS_TTL_S, FleetMonitor
from seawall.fleet.signals import NoGatewaySignals, Observed
from seawall.fleet.tracked import ReplicaSpec


class ScriptedTtft(NoGatewaySignals):
    """The gateway's TTFT per replica, as the test sets it."""

    def __init__(self) -> None:
        self.ttft_s: dict[str, float] = {}

    def observed(self, replica_id: str) -> Observed:
        return Observed(ttft_p50_s=self.ttft_s.get(replica_id))


def test_a_replicas_own_rescore_follows_a_fleet_wide_change_within_the_medians_ttl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [1000.0]
    monkeypatch.setattr(clock, "monotonic", lambda: now[0])
    signals = ScriptedTtft()
    monitor = FleetMonitor(FleetMonitorConfig(), signals=signals)
    for i in range(3):
        spec = ReplicaSpec(f"r{i}", f"http://127.0.0.1:{9000 + i}", "m", engine="vllm")
        monitor._replicas[spec.replica_id] = monitor._new_replica(spec)
    slow = monitor._replicas["r0"]
    # r0 is ten times slower to a first token than the rest: an outlier.
    signals.ttft_s = {"r0": 1.0, "r1": 0.1, "r2": 0.1}
    monitor._rescore()
    assert slow.breakdown is not None and slow.breakdown.ttft < 1.0
    outlier = slow.breakdown.ttft

    # The whole fleet slows down to r0's pace: r0 is no outlier any more.
    signals.ttft_s = {"r0": 1.0, "r1": 1.0, "r2": 1.0}
    now[0] += MEDIANS_TTL_S / 2
    monitor._rescore(slow)  # its own scrape: the medians of half a TTL ago
    assert slow.breakdown is not None and slow.breakdown.ttft == outlier
    now[0] += MEDIANS_TTL_S / 2
    monitor._rescore(slow)  # a TTL after they were computed: the fleet's now
    assert slow.breakdown is not None and slow.breakdown.ttft == 1.0

    # A full rescore judges against the medians of the moment, however recent the last.
    signals.ttft_s = {"r0": 1.0, "r1": 0.1, "r2": 0.1}
    monitor._rescore()
    assert slow.breakdown is not None and slow.breakdown.ttft == outlier


def test_a_replica_added_meanwhile_is_in_the_next_medians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(clock, "monotonic", lambda: 1000.0)  # no time passes
    signals = ScriptedTtft()
    monitor = FleetMonitor(FleetMonitorConfig(), signals=signals)
    spec = ReplicaSpec("r0", "http://127.0.0.1:9000", "m", engine="vllm")
    first = monitor._replicas["r0"] = monitor._new_replica(spec)
    signals.ttft_s = {"r0": 1.0}
    monitor._rescore(first)
    assert first.breakdown is not None and first.breakdown.ttft == 1.0  # its own median
    for i in (1, 2):
        spec = ReplicaSpec(f"r{i}", f"http://127.0.0.1:{9000 + i}", "m", engine="vllm")
        monitor._replicas[spec.replica_id] = monitor._new_replica(spec)
        signals.ttft_s[spec.replica_id] = 0.1
    monitor._rescore(first)  # the fleet's size changed: medians recomputed at once
    assert first.breakdown is not None and first.breakdown.ttft < 1.0
