"""The processes `seawall up` runs: engine replicas under a `LocalSupervisor`, and the
gateway in front of them.

Owns: starting, watching and stopping those processes, in the drain order (traffic is
stopped by the caller first, then the gateway drains, then the replicas stop), and
reading the gateway's figures (from its metrics registry, or its `/metrics`).

Must not: draw anything (that is `view.py`) or generate traffic (`seawall.loadgen`).

Two ways to run the gateway, one interface (`GatewayRunner`):
- `InProcessGateway` (default): the gateway in this process, with the `LocalSupervisor`
  as its fleet monitor's actuator, so the monitor's decisions (restart a hung replica,
  cordon a failure domain after K restarts) act on the processes `up` started, and
  process exits reach the monitor at once instead of at its next probe.
- `GatewayProcess`: `seawall serve --config FILE` as its own supervised child (restarted
  if it dies); the monitor there can only route around (`fleet.actuator: none`).

One judge of readiness. The supervisor only reports process facts; a fleet monitor
decides when a replica serves, and its startup allowance is the one rule for a replica
that never comes up (`MonitorFeed` wires the two together). With the gateway in-process
that is the gateway's monitor; otherwise (`gateway: null`, or the gateway as a process,
whose monitor cannot act on our processes) `up` runs a fleet monitor of its own over the
replicas, acting through the supervisor.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import yaml
from prometheus_client import generate_latest

from seawall import clock
from seawall.actuate.local import (
    LocalSupervisor,
    ReplicaEvent,
    ReplicaStatus,
    free_loopback_port,
)
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.monitor import FleetMonitor, ReplicaSpec
from seawall.fleet.view import FleetSnapshot
from seawall.up.config import UpConfig, gateway_config, python_argv
from seawall.up.figures import GatewayFigures, ReplicaLoad, parse_gateway_metrics

HOST = "127.0.0.1"
GATEWAY_STARTUP_S = 60.0  # `seawall serve` that is not healthy by then is restarted
# States in which the fleet monitor has found a replica serving.
_SERVING = frozenset({"ready", "degraded"})


class MonitorFeed:
    """Process facts from the supervisor to a fleet monitor, verdicts back.

    `starting` tells the monitor a process started (its startup allowance runs from
    then) or, for a replica it does not watch yet (a rollout's new one), to watch it:
    the monitor judges it before the gateway routes to it. `exited` is a process exit.
    `stopped` of a replica the gateway does not route (`routed`) ends the watch. And
    each snapshot that shows a replica ready or degraded marks it serving in the
    supervisor, which is what `running` and `wait_running` mean there.
    """

    def __init__(
        self,
        monitor: FleetMonitor,
        supervisor: LocalSupervisor,
        routed: Callable[[str], bool] = lambda replica_id: True,
    ) -> None:
        self.monitor = monitor
        self.supervisor = supervisor
        self.routed = routed

    def attach(self) -> None:
        self.supervisor.subscribe(self.on_event)
        self.monitor.subscribe(self.on_snapshot)

    def on_event(self, event: ReplicaEvent) -> None:
        s = event.status
        if event.kind == "starting":
            if self.monitor.watches(s.replica_id):
                self.monitor.notify_process_started(s.replica_id)
            else:
                self.monitor.add_replica(ReplicaSpec(s.replica_id, s.url, s.model, s.node))
        elif event.kind == "exited":
            # The supervisor sees an exit the moment it happens; the monitor would only
            # notice at its next failed probe.
            self.monitor.notify_process_exited(
                s.replica_id, event.reason, failure=event.exit_code != 0
            )
        elif event.kind == "stopped" and not self.routed(s.replica_id):
            self.monitor.remove_replica(s.replica_id)

    def on_snapshot(self, snap: FleetSnapshot) -> None:
        for rid, view in snap.replicas.items():
            if view.state in _SERVING:
                self.supervisor.mark_serving(rid)


def gateway_available() -> bool:
    """True when this build has `seawall serve` (the gateway)."""
    from seawall.cli import COMMANDS

    return "serve" in COMMANDS


class GatewayRunner(Protocol):
    url: str

    async def start(self, replicas: list[dict[str, str]]) -> None: ...

    def status(self) -> ReplicaStatus | None: ...

    async def figures(self) -> GatewayFigures | None: ...

    async def ready(self) -> bool: ...

    def pids(self) -> list[int]: ...

    def subscribe(self, listener: Callable[[ReplicaEvent], None]) -> None: ...

    def routing(self) -> dict[str, str]:
        """Replica id -> the fleet monitor's state for it (ready, degraded, cordoned...),
        where this runner can see the monitor; {} where it cannot."""
        ...

    def loads(self) -> dict[str, ReplicaLoad]:
        """Replica id -> its load, where this runner can see the gateway's own view."""
        ...

    def in_flight(self, replica_id: str) -> tuple[int, int] | None:
        """(requests, of which streaming) on the replica now; None where not visible."""
        ...

    def status_url(self) -> str:
        """The admin API's status page, when it runs and its address is known; else ""."""
        ...

    async def close(self) -> None: ...


class GatewayProcess:
    """`seawall serve` as a supervised child process on a loopback port."""

    def __init__(self, base_config: dict[str, Any], log_dir: Path, port: int | None) -> None:
        self.base_config = base_config
        self.log_dir = log_dir
        listen = base_config.get("listen") or {}
        self.port = port or int(listen.get("port") or 0) or free_loopback_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        self.config_path = log_dir / "gateway.yaml"
        drain = base_config.get("drain") or {}
        # The gateway drains on SIGTERM; give it its drain time before SIGKILL.
        grace_s = float(drain.get("timeout_s") or 30.0) + 5.0
        escaped = str(self.config_path).replace("{", "{{").replace("}", "}}")
        self.supervisor = LocalSupervisor(
            log_dir=log_dir,
            command=python_argv("serve", "--config", escaped, "--no-access-log"),
            stop_grace_s=grace_s,
        )
        # No fleet monitor watches gateways: this runner judges its own child, by
        # /healthz, each time the supervisor starts it.
        self.supervisor.subscribe(self._on_event)
        self._watch: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def _on_event(self, event: ReplicaEvent) -> None:
        if event.kind == "starting":
            if self._watch is not None:
                self._watch.cancel()
            self._watch = asyncio.get_running_loop().create_task(self._await_healthy())

    async def _await_healthy(self) -> None:
        deadline = clock.monotonic() + GATEWAY_STARTUP_S
        while clock.monotonic() < deadline:
            try:
                async with self._http().get(self.url + "/healthz") as resp:
                    if resp.status == 200:
                        self.supervisor.mark_serving("gateway")
                        return
            except (aiohttp.ClientError, TimeoutError, OSError):
                pass
            await asyncio.sleep(0.25)
        ref = self.supervisor.refs()[0]
        await self.supervisor.restart(ref, f"not healthy within {GATEWAY_STARTUP_S:g}s")

    async def start(self, replicas: list[dict[str, str]]) -> None:
        merged = gateway_config(self.base_config, replicas, HOST, self.port)
        merged["fleet"] = _fleet_section(merged, self.log_dir, actuator="none")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(merged, sort_keys=False))
        await self.supervisor.start_new("gateway", replica_id="gateway", port=self.port)

    def status(self) -> ReplicaStatus | None:
        statuses = self.supervisor.replicas()
        return statuses[0] if statuses else None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
        return self._session

    async def ready(self) -> bool:
        return await _readyz(self._http(), self.url)

    async def figures(self) -> GatewayFigures | None:
        try:
            async with self._http().get(self.url + "/metrics") as resp:
                if resp.status != 200:
                    return None
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None
        try:
            return parse_gateway_metrics(text)
        except ValueError:  # a half-written scrape during a restart
            return None

    def pids(self) -> list[int]:
        return self.supervisor.all_pids()

    def subscribe(self, listener: Callable[[ReplicaEvent], None]) -> None:
        self.supervisor.subscribe(listener)

    def routing(self) -> dict[str, str]:
        return {}  # the monitor is in the other process

    def loads(self) -> dict[str, ReplicaLoad]:
        return {}  # `LocalFleet` joins /metrics' in-flight counts with its own monitor

    def in_flight(self, replica_id: str) -> tuple[int, int] | None:
        return None

    def status_url(self) -> str:
        admin = self.base_config.get("admin") or {}
        port = int(admin.get("port") or 0) if admin.get("enabled") else 0
        return f"http://{admin.get('host') or HOST}:{port}/status" if port else ""

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.supervisor.close()
        if self._session is not None:
            await self._session.close()
            self._session = None


class InProcessGateway:
    """The gateway in this process; the fleet monitor acts through `supervisor`."""

    def __init__(
        self,
        base_config: dict[str, Any],
        supervisor: LocalSupervisor,
        log_dir: Path,
        port: int | None,
        startup_allowance_s: float,
        health_path: str = "/health",
    ) -> None:
        self.base_config = base_config
        self.supervisor = supervisor
        self.log_dir = log_dir
        listen = base_config.get("listen") or {}
        self.port = port or int(listen.get("port") or 0) or free_loopback_port(HOST)
        self.url = f"http://{HOST}:{self.port}"
        self.startup_allowance_s = startup_allowance_s
        self.health_path = health_path
        self.gateway: Any = None  # seawall.gateway.app.Gateway, imported when started
        self.started_at = 0.0
        self._session: aiohttp.ClientSession | None = None

    async def start(self, replicas: list[dict[str, str]]) -> None:
        from seawall.config import parse_config
        from seawall.gateway.app import Gateway

        merged = gateway_config(self.base_config, replicas, HOST, self.port)
        fleet = _fleet_section(merged, self.log_dir, actuator="local")
        fleet.setdefault("startup_allowance_s", self.startup_allowance_s)
        fleet.setdefault("liveness_path", self.health_path)
        merged["fleet"] = fleet
        config = parse_config(merged, "seawall up: gateway")
        actuator = self.supervisor if fleet.get("actuator") == "local" else None
        gateway = self.gateway = Gateway(config, access_log=False, actuator=actuator)
        MonitorFeed(
            gateway.monitor,
            self.supervisor,
            routed=lambda rid: gateway.replicas.get(rid) is not None,
        ).attach()
        await gateway.start()
        self.started_at = clock.monotonic()

    def status(self) -> ReplicaStatus | None:
        if self.gateway is None:
            return None
        return ReplicaStatus(
            replica_id="gateway",
            url=self.url,
            port=self.port,
            model="",
            node="local",
            pid=os.getpid(),
            state="stopped" if self.gateway.draining else "running",
            restarts=0,
            uptime_s=clock.monotonic() - self.started_at,
            reason="in-process",
        )

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0))
        return self._session

    async def ready(self) -> bool:
        return self.gateway is not None and await _readyz(self._http(), self.url)

    async def figures(self) -> GatewayFigures | None:
        if self.gateway is None:
            return None
        text = generate_latest(self.gateway.metrics.registry).decode()
        return parse_gateway_metrics(text)

    def pids(self) -> list[int]:
        return []  # nothing of its own to leave behind

    def subscribe(self, listener: Callable[[ReplicaEvent], None]) -> None:
        return None  # no process of its own, so no process events

    def routing(self) -> dict[str, str]:
        if self.gateway is None:
            return {}
        views = self.gateway.monitor.snapshot().replicas
        return {
            rid: v.state if v.routable else f"{v.state} (not routed)" for rid, v in views.items()
        }

    def loads(self) -> dict[str, ReplicaLoad]:
        if self.gateway is None:
            return {}
        views = self.gateway.monitor.snapshot().replicas
        out: dict[str, ReplicaLoad] = {}
        for r in self.gateway.replicas.all():
            v = views.get(r.id)
            kv = v.load.kv_usage if v is not None and v.load is not None else None
            out[r.id] = ReplicaLoad(r.counts.requests, kv, v.score if v is not None else None)
        return out

    def in_flight(self, replica_id: str) -> tuple[int, int] | None:
        if self.gateway is None:
            return None
        counts = self.gateway.ledger.counts(replica_id)
        return counts.requests, counts.streams

    def status_url(self) -> str:
        admin = self.gateway.admin if self.gateway is not None else None
        if admin is None or admin.port is None:
            return ""
        return f"http://{self.gateway.config.admin.host}:{admin.port}/status"

    async def close(self) -> None:
        """Drain (in-flight requests finish, up to the drain timeout), then close. The
        gateway closes its actuator too: the supervisor, i.e. the replicas."""
        try:
            if self.gateway is not None:
                await self.gateway.shutdown()
        finally:
            if self._session is not None:
                await self._session.close()
                self._session = None


def _own_monitor(config: UpConfig, supervisor: LocalSupervisor, log_dir: Path) -> FleetMonitor:
    """The fleet monitor `up` runs itself when no in-process gateway's monitor judges the
    replicas: the gateway config's `fleet:` section (when there is one) with the
    supervisor as actuator and a ledger of its own."""
    fleet = dict((config.gateway or {}).get("fleet") or {})
    fleet.pop("discovery", None)
    fleet.update(actuator="local", ledger_path=str(log_dir / "up-ledger.sqlite"))
    fleet.setdefault("startup_allowance_s", config.fleet.startup_allowance_s)
    fleet.setdefault("liveness_path", config.fleet.health_path)
    return FleetMonitor(FleetMonitorConfig.model_validate(fleet), actuator=supervisor)


def _fleet_section(merged: dict[str, Any], log_dir: Path, actuator: str) -> dict[str, Any]:
    """The gateway's `fleet:` with `up`'s defaults: its restart ledger in the log dir
    (not the working directory), and the actuator this way of running supports."""
    fleet = dict(merged.get("fleet") or {})
    fleet.setdefault("ledger_path", str(log_dir / "ledger.sqlite"))
    fleet.setdefault("actuator", actuator)
    return fleet


async def _readyz(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with http.get(url + "/readyz?fleet=1") as resp:
            return resp.status == 200
    except (aiohttp.ClientError, TimeoutError, OSError):
        return False


class LocalFleet:
    """Replicas (and the gateway, when configured and available) for `seawall up`."""

    def __init__(self, config: UpConfig, log_dir: Path, gateway_port: int | None = None) -> None:
        self.config = config
        self.log_dir = log_dir
        f = config.fleet
        self.supervisor = LocalSupervisor(
            log_dir=log_dir,
            command=f.command,
            node=f.node,
            env=f.env,
            stop_grace_s=f.stop_grace_s,
        )
        self.gateway: GatewayRunner | None = None
        self.monitor: FleetMonitor | None = None  # `up`'s own, when no gateway's judges
        self.gateway_note = ""
        if config.gateway is None:
            self.gateway_note = "(no gateway: gateway is null in the config)"
        elif not gateway_available():
            self.gateway_note = "(gateway not yet available)"
        elif config.gateway_mode == "process":
            self.gateway = GatewayProcess(config.gateway, log_dir, gateway_port)
        else:
            self.gateway = InProcessGateway(
                config.gateway,
                self.supervisor,
                log_dir,
                gateway_port,
                f.startup_allowance_s,
                f.health_path,
            )
        if not isinstance(self.gateway, InProcessGateway):
            self.monitor = _own_monitor(config, self.supervisor, log_dir)
            MonitorFeed(self.monitor, self.supervisor).attach()

    async def start(self) -> None:
        """Start the replicas, then the gateway pointed at them; returns without waiting
        for either to be ready (see `wait_ready`)."""
        f = self.config.fleet
        if self.monitor is not None:
            await self.monitor.start()
        refs = await self.supervisor.start(f.model, f.replicas)
        if self.gateway is not None:
            await self.gateway.start(
                [
                    {
                        "url": r.url,
                        "model": r.model,
                        "id": r.replica_id,
                        **({"node": r.node} if r.node else {}),
                    }
                    for r in refs
                ]
            )

    def target_urls(self) -> list[str]:
        """Where traffic goes: the gateway, or each replica directly when there is none."""
        if self.gateway is not None:
            return [self.gateway.url]
        return [s.url for s in self.supervisor.replicas()]

    def replicas(self) -> list[ReplicaStatus]:
        return self.supervisor.replicas()

    def routing(self) -> dict[str, str]:
        """Replica id -> the judging fleet monitor's state for it."""
        if self.monitor is None:
            return self.gateway.routing() if self.gateway is not None else {}
        return {
            rid: v.state if v.routable else f"{v.state} (not routed)"
            for rid, v in self.monitor.snapshot().replicas.items()
        }

    def loads(self, figures: GatewayFigures | None) -> dict[str, ReplicaLoad]:
        """Replica id -> in flight (the gateway's count), KV use and routing score (the
        judging monitor's). `figures`: the gateway's latest, for a gateway process."""
        if self.monitor is None:
            return self.gateway.loads() if self.gateway is not None else {}
        inflight = figures.inflight if figures is not None else {}
        out: dict[str, ReplicaLoad] = {}
        for rid, v in self.monitor.snapshot().replicas.items():
            kv = v.load.kv_usage if v.load is not None else None
            out[rid] = ReplicaLoad(inflight.get(rid) if self.gateway else None, kv, v.score)
        return out

    def subscribe(self, listener: Callable[[ReplicaEvent], None]) -> None:
        """Process events from the replicas and the gateway process."""
        self.supervisor.subscribe(listener)
        if self.gateway is not None:
            self.gateway.subscribe(listener)

    async def wait_ready(self, timeout_s: float) -> bool:
        """Every replica running and, with a gateway, the gateway ready to route."""
        deadline = clock.monotonic() + timeout_s
        if not await self.supervisor.wait_running(timeout_s):
            return False
        while self.gateway is not None and not await self.gateway.ready():
            if clock.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.1)
        return True

    def all_pids(self) -> list[int]:
        gateway_pids = self.gateway.pids() if self.gateway is not None else []
        return [*self.supervisor.all_pids(), *gateway_pids]

    async def close(self) -> None:
        """Gateway first (it drains what is in flight), then our monitor (so that it
        does not act on the replicas stopping), then the replicas."""
        try:
            if self.gateway is not None:
                await self.gateway.close()
        finally:
            try:
                if self.monitor is not None:
                    await self.monitor.stop()
            finally:
                await self.supervisor.close()
