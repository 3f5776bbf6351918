"""The processes `seawall up` runs: engine replicas under a `LocalSupervisor`, and the
gateway in front of them.

Owns: starting, watching and stopping those processes, in the drain order (traffic is
stopped by the caller first, then the gateway drains, then the replicas stop), and
reading the gateway's figures from its `/metrics`.

Must not: draw anything (that is `view.py`) or generate traffic (`seawall.loadgen`).

The gateway runs as its own `seawall serve --config FILE` process, supervised like a
replica (restarted if it dies). `GatewayProcess` is the seam for running it in-process
instead: anything with the same `start/close/status/figures/url` will do, wired to
`LocalFleet.supervisor.subscribe` for routing changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import yaml

from seawall import clock
from seawall.actuate.local import (
    LocalSupervisor,
    ReplicaEvent,
    ReplicaStatus,
    free_loopback_port,
)
from seawall.up.config import UpConfig, gateway_config, python_argv
from seawall.up.figures import GatewayFigures, parse_gateway_metrics

HOST = "127.0.0.1"


def gateway_available() -> bool:
    """True when this build has `seawall serve` (the gateway)."""
    from seawall.cli import COMMANDS

    return "serve" in COMMANDS


class Gateway(Protocol):
    url: str

    async def start(self, replicas: list[dict[str, str]]) -> None: ...

    def status(self) -> ReplicaStatus | None: ...

    async def figures(self) -> GatewayFigures | None: ...

    async def ready(self) -> bool: ...

    def pids(self) -> list[int]: ...

    def subscribe(self, listener: Callable[[ReplicaEvent], None]) -> None: ...

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
            health_path="/healthz",
            startup_allowance_s=60.0,
            stop_grace_s=grace_s,
        )
        self._session: aiohttp.ClientSession | None = None

    async def start(self, replicas: list[dict[str, str]]) -> None:
        merged = gateway_config(self.base_config, replicas, HOST, self.port)
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
        try:
            async with self._http().get(self.url + "/readyz") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

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

    async def close(self) -> None:
        await self.supervisor.close()
        if self._session is not None:
            await self._session.close()
            self._session = None


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
            startup_allowance_s=f.startup_allowance_s,
            health_path=f.health_path,
            stop_grace_s=f.stop_grace_s,
        )
        self.gateway: Gateway | None = None
        self.gateway_note = ""
        if config.gateway is None:
            self.gateway_note = "(no gateway: gateway is null in the config)"
        elif not gateway_available():
            self.gateway_note = "(gateway not yet available)"
        else:
            self.gateway = GatewayProcess(config.gateway, log_dir, gateway_port)

    async def start(self) -> None:
        """Start the replicas, then the gateway pointed at them; returns without waiting
        for either to be ready (see `wait_ready`)."""
        f = self.config.fleet
        refs = await self.supervisor.start(f.model, f.replicas)
        if self.gateway is not None:
            await self.gateway.start(
                [{"url": r.url, "model": r.model, "node": r.node, "id": r.replica_id} for r in refs]
            )

    def target_urls(self) -> list[str]:
        """Where traffic goes: the gateway, or each replica directly when there is none."""
        if self.gateway is not None:
            return [self.gateway.url]
        return [s.url for s in self.supervisor.replicas()]

    def replicas(self) -> list[ReplicaStatus]:
        return self.supervisor.replicas()

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
        """Gateway first (it drains what is in flight), then the replicas."""
        try:
            if self.gateway is not None:
                await self.gateway.close()
        finally:
            await self.supervisor.close()
