"""The gateway process: routes, lifecycle (start, discovery, drain, close) and shared state.

Owns the objects every request shares: the replica set, the upstream connection pool,
the retry budget, the metrics. The request path itself is `proxy.py`; the admission
layers that run before a replica is chosen plug in as `guard`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import random
from typing import Any, Protocol

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError

from seawall import clock
from seawall.actuate.base import Actuator, DrainReport, ReplicaRef
from seawall.auth import hash_key
from seawall.config import ConfigError, GatewayConfig, format_validation_error
from seawall.errors import ApiError
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.monitor import FleetMonitor, ReplicaSetSignals, ReplicaSpec
from seawall.fleet.view import FleetSnapshot
from seawall.gateway.admin import Admin
from seawall.gateway.engine_args import warn_if_context_too_small
from seawall.gateway.frontdoor import FrontDoor
from seawall.gateway.frontdoor import serve as serve_front_door
from seawall.gateway.h1 import Endpoint, H1Pool
from seawall.gateway.metrics import Metrics
from seawall.gateway.proxy import Proxy, RequestCtx
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.policy.hedge import HedgePolicy
from seawall.policy.retry_budget import RetryBudget

log = logging.getLogger("seawall.gateway")


class Guard(Protocol):
    """Admission layers run before a replica is chosen (tenancy, limits, saturation)."""

    async def admit(self, request: web.Request, ctx: RequestCtx) -> None:
        """Raise `ApiError` to refuse; set `ctx.lease` to be called back in `release`."""

    async def release(self, ctx: RequestCtx) -> None: ...

    async def close(self) -> None: ...


def _json(status: int, obj: Any, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers
    )


def _error(e: ApiError) -> web.Response:
    return web.Response(
        body=e.json_bytes(), status=e.status, content_type="application/json", headers=e.headers
    )


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        metrics: Metrics | None = None,
        rng: random.Random | None = None,
        access_log: bool = True,
        install: bool = True,
        actuator: Actuator | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.replicas = ReplicaSet(rng or random.Random(config.seed))
        for i, rc in enumerate(config.replicas):
            self.replicas.add(
                Replica(rc.id or f"r{i}", rc.url, rc.model, rc.node, rc.api_key, rc.engine)
            )
        r = config.retry
        self.budget = RetryBudget(
            ratio=r.budget_ratio,
            min_per_s=r.budget_min_per_s,
            reserve_window_s=r.budget_reserve_window_s,
            now=clock.monotonic(),
        )
        self.metrics.retry_budget.set_function(lambda: self.budget.level(clock.monotonic()))
        h = config.hedging
        self.hedge = HedgePolicy(h.delay_s, h.max_prompt_tokens, h.max_fleet_load)
        self.hedge_enabled = h.enabled
        self.draining = False
        self.inflight = 0
        self.guard: Guard | None = None
        self.access_log = access_log
        self.model_cards: dict[str, dict[str, Any]] = {}
        self.proxy = Proxy(self)
        self._session: aiohttp.ClientSession | None = None
        # The request path's upstream connections (hand-written, see h1.py); the session
        # above serves the gateway's other calls to replicas.
        self.pool = H1Pool(on_connect=self._upstream_connected)
        self.front_door: FrontDoor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.port: int | None = None
        self.recent_ttft_s: list[float] = []  # drained by the admin sampler
        self.admin: Admin | None = Admin(self) if config.admin.enabled else None
        self.monitor = self._build_monitor(actuator)
        self.set_snapshot_source(self.monitor.snapshot)
        if install:
            from seawall.gateway.stack import install_layers

            install_layers(self)

    # -- shared state -------------------------------------------------------------------

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Gateway.start() first"
        return self._session

    def _build_monitor(self, actuator: Actuator | None) -> FleetMonitor:
        fleet = load_fleet_config(self.config)
        # The Kubernetes actuator needs I/O to load its credentials: start() sets it.
        if actuator is None and fleet.actuator == "local":
            raise ConfigError(
                "fleet.actuator: 'local' restarts processes Seawall started itself; "
                "use it through `seawall up`, or choose 'none' or 'kubernetes'"
            )
        return FleetMonitor(
            fleet,
            [_spec(r) for r in self.replicas.all()],
            actuator=actuator,
            metrics=self.metrics,
            signals=ReplicaSetSignals(self.replicas),
        )

    def _upstream_connected(self, endpoint: Endpoint) -> None:
        replica = next((r for r in self.replicas.all() if r.endpoint == endpoint), None)
        label = replica.id if replica is not None else endpoint.host_header
        self.metrics.upstream_connections.labels(label).inc()

    def add_replica(
        self,
        replica_id: str,
        url: str,
        model: str | None,
        node: str = "local",
        api_key: str | None = None,
        engine: str = "auto",
    ) -> Replica:
        """A replica joins routing and the fleet monitor (rollouts, discovery)."""
        replica = Replica(replica_id, url.rstrip("/"), model, node, api_key, engine)
        self.replicas.add(replica)
        self.monitor.add_replica(_spec(replica))
        return replica

    def apply_discovered(self, specs: list[ReplicaSpec]) -> None:
        """Make the routed set equal a discovered one (a replica's id is its address)."""
        wanted = {spec.replica_id: spec for spec in specs}
        for r in self.replicas.all():
            if r.id not in wanted or wanted[r.id].url != r.url:
                self.remove_replica(r.id)
        for spec in specs:
            if self.replicas.get(spec.replica_id) is None:
                self.add_replica(
                    spec.replica_id, spec.url, spec.model or None, spec.node, engine=spec.engine
                )

    async def drain_replica(
        self, replica_id: str, timeout_s: float, stop_grace_s: float | None = None
    ) -> DrainReport:
        """No new work for the replica at once; in-flight requests get `timeout_s` to
        finish; then, with `stop_grace_s`, the actuator stops it (SIGTERM, SIGKILL after
        the grace) and it leaves the fleet. Reports how many requests were cut."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            raise KeyError(replica_id)
        replica.draining = True
        deadline = clock.monotonic() + timeout_s
        while replica.inflight > 0 and clock.monotonic() < deadline:
            await asyncio.sleep(0.02)
        cut = replica.inflight
        if cut:
            log.warning(
                "drain of %s hit its %.0fs deadline: cutting %d request(s)",
                replica_id,
                timeout_s,
                cut,
            )
        if stop_grace_s is None:
            return DrainReport(replica_id, cut, exited=False)
        ref = ReplicaRef(replica_id, replica.url, replica.node, replica.model or "")
        stop = getattr(self.monitor.actuator, "remove", None) or self.monitor.actuator.stop
        self.remove_replica(replica_id)
        await stop(ref, stop_grace_s)
        return DrainReport(replica_id, cut, exited=self.monitor.actuator.name != "none")

    def remove_replica(self, replica_id: str) -> None:
        self.replicas.remove(replica_id)
        self.monitor.remove_replica(replica_id)

    def set_snapshot_source(self, source: Any) -> None:
        """The fleet monitor's `snapshot()`: read per request, never awaited."""
        self.replicas.snapshot = source

    def fleet_load(self) -> float:
        """Mean KV usage over routable replicas where scraped, else in-flight per replica / 16.

        Only hedging reads it, to tell a lightly loaded fleet from a busy one.
        """
        snap: FleetSnapshot = self.replicas.snapshot()
        loads: list[float] = []
        for r in self.replicas.all():
            view = snap.replicas.get(r.id)
            if view is not None and view.load is not None and view.load.kv_usage is not None:
                loads.append(view.load.kv_usage)
            else:
                loads.append(min(1.0, r.inflight / 16))
        return sum(loads) / len(loads) if loads else 1.0

    # -- HTTP ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_body_bytes)
        proxy = self.proxy

        async def completions(request: web.Request) -> web.StreamResponse:
            return await proxy.handle(request, "completions")

        async def chat(request: web.Request) -> web.StreamResponse:
            return await proxy.handle(request, "chat")

        async def method_not_allowed(request: web.Request) -> web.Response:
            return _error(
                ApiError(405, f"Method {request.method} is not allowed on {request.path}.")
            )

        async def not_found(request: web.Request) -> web.Response:
            return _error(ApiError(404, f"Route {request.method} {request.path} not found."))

        app.router.add_post("/v1/completions", completions)
        app.router.add_post("/v1/chat/completions", chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        app.router.add_get("/metrics", self._metrics)
        for path in ("/v1/completions", "/v1/chat/completions"):
            app.router.add_route("GET", path, method_not_allowed)
        app.router.add_route("*", "/{tail:.*}", not_found)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        data = []
        for model in self.replicas.models():
            card = self.model_cards.get(model) or {
                "id": model,
                "object": "model",
                "created": int(clock.wall()),
                "owned_by": "seawall",
            }
            data.append(card)
        return _json(200, {"object": "list", "data": data})

    async def _healthz(self, request: web.Request) -> web.Response:
        return _json(200, {"status": "ok"})

    async def _readyz(self, request: web.Request) -> web.Response:
        if self.draining:
            return _json(503, {"status": "draining"})
        if not self.replicas.any_ready(clock.monotonic()):
            return _json(503, {"status": "no usable replica"})
        return _json(200, {"status": "ready"})

    def _metrics_public(self) -> bool:
        access = self.config.metrics.access
        return access == "public" or (access == "auto" and not self.config.tenants)

    def _metrics_credentials(self) -> list[bytes]:
        hashes = (self.config.metrics.token_hash, self.config.admin.token_hash)
        return [h.encode() for h in hashes if h]

    def _may_read_metrics(self, request: web.Request) -> bool:
        """`/metrics` names tenants and tiers: with tenants configured it needs the
        scrape credential or the admin token (config `metrics.access`)."""
        if self._metrics_public():
            return True
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return False
        presented = hash_key(token.strip()).encode()
        return any(hmac.compare_digest(presented, h) for h in self._metrics_credentials())

    def _has_valid_key(self, headers: Any) -> bool:
        """For the front door's caps: does this request carry a tenant's valid key?"""
        keys = getattr(self.guard, "keys", None)
        return keys is not None and isinstance(keys.authenticate_headers(headers), str)

    async def _metrics(self, request: web.Request) -> web.Response:
        if not self._may_read_metrics(request):
            return _error(
                ApiError(
                    401,
                    "The gateway's metrics need the scrape or admin bearer token.",
                    code="metrics_unauthorized",
                    type="AuthenticationError",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            )
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self, host: str | None = None, port: int | None = None) -> int:
        """Open the connection pool, start discovery and listen. Returns the bound port."""
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, keepalive_timeout=30, enable_cleanup_closed=True
            ),
            timeout=aiohttp.ClientTimeout(total=None, connect=5.0),
            auto_decompress=False,
            skip_auto_headers=("User-Agent", "Accept-Encoding"),
        )
        if self.monitor.config.actuator == "kubernetes" and self.monitor.actuator.name == "none":
            from seawall.actuate.kubernetes import KubernetesActuator

            self.monitor.actuator = await KubernetesActuator.from_environment()
        await self.monitor.start()
        discovery = self.monitor.config.discovery
        if discovery is not None:
            from seawall.fleet.discovery import build_discovery

            self.monitor.start_discovery(
                build_discovery(discovery),
                discovery.interval_s,
                discovery.model or "",
                discovery.engine,
                apply=self.apply_discovered,
            )
        self._tasks.append(asyncio.create_task(self._discover_loop()))
        if not self._metrics_public() and not self._metrics_credentials():
            log.warning(
                "tenants are configured, so /metrics needs a credential, and none is set: "
                "set metrics.token_hash (seawall keys new --tenant prometheus) or "
                "metrics.access: public"
            )
        # Timeouts, connection caps and JSON answers below the OpenAI API: frontdoor.py.
        self.front_door = await serve_front_door(
            self.app(),
            host or self.config.listen.host,
            self.config.listen.port if port is None else port,
            self.config.server,
            authorize=self._has_valid_key if self.config.tenants else None,
            registry=self.metrics.registry,
        )
        self.port = self.front_door.port
        if self.admin is not None:
            await self.admin.start()
        return self.port

    async def _discover_loop(self) -> None:
        """Learn each replica's served model (and its card) from `GET /v1/models`."""
        while True:
            pending = [
                r for r in self.replicas.all() if r.model is None or r.model not in self.model_cards
            ]
            for r in pending:
                with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError, ValueError):
                    async with self.session.get(
                        r.url + "/v1/models", timeout=aiohttp.ClientTimeout(total=2.0)
                    ) as resp:
                        if resp.status != 200:
                            continue
                        cards = (await resp.json()).get("data") or []
                        if not cards:
                            continue
                        if r.model is None:
                            r.model = str(cards[0]["id"])
                        for card in cards:
                            if str(card["id"]) not in self.model_cards:
                                self.model_cards[str(card["id"])] = card
                                if isinstance(card.get("max_model_len"), int):
                                    warn_if_context_too_small(
                                        self.config, str(card["id"]), card["max_model_len"]
                                    )
            await asyncio.sleep(1.0 if pending else 5.0)

    async def drain(self, timeout_s: float | None = None) -> int:
        """Stop taking requests and let in-flight ones finish; return how many were cut."""
        self.draining = True
        self.metrics.draining.set(1)
        deadline = clock.monotonic() + (
            timeout_s if timeout_s is not None else self.config.drain.timeout_s
        )
        while self.inflight > 0 and clock.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.inflight

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.front_door is not None:
            await self.front_door.close()
        if self.admin is not None:
            await self.admin.close()
        await self.monitor.stop()
        await self.monitor.actuator.close()
        if self.guard is not None:
            await self.guard.close()
        self.pool.close()
        if self._session is not None:
            await self._session.close()


def _spec(r: Replica) -> ReplicaSpec:
    return ReplicaSpec(r.id, r.url, r.model or "", r.node, r.engine)


def load_fleet_config(config: GatewayConfig) -> FleetMonitorConfig:
    try:
        return FleetMonitorConfig.model_validate(config.fleet)
    except ValidationError as e:
        text = format_validation_error(e, "fleet")
        raise ConfigError(text.replace("\n  ", "\n  fleet.")) from None
