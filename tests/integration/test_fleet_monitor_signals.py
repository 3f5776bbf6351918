"""The fleet monitor's reaction to load and hardware signals, from a scripted engine.

The engine here is a small aiohttp server on loopback whose /metrics (vLLM names),
/dcgm (dcgm-exporter names), /health and /v1/completions the test sets directly, so a
queue, a preemption storm or an Xid can be produced on demand. Engine failures
themselves are covered against real `seawall sim` processes in test_fleet_monitor.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from seawall.actuate.base import Evidence, ReplicaRef
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.discovery import Endpoint
from seawall.fleet.monitor import FleetMonitor, ReplicaSpec
from seawall.fleet.signals import NoGatewaySignals, Observed
from seawall.metrics import Metrics

pytestmark = pytest.mark.integration

DCGM_LABELS = 'gpu="0",UUID="GPU-0",device="nvidia0",modelName="NVIDIA H100",Hostname="n1"'


@dataclass
class ScriptedEngine:
    running: float = 0
    waiting: float = 0
    kv: float = 0.1
    preemptions: float = 0
    preemptions_per_scrape: float = 0
    tokens: float = 0
    xid: int = 0
    dcgm_scrapes: int = 0
    serve_metrics: bool = True
    url: str = ""

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/dcgm", self.dcgm)
        app.router.add_post("/v1/completions", self.completions)
        return app

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def metrics(self, request: web.Request) -> web.Response:
        if not self.serve_metrics:
            raise web.HTTPNotFound()
        self.preemptions += self.preemptions_per_scrape
        labels = '{engine="0",model_name="m"}'
        text = "".join(
            f"vllm:{name}{labels} {value}\n"
            for name, value in [
                ("num_requests_running", self.running),
                ("num_requests_waiting", self.waiting),
                ("kv_cache_usage_perc", self.kv),
                ("num_preemptions_total", self.preemptions),
                ("generation_tokens_total", self.tokens),
            ]
        )
        return web.Response(text=text)

    async def dcgm(self, request: web.Request) -> web.Response:
        self.dcgm_scrapes += 1
        return web.Response(text=f"DCGM_FI_DEV_XID_ERRORS{{{DCGM_LABELS}}} {self.xid}\n")

    async def completions(self, request: web.Request) -> web.Response:
        self.tokens += 1
        return web.json_response(
            {"choices": [{"index": 0, "text": "x"}], "usage": {"completion_tokens": 1}}
        )


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    eng = ScriptedEngine()
    runner = web.AppRunner(eng.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    eng.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield eng
    await runner.cleanup()


@dataclass
class RecordingActuator:
    name: str = "recording"
    restarts: list[tuple[str, str]] = field(default_factory=list)
    cordons: list[Evidence] = field(default_factory=list)
    uncordons: list[str] = field(default_factory=list)

    async def restart(self, replica: ReplicaRef, reason: str) -> bool:
        self.restarts.append((replica.replica_id, reason))
        return True

    async def stop(self, replica: ReplicaRef, grace_s: float) -> None:
        return None

    async def cordon(self, node: str, evidence: Evidence) -> None:
        self.cordons.append(evidence)

    async def uncordon(self, node: str) -> None:
        self.uncordons.append(node)

    async def close(self) -> None:
        return None


def config(**overrides: Any) -> FleetMonitorConfig:
    values: dict[str, Any] = {
        "liveness_interval_s": 0.1,
        "scrape_interval_s": 0.1,
        "deep_probe_interval_s": 0.2,
        "deep_probe_idle_interval_s": 0.2,
        "deep_probe_timeout_s": 1.0,
        "ledger_path": ":memory:",
        "ready_waiting_threshold": 8,
        "storm_rate_threshold_per_s": 1.0,
        "storm_sustain_s": 0.3,
        "storm_clear_s": 0.3,
        "dcgm_interval_s": 0.1,
    }
    values.update(overrides)
    return FleetMonitorConfig.model_validate(values)


async def until(check: Callable[[], bool], what: str, deadline_s: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + deadline_s
    while not check():
        if loop.time() > end:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.02)


def view(monitor: FleetMonitor) -> Any:
    return monitor.snapshot().replicas["r0"]


async def test_a_long_engine_queue_saturates_and_degrades_until_it_drains(
    engine: ScriptedEngine,
) -> None:
    spec = ReplicaSpec("r0", engine.url, "m", "n1")
    async with FleetMonitor(config(), [spec]) as monitor:
        await until(lambda: view(monitor).state == "ready", "ready")
        healthy_score = view(monitor).score
        engine.waiting = 20
        await until(lambda: view(monitor).saturated, "saturated")
        assert view(monitor).state == "degraded"
        assert view(monitor).saturation_reason == "20 waiting in the engine"
        assert view(monitor).score < healthy_score
        engine.waiting = 0
        await until(lambda: view(monitor).state == "ready", "ready again")
        assert not view(monitor).saturated


async def test_a_preemption_storm_degrades_and_recovers_without_a_restart(
    engine: ScriptedEngine,
) -> None:
    actuator = RecordingActuator()
    spec = ReplicaSpec("r0", engine.url, "m", "n1")
    async with FleetMonitor(config(), [spec], actuator=actuator) as monitor:
        await until(lambda: view(monitor).state == "ready", "ready")
        engine.preemptions_per_scrape = 10  # ~100/s at a 0.1 s scrape
        await until(lambda: view(monitor).state == "degraded", "storm")
        assert view(monitor).reason.startswith("preemption storm")
        assert view(monitor).routable  # degraded still serves, at a lower weight
        engine.preemptions_per_scrape = 0
        await until(lambda: view(monitor).state == "ready", "storm cleared")
        assert actuator.restarts == []


async def test_operator_hold_cordon_and_describe(engine: ScriptedEngine) -> None:
    actuator = RecordingActuator()
    metrics = Metrics(process=False)
    spec = ReplicaSpec("r0", engine.url, "m", "n1")
    async with FleetMonitor(config(), [spec], actuator=actuator, metrics=metrics) as monitor:
        await until(lambda: view(monitor).routable, "ready")
        monitor.drain("r0")
        assert not view(monitor).routable
        assert view(monitor).reason == "held out of routing by the operator"
        monitor.undrain("r0")
        assert view(monitor).routable

        await monitor.cordon("n1", "alice")
        assert view(monitor).state == "cordoned" and not view(monitor).routable
        assert [e.reasons for e in actuator.cordons] == [("cordoned by alice",)]
        sample = metrics.registry.get_sample_value
        assert sample("seawall_node_cordoned", {"node": "n1"}) == 1.0
        assert sample("seawall_hardware_tickets_total", {"node": "n1"}) is None  # manual
        assert (
            sample("seawall_replica_state", {"replica": "r0", "node": "n1", "state": "cordoned"})
            == 1.0
        )
        info = json.loads(json.dumps(monitor.describe()))  # what the admin API serves
        assert info["nodes"][0]["cordoned"] is True
        assert info["transitions"][-1]["to"] == "cordoned"
        replica = info["replicas"][0]
        assert {"state", "reason", "score", "score_parts", "load", "in_flight", "restarts"} <= set(
            replica
        )
        await monitor.uncordon("n1")
        await until(lambda: view(monitor).routable, "ready after uncordon")
        assert actuator.uncordons == ["n1"]
        assert sample("seawall_replica_ready", {"replica": "r0"}) == 1.0


async def test_a_fatal_xid_cordons_the_node_without_restarting(engine: ScriptedEngine) -> None:
    actuator = RecordingActuator()
    metrics = Metrics(process=False)
    spec = ReplicaSpec("r0", engine.url, "m", "n1")
    cfg = config(dcgm={"n1": engine.url + "/dcgm"})
    async with FleetMonitor(cfg, [spec], actuator=actuator, metrics=metrics) as monitor:
        await until(lambda: view(monitor).routable, "ready")
        engine.xid = 79
        await until(lambda: bool(actuator.cordons), "cordoned")
        assert view(monitor).state == "cordoned" and not view(monitor).routable
        assert actuator.cordons[0].reasons == ("gpu 0: xid 79",)
        assert actuator.restarts == []  # the GPU is gone: a restart cannot help
        assert (
            metrics.registry.get_sample_value("seawall_hardware_tickets_total", {"node": "n1"})
            == 1.0
        )


async def test_an_application_xid_restarts_the_replica_once(engine: ScriptedEngine) -> None:
    actuator = RecordingActuator()
    spec = ReplicaSpec("r0", engine.url, "m", "n1")
    cfg = config(dcgm={"n1": engine.url + "/dcgm"})
    async with FleetMonitor(cfg, [spec], actuator=actuator) as monitor:
        await until(lambda: view(monitor).routable, "ready")
        engine.xid = 13
        await until(lambda: bool(actuator.restarts), "restart")
        await until(lambda: view(monitor).routable, "ready again")
        seen = engine.dcgm_scrapes
        # Several more DCGM scrapes still show 13 as the last Xid: no second restart.
        await until(lambda: engine.dcgm_scrapes >= seen + 5, "five more DCGM scrapes")
        assert actuator.restarts == [
            ("r0", "restart requested: GPU application fault: gpu 0: xid 13")
        ]
        assert actuator.cordons == []


async def test_a_server_without_metrics_is_judged_by_the_deep_probe(
    engine: ScriptedEngine,
) -> None:
    engine.serve_metrics = False
    async with FleetMonitor(config(), [ReplicaSpec("r0", engine.url, "m", "n1")]) as monitor:
        await until(lambda: view(monitor).routable, "ready")

        def probed() -> bool:
            return bool(monitor.describe()["replicas"][0]["deep_probe"]["success_ratio"])

        await until(probed, "a passed deep probe")
        assert view(monitor).load is None
        assert view(monitor).no_metrics  # admission counts only the gateway's own requests
        assert monitor.describe()["replicas"][0]["scrape"] == "scrape failed: absent"


@dataclass
class ScriptedSignals(NoGatewaySignals):
    """The gateway's view of the replica, set by the test as the engine's is: the error
    rate its requests there have seen."""

    error_rate: float | None = None

    def observed(self, replica_id: str) -> Observed:
        return Observed(error_rate=self.error_rate)


async def test_the_score_follows_the_gateways_errors_with_no_scrape_or_deep_probe(
    engine: ScriptedEngine,
) -> None:
    """A replica the gateway sees failing scores lower within a few liveness probes, and
    recovers as the errors stop, even where nothing else would rescore it: no /metrics
    to scrape, and no deep probe due for 30 s."""
    engine.serve_metrics = False
    signals = ScriptedSignals(error_rate=0.5)
    cfg = config(deep_probe_interval_s=30.0, deep_probe_idle_interval_s=30.0)
    spec = ReplicaSpec("r0", engine.url, "m", "n1")
    async with FleetMonitor(cfg, [spec], signals=signals) as monitor:

        def score() -> float | None:
            got = monitor.snapshot().replicas.get("r0")
            return got.health_score if got is not None else None

        await until(lambda: (score() or 1.0) < 0.9, "the errors in the score", 5.0)
        failing = score()
        assert failing is not None
        signals.error_rate = 0.0
        await until(lambda: (score() or 0.0) > failing, "the score recovering", 5.0)


async def test_discovered_replicas_are_added_and_removed(engine: ScriptedEngine) -> None:
    host, port = engine.url.removeprefix("http://").split(":")

    class Scripted:
        found: frozenset[Endpoint] = frozenset({Endpoint(host, int(port), "n7", "vllm-0")})

        async def resolve(self) -> frozenset[Endpoint]:
            return self.found

    discovery = Scripted()
    async with FleetMonitor(config()) as monitor:
        monitor.start_discovery(discovery, interval_s=0.05, model="m", engine="vllm")
        await until(lambda: "vllm-0" in monitor.snapshot().replicas, "discovered")
        found = monitor.snapshot().replicas["vllm-0"]
        assert (found.url, found.node, found.model) == (engine.url, "n7", "m")
        await until(lambda: monitor.snapshot().replicas["vllm-0"].routable, "ready")
        discovery.found = frozenset()
        await until(lambda: not monitor.snapshot().replicas, "removed")
