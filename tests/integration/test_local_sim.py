"""The local supervisor running real `seawall sim` replicas (the default command), judged
by a fleet monitor wired as `seawall up` wires them: the supervisor reports process
starts and exits, the monitor decides when a replica serves and when to restart it."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import aiohttp
import pytest

from seawall.actuate.local import DEFAULT_COMMAND, BackoffPolicy, LocalSupervisor, ReplicaEvent
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.monitor import FleetMonitor
from seawall.up.fleet import MonitorFeed

pytestmark = pytest.mark.integration

SIM_WITH_FAULTS = [*DEFAULT_COMMAND, "--enable-faults"]


async def until(cond: object, timeout_s: float = 30.0) -> None:
    assert callable(cond)
    for _ in range(int(timeout_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


def judge(sup: LocalSupervisor, artifacts: Path, **overrides: object) -> FleetMonitor:
    config = FleetMonitorConfig.model_validate(
        {
            "actuator": "local",
            "liveness_interval_s": 0.1,
            "ledger_path": str(artifacts / "ledger.sqlite"),
            **overrides,
        }
    )
    monitor = FleetMonitor(config, actuator=sup)
    MonitorFeed(monitor, sup).attach()
    return monitor


async def test_a_sim_that_crashes_is_restarted_and_serves_again(artifacts: Path) -> None:
    events: list[ReplicaEvent] = []
    async with (
        LocalSupervisor(
            log_dir=artifacts,
            command=SIM_WITH_FAULTS,
            backoff=BackoffPolicy(initial_s=0.1),
            on_change=events.append,
        ) as sup,
        judge(sup, artifacts),
    ):
        (ref,) = await sup.start("sim-model", 1)
        assert await sup.wait_running(30)
        first_pid = sup.replicas()[0].pid
        async with aiohttp.ClientSession() as http:
            # The sim exits at once, so the answer may be a reset rather than a status.
            with contextlib.suppress(aiohttp.ClientError):
                await http.post(f"{ref.url}/sim/fault", json={"kind": "crash"})
        await until(lambda: sup.replicas()[0].restarts == 1)
        assert await sup.wait_running(30)
        assert sup.replicas()[0].pid != first_pid
        assert [e.kind for e in events].count("running") == 2
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{ref.url}/v1/models") as resp,
        ):
            assert resp.status == 200
            assert (await resp.json())["data"][0]["id"] == "sim-model"


async def test_a_sim_loading_for_seconds_is_left_to_load(artifacts: Path) -> None:
    events: list[ReplicaEvent] = []
    async with (
        LocalSupervisor(
            log_dir=artifacts,
            command=[*DEFAULT_COMMAND, "--load-time", "3"],
            on_change=events.append,
        ) as sup,
        judge(sup, artifacts, startup_allowance_s=60) as monitor,
    ):
        await sup.start("sim-model", 1)
        await until(lambda: sup.replicas()[0].uptime_s > 0.5)
        assert sup.replicas()[0].state == "starting"
        assert await sup.wait_running(30)
        (status,) = sup.replicas()
        assert status.restarts == 0
        assert [e.kind for e in events] == ["starting", "running"]
        # The monitor probed it while it loaded, and did not count that against it.
        replica = monitor.describe()["replicas"][0]
        assert replica["liveness"]["probes"] > 5 and replica["failures"] == 0
