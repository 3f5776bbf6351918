"""The admin API: the fleet's state with the why, and the operator's levers.

Listens on its own port with its own credential (a bearer token whose SHA-256 hash is
`admin.token_hash` in the configuration), so that exposing the OpenAI API never exposes
the levers. Routes:

    GET  /admin/state                      replicas, nodes, budget, limits, timeouts, ...
    GET  /admin/history                    the last minutes of budget, shed rate, TTFT
    POST /admin/replicas/{id}/drain        stop new work (?restart=1: then restart it)
    POST /admin/replicas/{id}/undrain
    POST /admin/replicas/{id}/stop         drain, then stop through the actuator
    POST /admin/rollout                    surge-first rolling restart (local actuator)
    GET  /admin/rollout                    its progress and report
    POST /admin/nodes/{node}/cordon
    POST /admin/nodes/{node}/uncordon
    GET  /status                           the status page (static; it asks for the token)

Several gateway instances, one fleet: the levers act on the fleet, whichever instance
they are sent to. On a follower, drain, undrain, stop, cordon, uncordon and rollout are
forwarded to the leader's admin API (its URL comes with the lease), with the caller's
own Authorization header, and the leader's answer is relayed as it is. With no leader
reachable the answer is a 503 (`no_fleet_leader`, OpenAI-shaped, with Retry-After). A
forwarded request is marked (`X-Seawall-Forwarded`) and never forwarded twice: if
leadership moved meanwhile, the 503 says so. `GET /admin/state` stays local (each
instance's own in-flight view), with the instance's place in the fleet under `cluster`.

Must not: sit on the request path. It reads the monitor's `describe()`, the in-flight
ledger and the budget; the history sampler runs every `SAMPLE_S` off the request path.
Its dependencies are the components it reads and the fleet operations it calls
(`rollout.FleetOps`), never the gateway object itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import statistics
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from seawall import clock
from seawall.auth import hash_key
from seawall.cluster.roles import ActHere, ForwardTo, NoLeader, OperatorRoute
from seawall.config import GatewayConfig
from seawall.errors import ApiError, unavailable
from seawall.fleet.monitor import FleetMonitor
from seawall.gateway.admission_control import AdmissionControl
from seawall.gateway.inflight import InFlight
from seawall.gateway.pools import PoolRouter
from seawall.gateway.queue import AdmissionQueue
from seawall.gateway.replicas import ReplicaSet
from seawall.gateway.rollout import FleetOps, Rollout, RolloutOptions
from seawall.gateway.tenancy import Tenancy
from seawall.metrics import Metrics
from seawall.policy.retry_budget import RetryBudget
from seawall.state.ledger import LedgerError

SAMPLE_S = 2.0
HISTORY_POINTS = 300  # ten minutes at one point per two seconds
FORWARDED = "X-Seawall-Forwarded"
LEADER_HEADER = "X-Seawall-Leader"
# A forwarded action may be a drain that waits for streams: the leader answers when it
# is done, up to its drain timeout plus the stop grace. Connecting must be quick.
FORWARD_CONNECT_S = 2.0
FORWARD_MARGIN_S = 30.0
STATIC = Path(__file__).resolve().parent.parent / "ops" / "static"


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _err(e: ApiError) -> web.Response:
    return web.Response(
        body=e.json_bytes(), status=e.status, content_type="application/json", headers=e.headers
    )


# TTFT samples kept between two history points (a bounded buffer on a busy gateway).
_MAX_TTFT_SAMPLES = 10_000


class Admin:
    def __init__(
        self,
        *,
        config: GatewayConfig,
        monitor: FleetMonitor,
        replicas: ReplicaSet,
        ledger: InFlight,
        budget: RetryBudget,
        metrics: Metrics,
        tenancy: Tenancy,
        queue: AdmissionQueue,
        ops: FleetOps,
        admission: AdmissionControl | None = None,
        pools: PoolRouter | None = None,
        draining: Callable[[], bool],
        api_url: Callable[[], str],
        hedging: bool,
        route: Callable[[], OperatorRoute] = ActHere,
        cluster: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.monitor = monitor
        self.replicas = replicas
        self.ledger = ledger
        self.budget = budget
        self.metrics = metrics
        self.tenancy = tenancy
        self.queue = queue
        self.admission = admission  # adaptive admission's controllers, when that mode is on
        self.pools = pools  # the pool router (gateway/pools.py)
        self.ops = ops
        self.draining = draining
        self.api_url = api_url
        self.hedging = hedging
        self.route = route
        self.cluster = cluster
        self._forwarder: aiohttp.ClientSession | None = None
        self.history: deque[dict[str, float | None]] = deque(maxlen=HISTORY_POINTS)
        self.recent_ttft_s: list[float] = []  # drained by the sampler
        self._runner: web.AppRunner | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._rollout: asyncio.Task[Any] | None = None
        self._rollout_obj: Rollout | None = None
        self.port: int | None = None
        token_hash = config.admin.token_hash
        self._token_hash = token_hash.encode() if token_hash else None

    def observe_ttft(self, ttft_s: float) -> None:
        if len(self.recent_ttft_s) < _MAX_TTFT_SAMPLES:
            self.recent_ttft_s.append(ttft_s)

    # -- auth ---------------------------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        header = request.headers.get("Authorization", "")
        if not header.startswith("Bearer ") or self._token_hash is None:
            return False
        return hmac.compare_digest(hash_key(header[7:].strip()).encode(), self._token_hash)

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.startswith("/admin/") and not self._authorized(request):
            return _err(
                ApiError(
                    401, "The admin API needs its own bearer token.", code="admin_unauthorized"
                )
            )
        result: web.StreamResponse = await handler(request)
        return result

    # -- views --------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        now = clock.monotonic()
        described = self.monitor.describe()
        snap = self.replicas.snapshot()
        replicas = []
        for item in described["replicas"]:
            r = self.replicas.get(item["id"])
            if r is not None:
                item["inflight"] = r.counts.requests
                item["pool"] = r.pool
                item["gateway"] = {
                    "ttft_ewma_s": r.ttft_ewma_s,
                    "itl_ewma_s": r.itl_ewma_s,
                    "error_ewma": r.error_ewma,
                    "ejected": r.ejected_until > now,
                    "backoff": r.backoff_until > now,
                }
                reason = self.replicas.saturation(r, self.replicas.view(r, snap), now, 0)
                item["reserved_kv_blocks"] = r.counts.kv_blocks
                item["saturated"] = reason is not None
                item["saturation_reason"] = reason
                control = self.admission
                item["admission"] = control.describe(r.id, now) if control is not None else None
            item["draining"] = item.get("held", False)
            item["cordoned"] = any(
                n["cordoned"] for n in described["nodes"] if n["node"] == item["node"]
            )
            replicas.append(item)
        cfg = self.config
        nodes = [
            {**n, "restarts_in_window": len(n.get("restarts", []))} for n in described["nodes"]
        ]
        return {
            "replicas": replicas,
            "nodes": nodes,
            "transitions": described["transitions"],
            "retry_budget": {"level": self.budget.level(now), "ratio": cfg.retry.budget_ratio},
            "draining": self.draining(),
            "inflight": self.ledger.total,
            "limits": {
                **self.tenancy.summary(),
                "queued": self.queue.depths(),
                "admission_mode": cfg.admission.mode if cfg.admission.enabled else None,
                "output_lengths": self.admission.lengths_view() if self.admission else {},
            },
            "hedging": {"enabled": self.hedging, "delay_s": cfg.hedging.delay_s},
            "migration": {"tiers": sorted(n for n, t in cfg.tiers.items() if t.migrate)},
            "timeouts": cfg.timeouts.model_dump(),
            "actuator": self.monitor.actuator.name,
            "api_url": self.api_url(),
            "models": self.replicas.models(),
            "pools": self.pools.describe(now) if self.pools is not None else [],
            "pool_events": [
                {
                    "at_wall": clock.wall() - (now - e.at),
                    "change": e.change.value,
                    "model": e.model,
                    "from": e.from_pool,
                    "to": e.to_pool,
                    "reason": e.reason,
                }
                for e in (self.pools.history if self.pools is not None else ())
            ],
            **({"cluster": self.cluster()} if self.cluster is not None else {}),
        }

    async def _sample_loop(self) -> None:
        m = self.metrics
        last_shed = _counter_total(m.shed)
        last_req = _counter_total(m.requests)
        while True:
            await asyncio.sleep(SAMPLE_S)
            now = clock.monotonic()
            shed, req = _counter_total(m.shed), _counter_total(m.requests)
            ttfts = self.recent_ttft_s
            self.history.append(
                {
                    "t": clock.wall(),
                    "retry_budget": self.budget.level(now),
                    "shed_per_s": (shed - last_shed) / SAMPLE_S,
                    "requests_per_s": (req - last_req) / SAMPLE_S,
                    "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
                    "inflight": float(self.ledger.total),
                }
            )
            ttfts.clear()
            last_shed, last_req = shed, req

    # -- routes -------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._auth])
        app.router.add_get("/admin/state", self._get_state)
        app.router.add_get("/admin/history", self._get_history)
        # The levers act on the fleet: on a follower they go to the leader.
        fleet = self._on_the_leader
        app.router.add_post(
            "/admin/replicas/{id}/{action:drain|undrain}", fleet(self._replica_action)
        )
        app.router.add_post(
            "/admin/nodes/{node}/{action:cordon|uncordon}", fleet(self._node_action)
        )
        app.router.add_post("/admin/replicas/{id}/stop", fleet(self._replica_stop))
        app.router.add_post("/admin/rollout", fleet(self._start_rollout))
        app.router.add_get("/admin/rollout", fleet(self._get_rollout))
        app.router.add_get("/status", self._status_page)
        app.router.add_get("/", self._status_page)
        return app

    def _on_the_leader(
        self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        """`handler` here when this instance leads (or runs alone), else at the leader."""

        async def routed(request: web.Request) -> web.StreamResponse:
            route = self.route()
            match route:
                case ActHere():
                    return await handler(request)
                case ForwardTo():
                    if request.headers.get(FORWARDED):
                        return _err(
                            unavailable(
                                "This instance no longer leads the fleet (leadership moved "
                                "while the request was forwarded); try again.",
                                1.0,
                                code="no_fleet_leader",
                            )
                        )
                    return await self._forward(request, route)
                case NoLeader():
                    return _err(
                        unavailable(
                            f"No fleet leader is reachable to carry this out: {route.why}.",
                            route.retry_after_s,
                            code="no_fleet_leader",
                        )
                    )
            raise AssertionError(route)  # every OperatorRoute is matched above

        return routed

    async def _forward(self, request: web.Request, to: ForwardTo) -> web.StreamResponse:
        if self._forwarder is None:
            self._forwarder = aiohttp.ClientSession(auto_decompress=False)
        headers = {"Authorization": request.headers.get("Authorization", ""), FORWARDED: "1"}
        if request.content_type and request.can_read_body:
            headers["Content-Type"] = request.headers.get("Content-Type", "application/json")
        read_s = self.config.drain.timeout_s + FORWARD_MARGIN_S
        with_query = request.query.get("timeout_s"), request.query.get("grace_s")
        with contextlib.suppress(TypeError, ValueError):
            read_s = max(read_s, sum(float(v) for v in with_query if v) + FORWARD_MARGIN_S)
        timeout = aiohttp.ClientTimeout(total=None, connect=FORWARD_CONNECT_S, sock_read=read_s)
        try:
            async with self._forwarder.request(
                request.method,
                to.admin_url + request.path_qs,
                data=await request.read(),
                headers=headers,
                timeout=timeout,
            ) as resp:
                body = await resp.read()
                out = {k: v for k, v in resp.headers.items() if k in _RELAYED_HEADERS}
                out[LEADER_HEADER] = to.leader
                return web.Response(body=body, status=resp.status, headers=out)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return _err(
                unavailable(
                    f"The fleet leader ({to.leader}) did not answer: {type(e).__name__}.",
                    1.0,
                    code="no_fleet_leader",
                )
            )

    async def _get_state(self, request: web.Request) -> web.Response:
        return _json(self.state())

    async def _get_history(self, request: web.Request) -> web.Response:
        return _json({"sample_s": SAMPLE_S, "points": list(self.history)})

    async def _replica_action(self, request: web.Request) -> web.Response:
        rid, action = request.match_info["id"], request.match_info["action"]
        if self.replicas.get(rid) is None:
            return _err(ApiError(404, f"No replica {rid!r}.", param="id"))
        if action == "drain":
            self.monitor.drain(rid, restart=request.query.get("restart") in ("1", "true"))
        else:
            self.monitor.undrain(rid)
        return _json({"replica": rid, "action": action, "ok": True})

    async def _replica_stop(self, request: web.Request) -> web.Response:
        """Drain then stop: no new work, in-flight finishes up to `timeout_s`, then the
        actuator stops the replica (SIGTERM, SIGKILL after `grace_s`)."""
        rid = request.match_info["id"]
        try:
            timeout_s = float(request.query.get("timeout_s", self.config.drain.timeout_s))
            grace_s = float(request.query.get("grace_s", 10.0))
        except ValueError:
            return _err(ApiError(400, "timeout_s and grace_s must be numbers."))
        try:
            report = await self.ops.drain_replica(rid, timeout_s, grace_s)
        except KeyError:
            return _err(ApiError(404, f"No replica {rid!r}.", param="id"))
        return _json({"replica": rid, "streams_cut": report.streams_cut, "exited": report.exited})

    async def _start_rollout(self, request: web.Request) -> web.Response:
        supervisor = self.monitor.actuator
        if not hasattr(supervisor, "start_new"):
            return _err(
                ApiError(
                    409,
                    "Rollouts here need the local actuator (seawall up). On Kubernetes, use the "
                    "Deployment's rolling update (maxSurge 1, maxUnavailable 0).",
                    code="no_local_actuator",
                )
            )
        if self._rollout is not None and not self._rollout.done():
            return _err(ApiError(409, "A rollout is already running.", code="rollout_running"))
        try:
            body = await request.json() if request.can_read_body else {}
            opts = RolloutOptions.from_json(body if isinstance(body, dict) else {})
        except (ValueError, TypeError) as e:
            return _err(ApiError(400, f"Bad rollout options: {e}"))
        self._rollout_obj = Rollout(self.ops, supervisor, opts)  # type: ignore[arg-type]
        self._rollout = asyncio.create_task(self._rollout_obj.run())
        return _json({"state": "running"}, status=202)

    async def _get_rollout(self, request: web.Request) -> web.Response:
        if self._rollout_obj is None:
            return _err(ApiError(404, "No rollout has run on this gateway.", code="no_rollout"))
        return _json(self._rollout_obj.report.to_json())

    async def _node_action(self, request: web.Request) -> web.Response:
        node, action = request.match_info["node"], request.match_info["action"]
        try:
            if action == "cordon":
                await self.monitor.cordon(node, reason="operator")
            else:
                await self.monitor.uncordon(node)
        except LedgerError as e:
            return _err(unavailable(f"The restart ledger refused the {action}: {e}.", 1.0))
        return _json({"node": node, "action": action, "ok": True})

    async def _status_page(self, request: web.Request) -> web.StreamResponse:
        page = STATIC / "status.html"
        if not page.exists():
            return _err(ApiError(404, "The status page is not installed."))
        return web.FileResponse(page, headers={"Cache-Control": "no-cache"})

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> int:
        cfg = self.config.admin
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, cfg.host, cfg.port)
        await site.start()
        server: Any = site._server
        self.port = int(server.sockets[0].getsockname()[1])
        self._sampler = asyncio.create_task(self._sample_loop())
        return self.port

    async def close(self) -> None:
        if self._rollout is not None and not self._rollout.done():
            self._rollout.cancel()
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler
        if self._runner is not None:
            await self._runner.cleanup()
        if self._forwarder is not None:
            await self._forwarder.close()


_RELAYED_HEADERS = frozenset(
    {"Content-Type", "Retry-After", "retry-after-ms", "x-should-retry", "Location"}
)


def _counter_total(counter: Any) -> float:
    total = 0.0
    for metric in counter.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                total += s.value
    return total
