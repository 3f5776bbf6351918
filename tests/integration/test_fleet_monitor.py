"""The fleet monitor against real `seawall sim` processes: what users see when engines fail.

`RespawnActuator` stands in for the local supervisor (`seawall.actuate.local`, built
separately): it restarts a replica by stopping its sim process and starting a fresh one
on the same port, which is all the monitor needs from an actuator here. Intervals are
short through the config; every wait is bounded by a deadline, never asserted on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from seawall.actuate.base import Evidence, ReplicaRef
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.monitor import FleetMonitor, Observed, ReplicaSpec
from seawall.fleet.view import FleetSnapshot
from seawall.metrics import Metrics
from tests.support.procs import Proc, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration

DEADLINE_S = 30.0


def fast_config(tmp_path: Path, **overrides: Any) -> FleetMonitorConfig:
    values: dict[str, Any] = {
        "liveness_interval_s": 0.2,
        "liveness_timeout_s": 0.5,
        "scrape_interval_s": 0.2,
        "scrape_timeout_s": 0.5,
        "deep_probe_interval_s": 0.3,
        "deep_probe_idle_interval_s": 0.3,
        "deep_probe_timeout_s": 0.5,
        "watchdog_window_s": 1.0,
        "startup_allowance_s": 60.0,
        "ledger_path": str(tmp_path / "ledger.sqlite"),
    }
    values.update(overrides)
    return FleetMonitorConfig.model_validate(values)


@dataclass
class RespawnActuator:
    """Restarts a replica by respawning its sim on the same port (see module docstring)."""

    artifacts: Path
    procs: dict[str, Proc] = field(default_factory=dict)
    extra_args: tuple[str, ...] = ()
    restarts: list[tuple[str, str]] = field(default_factory=list)
    cordons: list[Evidence] = field(default_factory=list)
    uncordons: list[str] = field(default_factory=list)
    name: str = "respawn"

    def start(self, replica_id: str, port: int, *extra: str) -> Proc:
        n = sum(1 for r, _ in self.restarts if r == replica_id)
        proc = spawn(
            seawall_argv("sim", "--port", str(port), "--model", "m", "--enable-faults", *extra),
            self.artifacts / f"{replica_id}-{n}.log",
            port,
        )
        self.procs[replica_id] = proc
        return proc

    async def restart(self, replica: ReplicaRef, reason: str) -> bool:
        self.restarts.append((replica.replica_id, reason))
        old = self.procs[replica.replica_id]
        await asyncio.to_thread(old.stop, 2.0)
        assert old.port is not None
        self.start(replica.replica_id, old.port, *self.extra_args)
        return True

    async def stop(self, replica: ReplicaRef, grace_s: float) -> None:
        await asyncio.to_thread(self.procs[replica.replica_id].stop, grace_s)

    async def cordon(self, node: str, evidence: Evidence) -> None:
        self.cordons.append(evidence)

    async def uncordon(self, node: str) -> None:
        self.uncordons.append(node)

    async def close(self) -> None:
        for proc in self.procs.values():
            proc.stop(2.0)


@pytest.fixture
def actuator(artifacts: Path) -> Iterator[RespawnActuator]:
    act = RespawnActuator(artifacts)
    yield act
    for proc in act.procs.values():
        proc.stop(2.0)


def start_sim(act: RespawnActuator, replica_id: str = "r0", *extra: str) -> ReplicaSpec:
    proc = act.start(replica_id, free_port(), *extra)
    if not extra:
        wait_http(proc.url + "/health", proc=proc)
    return ReplicaSpec(replica_id, proc.url, model="m", node="n1", engine="vllm")


async def fault(url: str, body: dict[str, Any]) -> None:
    async with (
        aiohttp.ClientSession() as s,
        s.post(url + "/sim/fault", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()


async def until(check: Callable[[], bool], what: str, deadline_s: float = DEADLINE_S) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)


def view_of(monitor: FleetMonitor, rid: str = "r0") -> Any:
    return monitor.snapshot().replicas.get(rid)


def routable(monitor: FleetMonitor, rid: str = "r0") -> bool:
    v = view_of(monitor, rid)
    return v is not None and v.routable


def taken_out(snapshots: list[FleetSnapshot], rid: str = "r0") -> bool:
    """Some published snapshot showed the replica restarting and out of routing."""
    return any(
        s.replicas[rid].state == "restarting" and not s.replicas[rid].routable for s in snapshots
    )


def described(monitor: FleetMonitor, rid: str = "r0") -> dict[str, Any]:
    return next(r for r in monitor.describe()["replicas"] if r["id"] == rid)


async def test_a_dead_engine_leaves_routing_at_the_first_failed_liveness_probe(
    tmp_path: Path, actuator: RespawnActuator
) -> None:
    spec = start_sim(actuator)
    snapshots: list[FleetSnapshot] = []
    async with FleetMonitor(fast_config(tmp_path), [spec]) as monitor:
        monitor.subscribe(snapshots.append)
        await until(lambda: routable(monitor), "replica ready")
        await fault(spec.url, {"kind": "engine_dead", "grace_s": 30})
        await until(lambda: not routable(monitor), "replica unroutable")
        first_out = next(s.replicas["r0"] for s in snapshots if not s.replicas["r0"].routable)
        # The very first failed probe took it out: within one liveness interval.
        assert first_out.reason == "liveness failed (http_503), 1 in a row"
        await until(lambda: view_of(monitor).state == "starting", "restart ordered")


async def test_hang_with_the_running_gauge_kept_is_caught_by_the_engine_view(
    tmp_path: Path, actuator: RespawnActuator
) -> None:
    spec = start_sim(actuator)
    config = fast_config(tmp_path, deep_probe_failures_threshold=10)
    async with FleetMonitor(config, [spec], actuator=actuator) as monitor:
        snapshots: list[FleetSnapshot] = []
        monitor.subscribe(snapshots.append)
        await until(lambda: routable(monitor), "replica ready")
        stream = asyncio.create_task(long_stream(spec.url))
        try:
            await until(
                lambda: (
                    (view_of(monitor).load or None) is not None
                    and (view_of(monitor).load.running or 0) >= 1
                ),
                "a request running",
            )
            await fault(spec.url, {"kind": "hang", "running": "keep"})
            await until(lambda: bool(actuator.restarts), "restart requested")
        finally:
            stream.cancel()
        [(rid, reason)] = actuator.restarts
        assert taken_out(snapshots)
        assert rid == "r0"
        assert reason.startswith("no progress with work in flight: engine reports 1 running")
        await until(lambda: routable(monitor), "back after the restart")


async def test_hang_with_running_zero_is_caught_through_the_gateway_view(
    tmp_path: Path, actuator: RespawnActuator
) -> None:
    class OpenStreamNoChunks:
        """The gateway holds one stream open to r0 and relays nothing."""

        hung = False

        def streams_in_flight(self, replica_id: str) -> int:
            return 1 if self.hung else 0

        def chunks_relayed_total(self, replica_id: str) -> int:
            return 7

        def observed(self, replica_id: str) -> Observed:
            return Observed()

    signals = OpenStreamNoChunks()
    spec = start_sim(actuator)
    config = fast_config(tmp_path, deep_probe_failures_threshold=10)
    async with FleetMonitor(config, [spec], actuator=actuator, signals=signals) as monitor:
        snapshots: list[FleetSnapshot] = []
        monitor.subscribe(snapshots.append)
        await until(lambda: routable(monitor), "replica ready")
        await fault(spec.url, {"kind": "hang", "running": "zero"})
        signals.hung = True
        await until(lambda: bool(actuator.restarts), "restart requested")
        signals.hung = False
        [(_, reason)] = actuator.restarts
        assert taken_out(snapshots)
        assert "gateway has 1 streams in flight with no chunk relayed" in reason
        assert "engine reports 0 running" in reason


async def test_an_idle_hang_is_taken_out_by_deep_probes_and_restarted(
    tmp_path: Path, actuator: RespawnActuator
) -> None:
    spec = start_sim(actuator)
    config = fast_config(tmp_path, deep_probe_failures_threshold=2)
    async with FleetMonitor(config, [spec], actuator=actuator) as monitor:
        snapshots: list[FleetSnapshot] = []
        monitor.subscribe(snapshots.append)
        await until(lambda: routable(monitor), "replica ready")
        await fault(spec.url, {"kind": "hang", "running": "keep"})
        await until(lambda: view_of(monitor).state == "degraded", "degraded")
        assert view_of(monitor).score < 0.25  # routed at a quarter weight at most
        await until(lambda: bool(actuator.restarts), "restart requested")
        [(_, reason)] = actuator.restarts
        assert taken_out(snapshots)
        assert reason.startswith("deep probes still failing while degraded")


async def test_a_loading_replica_is_not_restarted(
    tmp_path: Path, actuator: RespawnActuator
) -> None:
    spec = start_sim(actuator, "r0", "--load-time", "60")
    config = fast_config(tmp_path, startup_allowance_s=120)
    async with FleetMonitor(config, [spec], actuator=actuator) as monitor:
        await until(lambda: described(monitor)["liveness"]["probes"] >= 10, "10 liveness probes")
        assert described(monitor)["state"] == "starting"
        assert described(monitor)["liveness"]["last_error"] == "connect"  # still loading
        assert not routable(monitor)
        assert actuator.restarts == []


@pytest.fixture
async def webhook() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []

    async def ticket(request: web.Request) -> web.Response:
        received.append(await request.json())
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/tickets", ticket)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/tickets", received
    await runner.cleanup()


async def test_a_node_that_keeps_failing_is_cordoned_and_stays_cordoned_across_restarts(
    tmp_path: Path,
    actuator: RespawnActuator,
    webhook: tuple[str, list[dict[str, Any]]],
) -> None:
    url, tickets = webhook
    spec = start_sim(actuator)
    config = fast_config(tmp_path, restart_limit=2, hardware_ticket_webhook_url=url)
    metrics = Metrics(process=False)
    async with FleetMonitor(config, [spec], actuator=actuator, metrics=metrics) as monitor:
        for n in range(2):
            await until(lambda: routable(monitor), f"ready before failure {n + 1}")
            await fault(spec.url, {"kind": "engine_dead", "grace_s": 30})
            await until(lambda n=n: len(actuator.restarts) == n + 1, f"restart {n + 1}")
        await until(lambda: bool(actuator.cordons), "node cordoned")
        await until(lambda: bool(tickets), "hardware ticket posted")
        assert view_of(monitor).state == "cordoned" and not routable(monitor)
        [evidence] = actuator.cordons
        assert evidence.node == "n1"
        assert [r[1] for r in evidence.restarts] == ["r0", "r0"]
        assert tickets[0]["node"] == "n1" and len(tickets[0]["restarts"]) == 2
        assert (
            metrics.registry.get_sample_value("seawall_hardware_tickets_total", {"node": "n1"})
            == 1.0
        )
        assert metrics.registry.get_sample_value("seawall_node_cordoned", {"node": "n1"}) == 1.0

    # A new monitor (a gateway redeploy) reads the cordon back and never routes to r0.
    snapshots: list[FleetSnapshot] = []
    second = FleetMonitor(config, [spec], actuator=actuator)
    second.subscribe(snapshots.append)
    async with second:
        assert all(not s.replicas["r0"].routable for s in snapshots)
        [node] = second.describe()["nodes"]
        assert node["cordoned"] and node["evidence"] == ["2 restarts within 3600 s"]
        assert view_of(second).state == "cordoned"
        restarts_before = len(actuator.restarts)
        await second.uncordon("n1")
        assert actuator.uncordons == ["n1"]
        await until(lambda: routable(second), "ready after uncordon")
        assert len(actuator.restarts) == restarts_before + 1  # uncordon gives a fresh process


@dataclass
class RemovedWhileRestartingActuator(RespawnActuator):
    """A Kubernetes-like restart: the pod's deletion takes it out of discovery, and the
    monitor hears of that (its next EndpointSlice read) before the actuator's own call
    has returned, as happens when the API server answers slowly on a loaded machine."""

    monitor: FleetMonitor | None = None

    async def restart(self, replica: ReplicaRef, reason: str) -> bool:
        await super().restart(replica, reason)
        assert self.monitor is not None
        self.monitor.remove_replica(replica.replica_id)  # discovery: the pod is gone
        await asyncio.sleep(0.05)  # ...and the delete's answer comes after
        return True


async def test_a_restart_whose_pod_left_discovery_meanwhile_still_counts_towards_a_cordon(
    tmp_path: Path, artifacts: Path
) -> None:
    """Before: removing the replica cancelled its restart action mid-way, so the restart
    was never written to the ledger and the node's K-th restart never cordoned it (a CI
    run of the Kubernetes cluster test waited 40 s for a cordon that never came)."""
    actuator = RemovedWhileRestartingActuator(artifacts)
    try:
        spec = start_sim(actuator)
        config = fast_config(tmp_path, restart_limit=1)
        async with FleetMonitor(config, [spec], actuator=actuator) as monitor:
            actuator.monitor = monitor
            await until(lambda: routable(monitor), "replica ready")
            await fault(spec.url, {"kind": "engine_dead", "grace_s": 30})
            await until(lambda: not monitor.watches("r0"), "r0 out of discovery")
            monitor.add_replica(spec)  # discovery again: the new pod
            await until(lambda: bool(actuator.cordons), "node cordoned")
            [evidence] = actuator.cordons
            assert evidence.node == "n1" and [r[1] for r in evidence.restarts] == ["r0"]
            assert len(await monitor.ledger.restarts("n1", 0.0)) == 1
            await until(lambda: view_of(monitor).state == "cordoned", "r0 cordoned")
    finally:
        for proc in actuator.procs.values():
            proc.stop(2.0)


async def long_stream(url: str) -> None:
    body = {"model": "m", "prompt": "Tell me a story", "max_tokens": 4000, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as resp:
        async for _ in resp.content:
            pass


async def test_a_fatal_xid_on_the_sim_gpu_cordons_its_node_without_a_restart(
    tmp_path: Path, actuator: RespawnActuator
) -> None:
    spec = start_sim(actuator)
    config = fast_config(tmp_path, dcgm={"n1": spec.url + "/dcgm/metrics"}, dcgm_interval_s=0.2)
    async with FleetMonitor(config, [spec], actuator=actuator) as monitor:
        await until(lambda: routable(monitor), "replica ready")
        await fault(spec.url, {"kind": "dcgm", "xid": 79})
        await until(lambda: bool(actuator.cordons), "node cordoned")
        assert actuator.cordons[0].reasons == ("gpu 0: xid 79",)
        assert view_of(monitor).state == "cordoned" and not routable(monitor)
        assert actuator.restarts == []


async def test_restarts_of_a_replica_without_a_node_cordon_that_replica_alone(
    tmp_path: Path, actuator: RespawnActuator
) -> None:
    specs = [
        ReplicaSpec(rid, start_sim(actuator, rid).url, model="m", engine="vllm")
        for rid in ("r0", "r1")
    ]
    config = fast_config(tmp_path, restart_limit=2)
    async with FleetMonitor(config, specs, actuator=actuator) as monitor:
        for n in range(2):
            await until(lambda: routable(monitor, "r0"), f"r0 ready before failure {n + 1}")
            await fault(specs[0].url, {"kind": "engine_dead", "grace_s": 30})
            await until(lambda n=n: len(actuator.restarts) == n + 1, f"restart {n + 1}")
        await until(lambda: bool(actuator.cordons), "r0's domain cordoned")
        assert [e.node for e in actuator.cordons] == ["replica:r0"]
        assert view_of(monitor, "r0").state == "cordoned"
        # The replica that never failed is untouched, now and after a while.
        for _ in range(10):
            assert routable(monitor, "r1") and view_of(monitor, "r1").state == "ready"
            await asyncio.sleep(0.1)


async def test_after_an_uncordon_only_new_restarts_count_towards_the_next(
    tmp_path: Path, actuator: RespawnActuator
) -> None:
    spec = start_sim(actuator)
    config = fast_config(tmp_path, restart_limit=2)

    async def fail_once(monitor: FleetMonitor, n: int) -> None:
        await until(lambda: routable(monitor), f"ready before failure {n}")
        await fault(spec.url, {"kind": "engine_dead", "grace_s": 30})
        await until(lambda: len(actuator.restarts) == n, f"restart {n}")

    async with FleetMonitor(config, [spec], actuator=actuator) as monitor:
        await fail_once(monitor, 1)
        await fail_once(monitor, 2)
        await until(lambda: view_of(monitor).state == "cordoned", "cordoned")
        await monitor.uncordon("n1")  # the operator checked the node
        await until(lambda: len(actuator.restarts) == 3, "uncordon gave it a fresh process")
        await fail_once(monitor, 4)
        # One restart after the uncordon is not two: back to ready, not cordoned again.
        await until(lambda: routable(monitor), "back after one restart")
        assert len(actuator.cordons) == 1 and view_of(monitor).state == "ready"
