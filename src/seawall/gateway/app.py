"""The gateway process: the composition root, its routes, and its lifecycle.

`Gateway.__init__` builds every component once, from the validated configuration, and
hands each one only what it uses (the wiring below is the whole dependency graph of the
request path):

    config ─┬─ InFlight ledger ── ReplicaSet ── FleetMonitor (snapshot, signals)
            │                                        └─ RoleManager (several instances)
            ├─ RetryBudget, HedgePolicy, H1Upstream(H1Pool)
            ├─ Tenancy(limits backend) · FleetAdmission(AdmissionQueue)
            ├─ admission stack (stack.py) ─┐
            ├─ Dispatcher ── Relay ────────┴─ Proxy ── routes
            └─ Admin (own port, own credential) · ModelCatalog (GET /v1/models)

`shutdown()` is the drain sequence, its order written once with a reason per step.

Several instances, one fleet (`cluster:` in the configuration): the cluster store
(`_cluster_store`) and the `RoleManager` are wired in `__init__` (the monitor then starts
as a follower, reads fleet-wide signals and writes the shared ledger), a Kubernetes
Lease elector in `start()`; the role manager's hooks are the `_cluster_*` methods, the
only places where leadership changes what this instance does. Without a store the
instance leads itself and none of this exists.

Must not: hold request-path logic (that is `proxy.py` and the modules it composes) or be
imported by the components it builds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from seawall import __version__, clock
from seawall.actuate.base import Actuator, DrainReport, ReplicaRef
from seawall.auth import hash_key
from seawall.cluster.report import InstanceReport, ReplicaReport
from seawall.cluster.roles import ActHere, OperatorRoute, RoleHooks, RoleManager
from seawall.cluster.store import ClusterStore
from seawall.config import DEFAULT_POOL, ClusterConfig, ConfigError, GatewayConfig, ReplicaConfig
from seawall.errors import ApiError
from seawall.fleet.monitor import FleetMonitor, ReplicaSpec
from seawall.fleet.published import PublishedView
from seawall.fleet.signals import FleetWideSignals, GatewaySignals
from seawall.fleet.view import FleetSnapshot
from seawall.gateway import telemetry
from seawall.gateway.admin import Admin
from seawall.gateway.bulkhead import Bulkheads
from seawall.gateway.catalog import ModelCatalog
from seawall.gateway.dispatch import Dispatcher
from seawall.gateway.engine_args import warn_if_context_too_small
from seawall.gateway.fleet_admission import FleetAdmission
from seawall.gateway.fleet_quota import Grants, QuotaIssuer, capacity_of
from seawall.gateway.frontdoor import FrontDoor
from seawall.gateway.frontdoor import serve as serve_front_door
from seawall.gateway.h1 import Endpoint, H1Pool
from seawall.gateway.inflight import InFlight
from seawall.gateway.pools import PoolRouter
from seawall.gateway.proxy import Proxy
from seawall.gateway.relay import Relay
from seawall.gateway.replicas import Replica, ReplicaSet, ReplicaSignals, replica_reports
from seawall.gateway.rollout import Tally, tally
from seawall.gateway.stack import admission_stack
from seawall.gateway.tenancy import Tenancy, warn_if_open
from seawall.gateway.upstream import H1Upstream
from seawall.metrics import Metrics
from seawall.policy.hedge import HedgePolicy
from seawall.policy.ledger import failure_domain
from seawall.policy.outlier import OutlierRule
from seawall.policy.pools import Change, PoolEvent
from seawall.policy.retry_budget import RetryBudget
from seawall.protocol.routes import ROUTES, Route
from seawall.state.backends import open_limits_backend
from seawall.state.ledger import Ledger, StoreLedger

log = logging.getLogger("seawall.gateway")

# How often each model's serving pool is stepped besides on fleet snapshots.
POOL_TICK_S = 0.5

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# After the drain deadline has cut what was left, how long the cut requests get to write
# their last bytes (an error event and [DONE]) before the listener closes.
CUT_GRACE_S = 1.0


def _json(status: int, obj: Any) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json")


def _error(e: ApiError) -> web.Response:
    return web.Response(body=e.json_bytes(), status=e.status, headers=e.response_headers())


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        metrics: Metrics | None = None,
        rng: random.Random | None = None,
        access_log: bool = True,
        actuator: Actuator | None = None,
    ) -> None:
        self.config = config
        m = self.metrics = metrics or Metrics()
        self.draining = False

        # In flight, and the replicas that requests go to.
        self.ledger = InFlight(on_release=self._slot_released)
        self.replicas = ReplicaSet(self.ledger, rng or random.Random(config.seed))
        self.catalog = ModelCatalog(self.replicas, on_new_card=self._new_model_card)
        self._specs: dict[str, ReplicaSpec] = {}  # what the monitor watches, per replica

        # Several instances, one fleet: the shared store and the role manager. The
        # monitor then starts as a follower (the role manager promotes it), reads every
        # instance's in-flight counts, and keeps the restart ledger in the store.
        cc = config.cluster
        self.cluster: RoleManager | None = None
        self._cluster_store: ClusterStore | None = None
        signals: GatewaySignals = ReplicaSignals(self.replicas, self.ledger)
        restart_ledger: Ledger | None = None
        if cc.enabled:
            self._cluster_store = store = _cluster_store(cc)
            self.cluster = RoleManager(
                instance=cc.instance_id or _default_instance_id(),
                store=store,
                elector=None,  # the store's own lease; a Kubernetes Lease is set in start()
                hooks=RoleHooks(
                    promote=self._cluster_promote,
                    demote=self._cluster_demote,
                    apply_view=self._cluster_apply_view,
                    export_view=self._cluster_export_view,
                    replica_reports=self._cluster_reports,
                    admin_url=self._advertised_admin_url,
                    hold_view=lambda: self.monitor.hold_view(),
                    report_extra=self._cluster_extra,
                    quotas=self._cluster_quotas,
                    instances_changed=self._cluster_instances_changed,
                ),
                timing=cc,
                metrics=m,
            )
            signals = FleetWideSignals(signals, self.cluster.peers)
            restart_ledger = StoreLedger(store, lambda: self._cluster_epoch())
            # Followers probe nothing: what their own requests show is theirs to judge.
            self.replicas.outlier_rule = _outlier_rule(cc)
        else:
            m.cluster_role.labels("leader").set(1)
            m.cluster_role.labels("follower").set(0)
            m.cluster_instances.set(1)

        # The fleet monitor, off the request path; routing reads its snapshot.
        if actuator is None and config.fleet.actuator == "local":
            raise ConfigError(
                "fleet.actuator: 'local' restarts processes Seawall started itself; "
                "use it through `seawall up`, or choose 'none' or 'kubernetes'"
            )
        self.monitor = FleetMonitor(
            config.fleet,
            actuator=actuator,
            metrics=m,
            signals=signals,
            ledger=restart_ledger,
            leading=self.cluster is None,
            credentials=self._replica_key,
        )
        self.replicas.snapshot = self.monitor.snapshot
        if self.cluster is not None:
            cluster = self.cluster
            self.monitor.subscribe(lambda snap: cluster.changed())
        # The configured replicas as last applied (a reload compares the file with this).
        self._applied: dict[str, ReplicaConfig] = replica_configs(config)
        for rid, rc in self._applied.items():
            self._add_configured(rid, rc)
        self._retiring: dict[str, asyncio.Task[None]] = {}  # removed by a reload, draining
        self._after_retire: dict[str, ReplicaConfig] = {}  # moved: joins once drained

        # Budgets and the upstream. With several instances each holds its share of the
        # fleet's reserve (resized as instances come and go: `_cluster_instances_changed`),
        # starting empty until it knows how many share it.
        r = config.retry
        self.budget = RetryBudget(
            ratio=r.budget_ratio,
            min_per_s=r.budget_min_per_s,
            reserve_window_s=r.budget_reserve_window_s,
            ttl_s=r.budget_ttl_s,
            max_balance=r.budget_max_balance,
            now=clock.monotonic(),
            reserve_full=self.cluster is None,
        )
        m.retry_budget.set_function(lambda: self.budget.level(clock.monotonic()))
        # The request path's upstream connections (hand-written, see h1.py); `session`
        # serves the gateway's other calls to replicas (model discovery, warm-up).
        self.upstream = H1Upstream(H1Pool(on_connect=self._upstream_connected))
        self._session: aiohttp.ClientSession | None = None

        # Admission: tenants and tiers, then the fleet's saturation.
        rate = config.ratelimit
        backend = open_limits_backend(
            rate.redis_url if rate.backend == "redis" else None,
            fail_mode=rate.fail_mode,
            key_prefix=rate.key_prefix,
            # A lease outlives the longest request, so only a crashed gateway's leases expire.
            lease_ttl_s=config.timeouts.total_s + 60.0,
            # A fail-open fallback holds this instance's share of each limit: of the
            # cluster's instances, or without one, of those Redis counts.
            instances=self.instance_count if self.cluster is not None else None,
        )
        self.tenancy = Tenancy(config, backend, m, self.catalog.max_model_len)
        # Pools: which group of replicas a request may use (gateway/pools.py).
        self.pools = PoolRouter(
            config.pools,
            self.replicas,
            config.failover.after_s,
            config.failover.failback_after_s,
            on_event=self._pool_event,
        )
        if not self.pools.single:
            for name, pc in config.pools.items():
                m.pool_info.labels(name, str(pc.priority), pc.mode).set(1)
        self.monitor.subscribe(lambda snap: self._observe_pools())
        self.fleet_admission = FleetAdmission(config.admission, self.replicas, m, self.pools)
        # Several instances: each admits within the leader's grants (gateway/fleet_quota.py);
        # the leader divides what its own snapshot says each replica holds.
        self.quota_issuer: QuotaIssuer | None = None
        if self.cluster is not None and config.admission.enabled:
            self.fleet_admission.use_grants(
                Grants(self.cluster.quotas, self.cluster.fallback_share)
            )
            # A vanished instance's share stays counted one member TTL past its own.
            self.quota_issuer = QuotaIssuer(self._quota_capacities, 2 * cc.member_ttl_s)
        self.monitor.subscribe(lambda snap: self.fleet_admission.queue.wake())
        self.monitor.subscribe(self.fleet_admission.on_snapshot)  # adaptive admission
        warn_if_open(config)

        # Tracing: None unless configured, and then the request path does no span work.
        self.tracing = (
            telemetry.Tracing(config.telemetry, __version__) if config.telemetry.enabled else None
        )

        # The request path.
        self.admin: Admin | None = None
        h = config.hedging
        self.dispatcher = Dispatcher(
            replicas=self.replicas,
            ledger=self.ledger,
            upstream=self.upstream,
            budget=self.budget,
            retry=config.retry,
            metrics=m,
            hedge=HedgePolicy(h.delay_s, h.max_prompt_tokens, h.max_fleet_load)
            if h.enabled
            else None,
            fleet_load=self.fleet_load,
            on_ttft=self._observe_ttft,
            pools=self.pools,
            pool_retry_after_s=config.failover.retry_after_s,
            bulkheads=Bulkheads(lambda: self.tenancy.tiers),  # the tiers as last reloaded
        )
        relay = Relay(
            dispatcher=self.dispatcher,
            budget=self.budget,
            metrics=m,
            max_migrations=config.retry.max_migrations,
            migration_ttft_s=config.retry.migration_ttft_s,
        )
        stack = admission_stack(
            draining=lambda: self.draining,
            drain_retry_after_s=config.drain.retry_after_s,
            tenancy=self.tenancy,
            max_body_bytes=config.limits.max_body_bytes,
            replicas=self.replicas,
            fleet=self.fleet_admission,
        )
        self.proxy = Proxy(
            stack=stack,
            dispatcher=self.dispatcher,
            relay=relay,
            ledger=self.ledger,
            tenancy=self.tenancy,
            fleet=self.fleet_admission,
            replicas=self.replicas,
            metrics=m,
            timeouts_for=config.timeouts_for,
            drain_retry_after_s=config.drain.retry_after_s,
            access_log=access_log,
            tracing=self.tracing,
        )
        if config.admin.enabled:
            self.admin = Admin(
                config=config,
                monitor=self.monitor,
                replicas=self.replicas,
                ledger=self.ledger,
                budget=self.budget,
                metrics=m,
                tenancy=self.tenancy,
                queue=self.fleet_admission.queue,
                admission=self.fleet_admission.control,
                pools=self.pools,
                ops=self,
                draining=lambda: self.draining,
                api_url=lambda: f"http://{config.listen.host}:{self.port}",
                hedging=h.enabled,
                route=self.operator_route,
                cluster=self.cluster_status,
            )

        self.front_door: FrontDoor | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()  # short jobs, e.g. ledger writes
        self._kube_client: Any = None
        self.port: int | None = None
        self._seed_metrics()

    # -- wiring callbacks ---------------------------------------------------------------

    def _new_model_card(self, model: str, card: dict[str, Any]) -> None:
        if isinstance(card.get("max_model_len"), int):
            warn_if_context_too_small(self.config, model, card["max_model_len"])

    def _observe_pools(self) -> None:
        """Step each model's serving pool, and show where each model is served."""
        now = clock.monotonic()
        self.pools.observe(now)
        if self.pools.single:
            return
        m = self.metrics
        for row in self.pools.describe(now):
            pool = str(row["pool"])
            served = row["serving"]
            for model in self.replicas.models():
                serving = isinstance(served, list) and model in served
                m.pool_serving.labels(pool, model).set(1 if serving else 0)
                free, sat = self.replicas.candidates(model, now, pool=pool)
                m.pool_routable.labels(pool, model).set(len(free) + len(sat))

    def _pool_event(self, event: PoolEvent) -> None:
        if event.change is Change.failover:
            self.metrics.pool_failovers.labels(
                event.model, event.from_pool or "", event.to_pool or ""
            ).inc()
        elif event.change is Change.failback:
            self.metrics.pool_failbacks.labels(
                event.model, event.from_pool or "", event.to_pool or ""
            ).inc()
        if event.change is not Change.first and self.monitor.leading:
            # The ledger keeps the fleet's pool moves; one writer, the leader.
            self._spawn_background(self.monitor.ledger.record_pool_event(event))

    def _spawn_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_log_failure)

    async def _pool_tick(self) -> None:
        """Hysteresis is about time: the serving pools are stepped on a tick as well as on
        every new fleet snapshot."""
        while True:
            await asyncio.sleep(POOL_TICK_S)
            self._observe_pools()

    def _slot_released(self, replica_id: str) -> None:
        replica = self.replicas.get(replica_id)
        if replica is not None and replica.public is not None:
            self.fleet_admission.queue.wake(replica.public)  # queued by the name asked for

    def _observe_ttft(self, ttft_s: float) -> None:
        if self.admin is not None:
            self.admin.observe_ttft(ttft_s)

    def _upstream_connected(self, endpoint: Endpoint) -> None:
        replica = next((r for r in self.replicas.all() if r.endpoint == endpoint), None)
        label = replica.id if replica is not None else endpoint.host_header
        self.metrics.upstream_connections.labels(label).inc()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "Gateway.start() first"
        return self._session

    @property
    def inflight(self) -> int:
        """Client requests inside the gateway now."""
        return self.ledger.total

    # -- the replica set ----------------------------------------------------------------

    def add_replica(
        self,
        replica_id: str,
        url: str,
        model: str | None,
        node: str | None = None,
        api_key: str | None = None,
        engine: str = "auto",
        model_name: str | None = None,
        pool: str = DEFAULT_POOL,
    ) -> Replica:
        """A replica joins routing and the fleet monitor (config, rollouts, discovery)."""
        spec = ReplicaSpec(
            replica_id,
            url.rstrip("/"),
            model or "",
            node,
            engine,
            pool=pool,
            deep_probe_min_interval_s=self._pool_probe_floor(pool),
        )
        return self._add(spec, api_key, model_name)

    def _replica_key(self, replica_id: str) -> str | None:
        """The API key the fleet monitor's probes send to a replica (its requests' own)."""
        replica = self.replicas.get(replica_id)
        return replica.api_key if replica is not None else None

    def _pool_probe_floor(self, pool: str) -> float | None:
        cfg = self.config.pools.get(pool)
        return cfg.deep_probe_min_interval_s if cfg is not None else None

    def _add(
        self, spec: ReplicaSpec, api_key: str | None = None, model_name: str | None = None
    ) -> Replica:
        rid = spec.replica_id
        replica = Replica(
            rid, spec.url, spec.model or None, spec.node, api_key, spec.engine, model_name
        )
        replica.pool = spec.pool
        self.replicas.add(replica)
        counts = replica.counts
        self.metrics.inflight.labels(rid).set_function(lambda: counts.requests)
        if len(self.config.pools) > 1:  # one pool: no pool series (the flat fleet)
            self.metrics.replica_pool.labels(rid, spec.pool).set(1)
        self._specs[rid] = spec
        self.monitor.add_replica(spec)
        return replica

    def _add_configured(self, replica_id: str, rc: ReplicaConfig) -> Replica:
        return self.add_replica(
            replica_id, rc.url, rc.model, rc.node, rc.api_key, rc.engine, rc.model_name, rc.pool
        )

    def remove_replica(self, replica_id: str) -> None:
        gone = self.replicas.remove(replica_id)
        if gone is not None:
            with contextlib.suppress(KeyError):
                self.metrics.replica_pool.remove(replica_id, gone.pool)
        self._specs.pop(replica_id, None)
        self.monitor.remove_replica(replica_id)
        if self.fleet_admission.control is not None:
            self.fleet_admission.control.forget(replica_id)
        with contextlib.suppress(KeyError):
            self.metrics.inflight.remove(replica_id)

    def apply_discovered(self, specs: list[ReplicaSpec]) -> None:
        """Make the routed set equal a discovered one (a replica's id is its address)."""
        self._reconcile(specs)

    def _reconcile(self, specs: list[ReplicaSpec]) -> None:
        """Make the routed and monitored set equal `specs`: a replica whose spec changed
        (a pod recreated under its name: a new uid or address) starts afresh."""
        wanted = {spec.replica_id: spec for spec in specs}
        for rid, spec in list(self._specs.items()):
            if wanted.get(rid) != spec:
                self.remove_replica(rid)
        for spec in specs:
            if spec.replica_id not in self._specs:
                rc = self._applied.get(spec.replica_id)  # a configured one keeps its key
                if rc is not None:
                    self._add(spec, rc.api_key, rc.model_name)
                else:  # discovered: the public name, if any, is discovery's
                    found = self.monitor.config.discovery
                    self._add(spec, None, found.model_name if found is not None else None)

    async def drain_replica(
        self, replica_id: str, timeout_s: float, stop_grace_s: float | None = None
    ) -> DrainReport:
        """No new work for the replica at once; in-flight requests (streamed or not) get
        `timeout_s` to finish; then, with `stop_grace_s`, the actuator stops it (SIGTERM,
        SIGKILL after the grace) and it leaves the fleet. Reports how many were cut."""
        replica = self.replicas.get(replica_id)
        if replica is None:
            raise KeyError(replica_id)
        self.monitor.drain(replica_id, restart=False)  # out of routing before the next request
        # Every instance's requests (the monitor's signals are fleet-wide with a cluster).
        cut = await self.monitor.signals.wait_idle(replica_id, clock.monotonic() + timeout_s)
        if cut:
            log.warning(
                "drain of %s hit its %.0fs deadline: cutting %d request(s)",
                replica_id,
                timeout_s,
                cut,
            )
        if stop_grace_s is None:
            return DrainReport(replica_id, cut, exited=False)
        actuator = self.monitor.actuator
        ref = ReplicaRef(replica_id, replica.url, replica.node, replica.model or "")
        stop = getattr(actuator, "remove", None) or actuator.stop
        self.remove_replica(replica_id)
        await stop(ref, stop_grace_s)
        return DrainReport(replica_id, cut, exited=actuator.name != "none")

    # -- reload -------------------------------------------------------------------------

    def reload(self, new: GatewayConfig) -> ReloadReport:
        """Apply a new configuration's tenants, keys, tiers and replicas, as one change.

        Nothing here awaits, so no request runs between two of its steps: a request that
        authenticates afterwards gets the new tenancy policy whole, one already past
        authentication finishes under the policy it started with (`tenancy.Policy`),
        and each attempt chooses among the replicas as they are when it chooses.
        Requests in flight are not touched. A replica the new file drops drains as a
        removed replica does (out of routing at once, in-flight work gets
        `drain.timeout_s`) and then leaves; one whose address, node, engine or served
        model changed is a different replica: the old one drains, then the new one
        joins under the same id. Other sections need a restart: they are named in the
        report and not applied. Raises ConfigError, with nothing applied, for a
        configuration this gateway cannot take."""
        old = self.config
        try:  # first, as the one step that may refuse: a refusal leaves all as it was
            self.tenancy.reload(new)
        except ValueError as e:
            raise ConfigError(f"tenants: {e}") from None
        report = self._reload_replicas(replica_configs(new))
        self.config = old.model_copy(
            update={"tenants": new.tenants, "tiers": new.tiers, "replicas": new.replicas}
        )
        self._seed_metrics()
        warn_if_open(self.config)
        return ReloadReport(
            tenants=_diff(old.tenants, new.tenants),
            tiers=_diff(old.tiers, new.tiers),
            replicas=report,
            not_applied=tuple(
                name
                for name in GatewayConfig.model_fields
                if name not in _RELOADABLE and getattr(old, name) != getattr(new, name)
            ),
        )

    def _reload_replicas(self, wanted: dict[str, ReplicaConfig]) -> Diff:
        added: list[str] = []
        removed: list[str] = []
        changed: list[str] = []
        for rid in self._applied.keys() - wanted.keys():
            removed.append(rid)
            self._after_retire.pop(rid, None)
            if self.replicas.get(rid) is not None and rid not in self._retiring:
                self._retire(rid)
        for rid, rc in wanted.items():
            before = self._applied.get(rid)
            current = self.replicas.get(rid)
            if rid in self._retiring:
                # Still draining from an earlier reload: it joins (as configured now)
                # once that drain is over.
                self._after_retire[rid] = rc
                (changed if before is not None else added).append(rid)
            elif current is None:
                if before == rc:
                    continue  # removed since (a rollout, the admin API); the file did not change
                self._add_configured(rid, rc)
                added.append(rid)
            elif before != rc:
                changed.append(rid)
                if _moved(current, rc):
                    self._after_retire[rid] = rc
                    self._retire(rid)
                else:  # the same engine: new credentials or public name, from now on
                    current.api_key, current.model_name = rc.api_key, rc.model_name
        self._applied = wanted
        return Diff(tuple(sorted(added)), tuple(sorted(removed)), tuple(sorted(changed)))

    def _retire(self, replica_id: str) -> None:
        """Drain a replica a reload removed (or moved), as `drain_replica` does: out of
        routing now, before the reload returns; in-flight work gets `drain.timeout_s`;
        then it leaves. A moved one joins again, as now configured, once it has left."""
        self.monitor.drain(replica_id, restart=False)
        deadline = clock.monotonic() + self.config.drain.timeout_s

        async def retire() -> None:
            try:
                # Every instance's requests (fleet-wide signals with a cluster).
                left = await self.monitor.signals.wait_idle(replica_id, deadline)
                if left:
                    log.warning(
                        "reload: %s still has %d request(s) in flight at its drain deadline; "
                        "they finish on their connections, outside the fleet",
                        replica_id,
                        left,
                    )
                self.remove_replica(replica_id)
                log.info("reload: %s left the fleet", replica_id)
            finally:
                self._retiring.pop(replica_id, None)
            rc = self._after_retire.pop(replica_id, None)
            if rc is not None and not self.draining:
                self._add_configured(replica_id, rc)
                log.info("reload: %s joined at %s", replica_id, rc.url)

        self._retiring[replica_id] = asyncio.get_running_loop().create_task(retire())

    def fleet_load(self) -> float:
        """Mean KV usage over replicas where scraped, else in-flight per replica / 16.

        Only hedging reads it, to tell a lightly loaded fleet from a busy one.
        """
        snap: FleetSnapshot = self.replicas.snapshot()
        loads: list[float] = []
        for r in self.replicas.all():
            view = snap.replicas.get(r.id)
            if view is not None and view.load is not None and view.load.kv_usage is not None:
                loads.append(view.load.kv_usage)
            else:
                loads.append(min(1.0, r.counts.requests / 16))
        return sum(loads) / len(loads) if loads else 1.0

    # -- HTTP ---------------------------------------------------------------------------

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.limits.max_body_bytes)
        proxy = self.proxy

        def handler(route: Route) -> Handler:
            async def handle(request: web.Request) -> web.StreamResponse:
                return await proxy.handle(request, route)

            return handle

        async def method_not_allowed(request: web.Request) -> web.Response:
            return _error(
                ApiError(405, f"Method {request.method} is not allowed on {request.path}.")
            )

        async def not_found(request: web.Request) -> web.Response:
            return _error(ApiError(404, f"Route {request.method} {request.path} not found."))

        # Every engine route the gateway passes through (protocol/routes.py), POST only,
        # as vLLM registers them; any other method is a 405.
        for spec in ROUTES.values():
            app.router.add_post(spec.path, handler(spec.name))
            app.router.add_route("GET", spec.path, method_not_allowed)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        # Answered by the gateway itself, for tools that expect an engine's or a router's
        # routes: guidellm refuses a target whose GET /health is 404.
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_route("*", "/ping", self._ping)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", not_found)
        return app

    async def _models(self, request: web.Request) -> web.Response:
        data = []
        for model in self.replicas.models():  # the public names
            card = self.catalog.card(model) or {
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
        """Readiness is the gateway's own ability to answer: it listens, its config is
        loaded, it is not draining. A fleet with no usable replica does not make it
        unready: pulled from the Service, every gateway pod would turn a clean 503 with
        Retry-After into a connection error. The fleet's state is in the body;
        `?fleet=1` also requires a usable replica (for tools that wait for capacity)."""
        ready = self.replicas.any_ready(clock.monotonic())
        fleet = {"usable_replica": ready, "replicas": len(self.replicas.all())}
        # With several instances, this one's place in the fleet, fail-static included:
        # detail only. An instance on its last view still answers, so it stays ready.
        more = {"cluster": self.cluster_status()} if self.cluster is not None else {}
        if self.draining:
            return _json(503, {"status": "draining", "fleet": fleet, **more})
        if request.query.get("fleet") == "1" and not ready:
            return _json(503, {"status": "no usable replica", "fleet": fleet, **more})
        return _json(200, {"status": "ready", "fleet": fleet, **more})

    def cluster_status(self) -> dict[str, Any]:
        if self.cluster is None:
            return {"role": "leader", "store": "none", "fail_static": False, "instances": 1}
        return {
            "store": self.config.cluster.store,
            **self.cluster.status().to_json(),
            "quota": self.quota_figures(),
        }

    def operator_route(self) -> OperatorRoute:
        """Where an operator action sent to this instance's admin API is carried out."""
        return ActHere() if self.cluster is None else self.cluster.operator_route()

    def instance_count(self) -> int:
        """Live gateway instances in the fleet (budgets are sized as the fleet's / N)."""
        return 1 if self.cluster is None else self.cluster.instance_count()

    async def _health(self, request: web.Request) -> web.Response:
        # vllm-router's answer (production-stack: {"status": "healthy"}); vLLM's own is
        # an empty 200. Clients check the status code.
        return _json(200, {"status": "healthy"})

    async def _version(self, request: web.Request) -> web.Response:
        from seawall import __version__

        return _json(200, {"version": __version__})  # vLLM's shape

    async def _ping(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "POST"):
            return _error(ApiError(405, f"Method {request.method} is not allowed on /ping."))
        return web.Response(status=200)  # vLLM's (SageMaker's) /ping: an empty 200

    def _seed_metrics(self) -> None:
        """Series the gateway can name in advance exist at zero (see `Metrics.seed`)."""
        replicas = self.replicas.all()
        pools = sorted({r.pool for r in replicas}) if len(self.config.pools) > 1 else []
        self.metrics.seed(
            replicas=[(r.id, failure_domain(r.node, r.id)) for r in replicas],
            models=self.replicas.models(),
            tenants={name: t.tier for name, t in self.config.tenants.items()},
            pools=pools,
        )

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
        keys = self.tenancy.keys
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
        self._seed_metrics()  # replicas and models that came or went since the last scrape
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    # -- lifecycle ----------------------------------------------------------------------

    async def start(
        self, host: str | None = None, port: int | None = None, *, reuse_port: bool = False
    ) -> int:
        """Open the connection pool, start the monitor and discovery, listen. Returns the
        bound port. `reuse_port`: share the port with other processes (SO_REUSEPORT), as
        the workers of `seawall serve --workers` do."""
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
        await self.tenancy.start()
        if self.cluster is None:
            await self._start_discovery()  # with a cluster, the leader alone discovers
        self._tasks.append(asyncio.create_task(self.catalog.run(self.session)))
        if not self.pools.single:
            self._observe_pools()
            self._tasks.append(asyncio.create_task(self._pool_tick()))
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
            # The drain sequence (`shutdown`) has ended every request before the runner
            # is cleaned up; aiohttp's own 60 s wait must not add to its deadline.
            shutdown_timeout_s=CUT_GRACE_S,
            reuse_port=reuse_port,
        )
        self.port = self.front_door.port
        if self.admin is not None:
            await self.admin.start()
        if self.cluster is not None:
            # Last: other instances reach this one at the admin URL it advertises.
            cc = self.config.cluster
            if cc.election == "kubernetes":
                from seawall.cluster.kube import KubernetesLeaseElector, kube_api_client

                self.cluster.elector = KubernetesLeaseElector(
                    await kube_api_client(), cc.lease_name, cc.lease_namespace
                )
            await self.cluster.start()
        return self.port

    async def _start_discovery(self) -> None:
        discovery = self.monitor.config.discovery
        if discovery is None:
            return
        from seawall.fleet.discovery import build_discovery

        api_client = None
        if discovery.mode == "endpointslices":
            if self._kube_client is None:
                from seawall.cluster.kube import kube_api_client

                self._kube_client = await kube_api_client()
            api_client = self._kube_client
        self.monitor.start_discovery(
            build_discovery(discovery, api_client),
            discovery.interval_s,
            discovery.model or "",
            discovery.engine,
            apply=self.apply_discovered,
        )

    # -- the cluster's hooks (see the module docstring) ---------------------------------

    async def _cluster_promote(self) -> None:
        self.replicas.outlier_rule = None  # the leader's own probes judge the replicas
        if self.quota_issuer is not None:
            self.quota_issuer.reset()  # carries on from the last view's holds
        await self.monitor.lead()
        await self._start_discovery()

    async def _cluster_demote(self) -> None:
        if self.quota_issuer is not None:
            self.quota_issuer.reset()
        self.monitor.follow()
        self.replicas.outlier_rule = _outlier_rule(self.config.cluster)

    def _cluster_quotas(self, reports: Mapping[str, InstanceReport]) -> Mapping[str, Any]:
        """The leader's grants for the view being published (the role manager's hook):
        the other instances' reports and this one's own, divided by `quota_issuer`."""
        cluster, issuer = self.cluster, self.quota_issuer
        if cluster is None or issuer is None:
            return {}
        epoch, seq = cluster.applied
        own = InstanceReport(
            instance=cluster.instance,
            view_epoch=epoch,
            view_seq=seq,
            replicas=self._cluster_reports(),
        )
        everyone = {**reports, cluster.instance: own}
        return issuer.issue(
            everyone,
            cluster.publishing,
            clock.monotonic(),
            cluster.all_quotas(),
            cluster.peers.last_seen,
        )

    def _quota_capacities(self) -> dict[str, dict[str, int]]:
        """What the leader divides per replica: its KV blocks as admission counts them
        (times kv_reserve_max, or the adaptive kv_target), and `inflight_max` sequences."""
        snap = self.monitor.snapshot()
        ratio, inflight_max = self.fleet_admission.divided()
        out: dict[str, dict[str, int]] = {}
        for r in self.replicas.all():
            view = snap.replicas.get(r.id)
            per = capacity_of(view.load if view is not None else None, ratio, inflight_max)
            if per:
                out[r.id] = per
        return out

    def _cluster_instances_changed(self, instances: int) -> None:
        self.budget.share(instances, clock.monotonic())

    def quota_figures(self) -> dict[str, Any]:
        """This instance's grants and use per replica, and (on the leader) what it has
        divided: for /readyz's cluster detail, the admin API and benchmarks."""
        if self.cluster is None or self.fleet_admission.grants is None:
            return {"enabled": False}
        now = clock.monotonic()
        grants = self.fleet_admission.grants.figures()
        mine = {}
        for r in self.replicas.all():
            demand = self.fleet_admission.demand(r, now)
            mine[r.id] = {"grant": grants.get(r.id), "demand": demand}
        out: dict[str, Any] = {"enabled": True, "granted": bool(grants), "replicas": mine}
        if self.cluster.leading and self.quota_issuer is not None:
            out["divided"] = self.quota_issuer.figures()
        return out

    def _cluster_apply_view(self, view: PublishedView) -> None:
        self._reconcile([p.spec for p in view.replicas])
        for p in view.replicas:
            r = self.replicas.get(p.spec.replica_id)
            if r is not None and r.model is None and p.view.model:
                r.model = p.view.model  # learnt by the leader; our catalog may be later
        self.monitor.apply_view(view)

    def _cluster_export_view(
        self, leader: str, epoch: int, seq: int, wall: float, quotas: Mapping[str, Any]
    ) -> PublishedView:
        return self.monitor.export_view(leader, epoch, seq, wall, dict(quotas))

    def _cluster_reports(self) -> dict[str, ReplicaReport]:
        now = clock.monotonic()
        return replica_reports(self.replicas, lambda r: self.fleet_admission.demand(r, now))

    def _cluster_extra(self) -> dict[str, Any]:
        """This instance's answers so far, for the leader's rollout report."""
        return {"answers": tally(self.metrics).to_json()}

    async def fleet_tallies(self, fresh_after_wall: float | None = None) -> dict[str, Tally]:
        """Every instance's answers so far (see `rollout.FleetOps.fleet_tallies`)."""
        if self.cluster is None:
            return {"local": tally(self.metrics)}
        cluster = self.cluster
        if fresh_after_wall is not None:
            bound = clock.monotonic() + self.config.cluster.member_ttl_s
            await cluster.peers.wait_reports_since(fresh_after_wall, bound)
        out = {cluster.instance: tally(self.metrics)}
        for name, report in cluster.peers.reports.items():
            theirs = Tally.from_json(report.extra.get("answers"))
            if theirs is not None:
                out[name] = theirs
        return out

    def _cluster_epoch(self) -> int:
        return self.cluster.epoch if self.cluster is not None else 0

    def _advertised_admin_url(self) -> str:
        cc, admin = self.config.cluster, self.config.admin
        if cc.advertise_admin_url:
            return cc.advertise_admin_url.rstrip("/")
        if self.admin is None or self.admin.port is None:
            return ""
        host = admin.host
        if host in ("0.0.0.0", "::", ""):
            host = os.environ.get("POD_IP") or socket.gethostname()
        return f"http://{host}:{self.admin.port}"

    async def shutdown(self, timeout_s: float | None = None) -> int:
        """The drain sequence. Returns how many requests its deadline cut."""
        # 1. Refuse new work: /readyz fails at once (the balancer stops sending) and new
        #    requests get 503 + Retry-After (`draining`), before anything else changes.
        self.draining = True
        self.metrics.draining.set(1)
        if self.cluster is not None:
            self.cluster.withdraw()  # leadership goes to an instance that stays
        # 2. Let what is in flight finish, up to the deadline: an event on the ledger,
        #    set by the release that brings the count to zero.
        timeout = self.config.drain.timeout_s if timeout_s is None else timeout_s
        left = await self.ledger.wait_zero(None, clock.monotonic() + timeout)
        # 3. At the deadline, end what is left cleanly: a stream gets an error event and
        #    `data: [DONE]`, a request not yet answered a 503; their upstreams close, so
        #    the engines abort them.
        if left:
            log.warning("drain deadline (%.0fs) reached: cutting %d request(s)", timeout, left)
            self.ledger.cut_all("gateway_draining")
            await self.ledger.wait_zero(None, clock.monotonic() + CUT_GRACE_S)
        else:
            log.info("drained cleanly")
        # 4. Close everything, listener first.
        await self.close()
        return left

    async def close(self) -> None:
        """Stop listening, then stop what runs in the background, then release what the
        gateway holds. Requests still running are cancelled (use `shutdown` to drain)."""
        tasks = [*self._tasks, *self._retiring.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.front_door is not None:
            await self.front_door.close()  # the listener: no new connections, then closed
        if self.admin is not None:
            await self.admin.close()
        if self.cluster is not None:
            await self.cluster.stop()  # hands the lease over before the monitor stops
        await self.monitor.stop()
        await self.monitor.actuator.close()
        await self.tenancy.close()
        if self._cluster_store is not None:
            await self._cluster_store.close()
        if self.cluster is not None and self.cluster.elector is not self.cluster.store:
            await self.cluster.elector.close()
        if self._kube_client is not None:
            await self._kube_client.close()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)  # exports what is still batched
        self.upstream.close()
        if self._session is not None:
            await self._session.close()


def _cluster_store(cc: ClusterConfig) -> ClusterStore:
    """The configured cluster store; constructing it does no I/O."""
    if cc.store == "redis":
        from seawall.cluster.redis_store import RedisStore

        return RedisStore(cc.redis_url, cc.key_prefix, socket_timeout_s=cc.store_timeout_s)
    from seawall.cluster.local import LocalStoreClient

    return LocalStoreClient(cc.local_socket, timeout_s=cc.store_timeout_s)


def _outlier_rule(cc: ClusterConfig) -> OutlierRule:
    return OutlierRule(
        consecutive_failures=cc.outlier_consecutive_failures,
        ejection_s=cc.outlier_ejection_s,
        max_ejection_s=cc.outlier_max_ejection_s,
        max_ejected_fraction=cc.outlier_max_ejected_fraction,
    )


def _default_instance_id() -> str:
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def replica_configs(config: GatewayConfig) -> dict[str, ReplicaConfig]:
    """The configured replicas by id (an entry without one is `r<index>`)."""
    return {rc.id or f"r{i}": rc for i, rc in enumerate(config.replicas)}


def _moved(r: Replica, rc: ReplicaConfig) -> bool:
    """A different engine behind the same id: a new address, node, engine kind or model."""
    model_changed = rc.model is not None and rc.model != r.model
    return model_changed or (r.url, r.node, r.engine) != (rc.url, rc.node, rc.engine)


# What a reload applies (`model_list` is merged into `replicas` when a file is read).
_RELOADABLE = frozenset({"tenants", "tiers", "replicas", "model_list"})


@dataclass(frozen=True, slots=True)
class Diff:
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()

    def __str__(self) -> str:
        parts = [
            f"{sign}{', '.join(names)}"
            for sign, names in (("+", self.added), ("-", self.removed), ("~", self.changed))
            if names
        ]
        return " ".join(parts) or "unchanged"


def _diff(old: Mapping[str, object], new: Mapping[str, object]) -> Diff:
    return Diff(
        tuple(sorted(new.keys() - old.keys())),
        tuple(sorted(old.keys() - new.keys())),
        tuple(sorted(k for k in old.keys() & new.keys() if old[k] != new[k])),
    )


@dataclass(frozen=True, slots=True)
class ReloadReport:
    tenants: Diff
    tiers: Diff
    replicas: Diff
    not_applied: tuple[str, ...]  # sections that changed but need a restart

    def __str__(self) -> str:
        return f"tenants {self.tenants}; tiers {self.tiers}; replicas {self.replicas}"


def _log_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("background task failed: %r", task.exception())
