"""The role manager: which gateway instance leads the fleet, and what every instance does
about it. Owned by the composition root (`gateway/app.py`), which gives it its hooks.

Every instance, every `heartbeat_interval_s`: writes its report (its in-flight counts
per replica, `report.py`, and its `hooks.report_extra` figures) with a TTL, and reads
every live instance's (`Peers`: what the leader sums for drains and the watchdog, and
`instance_count()`). Every `renew_interval_s`: tries to take or renew the lease through
its `Elector` (the store itself, or a Kubernetes Lease), or, with `may_lead` off, only
reads who holds it.

The leader runs the full fleet monitor (`hooks.promote`) and publishes the fleet view
(`hooks.export_view`) on every change, at most every `min_publish_interval_s` and at
least every `publish_interval_s`, as a fenced write: a leader deposed while it stalled
cannot overwrite its successor's view. Followers run no probes (`hooks.demote`) and poll
the view every `view_poll_interval_s`, applying each newer one (`hooks.apply_view`).

Promotion carries on from the newest view (the store's, if newer than the one applied),
so replica states survive the move; with a Kubernetes Lease the new leader first raises
the store's fencing epoch to its own. Demotion happens when another instance holds the
lease, or when this one could not renew it for `lease_ttl_s - renew_interval_s` (it
stops before anyone else can start: `policy.leadership`).

Fail-static: when the store is unreachable, or a follower's view is older than
`view_stale_s`, the instance keeps serving on the view it has (without its engine
readings once they are stale, `hooks.hold_view`) plus its own passive signals, and
says so: `status()` (the `/readyz` body, the admin API), the metrics
`seawall_cluster_role`, `seawall_cluster_fail_static` and `seawall_fleet_view_age_seconds`,
and one log line per transition. Nothing restarts: when the store returns, the loops
simply succeed again.

Operator actions on a follower go to the leader (`operator_route()`: act here, forward
to the leader's admin URL from the lease, or no leader reachable).

Seams: `instance_count()` (budgets sized as fleet/N, and `hooks.instances_changed` when
it changes); `quotas()` (this instance's entry in the view's `quotas`, which the leader
fills through `hooks.quotas`, as it publishes the view `publishing`; `all_quotas()` is
the whole map, for a new leader to carry on from); the reports' `demand` (filled through
`hooks.replica_reports`; `applied` is the view a report confirms).

Must not: decide anything about replicas (the monitor does), sit on the request path
(everything here runs in its own tasks; reads are attribute reads), or read the clock
other than through `seawall.clock`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import Gauge

from seawall import clock
from seawall.cluster.report import (
    InstanceReport,
    ReplicaReport,
    decode_report,
    encode_report,
)
from seawall.cluster.store import ClusterStore, Elector, FencedOut, Lease, StoreUnavailable
from seawall.config import ClusterConfig
from seawall.fleet.published import PublishedView, ViewClock, decode_view, encode_view, view_order
from seawall.fleet.signals import Observed
from seawall.policy.leadership import Standing, failover_bound_s, must_step_down, standing

log = logging.getLogger("seawall.cluster")

VIEW_KEY = "fleet:view"
# How long a departed instance's last sighting is kept (far beyond any release time).
_SEEN_KEPT_S = 600.0
LEADER = "leader"
FOLLOWER = "follower"


@dataclass(frozen=True, slots=True)
class RoleHooks:
    """What the role manager calls in the composition root (plain callables: no
    component takes the gateway object)."""

    promote: Callable[[], Awaitable[None]]
    demote: Callable[[], Awaitable[None]]
    apply_view: Callable[[PublishedView], None]
    export_view: Callable[[str, int, int, float, Mapping[str, Any]], PublishedView]
    replica_reports: Callable[[], Mapping[str, ReplicaReport]]
    admin_url: Callable[[], str]
    # The leader's per-instance grants, from the live reports (the exact-admission seam).
    quotas: Callable[[Mapping[str, InstanceReport]], Mapping[str, Any]] = lambda reports: {}
    # Further per-instance figures for the report's `extra` (e.g. what a rollout sums
    # over the fleet: answers that failed, streams dropped).
    report_extra: Callable[[], Mapping[str, Any]] = lambda: {}
    # Fail-static, with a view older than `view_stale_s`: keep it, without its stale
    # engine readings (`FleetMonitor.hold_view`); called every poll while it lasts.
    hold_view: Callable[[], None] = lambda: None
    # The number of live instances changed (budgets that are a share of the fleet's).
    instances_changed: Callable[[int], None] = lambda n: None


class ClusterMetricFamilies(Protocol):
    @property
    def cluster_role(self) -> Gauge: ...
    @property
    def cluster_fail_static(self) -> Gauge: ...
    @property
    def fleet_view_age(self) -> Gauge: ...
    @property
    def cluster_instances(self) -> Gauge: ...


# -------------------------------------------------------------------- operator actions


@dataclass(frozen=True, slots=True)
class ActHere:
    """This instance leads (or runs alone): act on the fleet here."""


@dataclass(frozen=True, slots=True)
class ForwardTo:
    """Another instance leads: send the action to its admin API."""

    admin_url: str
    leader: str


@dataclass(frozen=True, slots=True)
class NoLeader:
    """No leader is reachable now: the operator retries after `retry_after_s`."""

    retry_after_s: float
    why: str


OperatorRoute = ActHere | ForwardTo | NoLeader


# ------------------------------------------------------------------------------ status


@dataclass(frozen=True, slots=True)
class ClusterStatus:
    instance: str
    role: str
    fail_static: bool
    reason: str
    leader: str | None
    leader_admin_url: str | None
    epoch: int
    view_age_s: float | None
    instances: int
    failover_bound_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "instance": self.instance,
            "role": self.role,
            "fail_static": self.fail_static,
            "reason": self.reason,
            "leader": self.leader,
            "leader_admin_url": self.leader_admin_url,
            "epoch": self.epoch,
            "view_age_s": self.view_age_s,
            "instances": self.instances,
            "failover_bound_s": self.failover_bound_s,
        }


# ------------------------------------------------------------------------------- peers


@dataclass(eq=False)
class Peers:
    """The other live instances' latest reports: `fleet.signals.PeerCounts` for the
    leader's monitor. `needed()` is the (epoch, seq) of the first view published after
    the latest change: a report that applied an older one may predate a replica leaving
    routing, so its zero counts prove nothing yet."""

    needed: Callable[[], tuple[int, int]] = lambda: (0, 0)
    reports: dict[str, InstanceReport] = field(default_factory=dict)
    # When each instance's report was last among the members read (monotonic seconds),
    # kept a while after it is gone: a new leader counts a departed instance's holds
    # from then, not from its own promotion (`policy.quota.inherit`).
    last_seen: dict[str, float] = field(default_factory=dict)
    # Chunks relayed by instances that have left, kept so that the sum never goes down.
    _retired_chunks: dict[str, int] = field(default_factory=dict)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def update(self, reports: Mapping[str, InstanceReport], now: float) -> None:
        for name, old in self.reports.items():
            if name not in reports:
                for rid, r in old.replicas.items():
                    self._retired_chunks[rid] = self._retired_chunks.get(rid, 0) + r.chunks_relayed
        self.reports = dict(reports)
        for name in reports:
            self.last_seen[name] = now
        for name in [n for n, t in self.last_seen.items() if now - t > _SEEN_KEPT_S]:
            del self.last_seen[name]
        self._changed.set()
        self._changed = asyncio.Event()

    def requests(self, replica_id: str) -> int:
        return sum(r.replicas[replica_id].requests for r in self._with(replica_id))

    def streams(self, replica_id: str) -> int:
        return sum(r.replicas[replica_id].streams for r in self._with(replica_id))

    def kv_blocks(self, replica_id: str) -> int:
        return sum(r.replicas[replica_id].kv_blocks for r in self._with(replica_id))

    def chunks_relayed_total(self, replica_id: str) -> int:
        live = sum(r.replicas[replica_id].chunks_relayed for r in self._with(replica_id))
        return live + self._retired_chunks.get(replica_id, 0)

    def observed(self, replica_id: str) -> list[Observed]:
        return [
            Observed(
                r.replicas[replica_id].ttft_ewma_s,
                r.replicas[replica_id].itl_ewma_s,
                r.replicas[replica_id].error_ewma,
            )
            for r in self._with(replica_id)
        ]

    def _with(self, replica_id: str) -> list[InstanceReport]:
        return [r for r in self.reports.values() if replica_id in r.replicas]

    def _pending(self, replica_id: str) -> tuple[int, bool]:
        needed = self.needed()
        behind = any(r.view_applied < needed for r in self.reports.values())
        return self.requests(replica_id), behind

    async def wait_reports_since(self, wall: float, deadline: float) -> bool:
        """Until every live peer has reported as of wall-clock `wall` or later (what it
        counted up to then is in), or the monotonic `deadline`. True if all had."""
        while True:
            if all(r.sent_wall >= wall for r in self.reports.values()):
                return True
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()

    async def wait_idle(self, replica_id: str, deadline: float) -> int:
        while True:
            left, behind = self._pending(replica_id)
            if left == 0 and not behind:
                return 0
            remaining = deadline - clock.monotonic()
            if remaining <= 0:
                return left
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(remaining):
                    await self._changed.wait()  # the next round of reports


# ------------------------------------------------------------------------ role manager


class RoleManager:
    """See the module docstring. `start()` runs its loops; `stop()` leaves the fleet
    (releasing the lease if held, so that a successor need not wait for its TTL)."""

    def __init__(
        self,
        *,
        instance: str,
        store: ClusterStore,
        elector: Elector | None,
        hooks: RoleHooks,
        timing: ClusterConfig,
        metrics: ClusterMetricFamilies | None = None,
    ) -> None:
        self.instance = instance
        self.store = store
        self.elector: Elector = elector or store
        self.hooks = hooks
        self.timing = timing  # the intervals, documented in `seawall.config.ClusterConfig`
        self.metrics = metrics
        self.peers = Peers(needed=lambda: (self._epoch, self._pending_seq))
        self._leading = False
        self._lease: Lease | None = None
        self._epoch = 0  # of the lease this instance holds (its fencing token)
        self._seen_epoch = 0  # the highest epoch seen anywhere (the floor for a new one)
        self._seq = 0  # the last view published or applied
        self._pending_seq = 0  # the first view published after the latest change
        self._applied: tuple[int, int] = (0, 0)
        self._view: PublishedView | None = None
        self._view_clock = ViewClock()
        self._last_renewed: float | None = None
        self._store_failing_since: float | None = None
        self._store_back_at = -1e9
        self._store_error = ""
        self._standing = Standing(False)
        self._instances = 1
        self._dirty = asyncio.Event()
        self._last_publish = -1e9
        self._tasks: list[asyncio.Task[None]] = []
        self._role_lock = asyncio.Lock()
        self._candidate = True  # stands for election (until `withdraw`)
        if metrics is not None:
            metrics.fleet_view_age.set_function(lambda: self.view_age_s() or 0.0)
            metrics.cluster_instances.set_function(lambda: self._instances)
        self._export_role()

    # -- read side (attribute reads; safe anywhere) --------------------------------------

    @property
    def leading(self) -> bool:
        return self._leading

    @property
    def epoch(self) -> int:
        """The fencing token of this instance's writes (its lease's epoch)."""
        return self._epoch

    def instance_count(self) -> int:
        """Live gateway instances, this one included (never below one)."""
        return self._instances

    def view_age_s(self) -> float | None:
        if self._leading and self._store_failing_since is None:
            return 0.0
        if self._view is None:
            return None
        return max(0.0, clock.monotonic() - self._view.taken_at)

    def quotas(self) -> Any:
        """This instance's entry in the last view's `quotas` (None if it has none)."""
        return None if self._view is None else self._view.quotas.get(self.instance)

    def fallback_share(self) -> float | None:
        """While the store is unreachable: this instance's even share of what the leader
        divides, by the most instances it last knew of (itself included). None while
        the store answers (a grant is on its way then)."""
        if self._store_failing_since is None:
            return None
        quotas = self.all_quotas()
        known = len(quotas) + (self.instance not in quotas)
        return 1.0 / max(1, self._instances, known)

    def all_quotas(self) -> Mapping[str, Any]:
        """Every instance's entry in the last view this instance applied or published."""
        return {} if self._view is None else self._view.quotas

    @property
    def applied(self) -> tuple[int, int]:
        """(epoch, seq) of the last view this instance applied (or, leading, published)."""
        return self._applied

    @property
    def publishing(self) -> tuple[int, int]:
        """(epoch, seq) of the view being published: valid inside `hooks.quotas`."""
        return (self._epoch, self._seq)

    def status(self) -> ClusterStatus:
        self._assess()
        lease = self._lease
        return ClusterStatus(
            instance=self.instance,
            role=LEADER if self._leading else FOLLOWER,
            fail_static=self._standing.fail_static,
            reason=self._standing.reason,
            leader=lease.holder if lease is not None else None,
            leader_admin_url=lease.info if lease is not None else None,
            epoch=lease.epoch if lease is not None else self._epoch,
            view_age_s=self.view_age_s(),
            instances=self._instances,
            failover_bound_s=failover_bound_s(
                self.timing.lease_ttl_s, self.timing.renew_interval_s
            ),
        )

    def operator_route(self) -> OperatorRoute:
        if self._leading:
            return ActHere()
        retry = max(1.0, self.timing.renew_interval_s)
        if self._store_failing_since is not None:
            return NoLeader(retry, f"the cluster store is unreachable ({self._store_error})")
        lease = self._lease
        if lease is None or lease.holder == self.instance:
            return NoLeader(retry, "no instance leads the fleet right now (an election is due)")
        if not lease.info:
            return NoLeader(retry, f"the leader {lease.holder} published no admin URL")
        return ForwardTo(lease.info, lease.holder)

    def withdraw(self) -> None:
        """Stop standing for election (the instance is draining): a leader keeps its
        lease until it stops, a follower no longer takes one, so leadership does not move
        to an instance about to leave."""
        self._candidate = False

    def changed(self) -> None:
        """The leader's fleet changed (a monitor snapshot listener): publish soon."""
        if self._leading:
            self._pending_seq = self._seq + 1
            self._dirty.set()

    # -- lifecycle ----------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        for coro in (self._heartbeat_loop(), self._election_loop(), self._view_loop()):
            self._tasks.append(loop.create_task(coro))
        for task in self._tasks:
            task.add_done_callback(_log_crash)

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._leading:
            await self._demote("shutting down")
            with contextlib.suppress(StoreUnavailable, TimeoutError):
                async with asyncio.timeout(self.timing.renew_interval_s):
                    await self.elector.release(self.instance)
        with contextlib.suppress(StoreUnavailable, TimeoutError):
            async with asyncio.timeout(self.timing.renew_interval_s):
                await self.store.leave(self.instance)

    # -- store health -------------------------------------------------------------------

    def _store_ok(self) -> None:
        if self._store_failing_since is not None:
            self._store_failing_since = None
            self._store_error = ""
            self._store_back_at = clock.monotonic()
        self._assess()

    def _store_failed(self, error: BaseException) -> None:
        if self._store_failing_since is None:
            self._store_failing_since = clock.monotonic()
        self._store_error = str(error) or type(error).__name__
        self._assess()

    def _assess(self) -> None:
        now = clock.monotonic()
        view_at = self._view.taken_at if self._view is not None else None
        new = standing(
            leading=self._leading,
            now=now,
            store_failing_since=self._store_failing_since,
            store_error=self._store_error,
            view_taken_at=view_at,
            view_stale_s=self.timing.view_stale_s,
        )
        old = self._standing
        self._standing = new
        if new.fail_static != old.fail_static:
            if new.fail_static:
                log.warning("fail-static: %s", new.reason)
            else:
                log.warning("fleet view current again: no longer fail-static")
        if self.metrics is not None:
            self.metrics.cluster_fail_static.set(1 if new.fail_static else 0)

    def _export_role(self) -> None:
        if self.metrics is not None:
            for role in (LEADER, FOLLOWER):
                on = (role == LEADER) == self._leading
                self.metrics.cluster_role.labels(role).set(1 if on else 0)

    # -- loops --------------------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            await self._beat()
            await asyncio.sleep(self.timing.heartbeat_interval_s)

    async def _beat(self) -> None:
        report = InstanceReport(
            instance=self.instance,
            admin_url=self.hooks.admin_url(),
            role=LEADER if self._leading else FOLLOWER,
            view_epoch=self._applied[0],
            view_seq=self._applied[1],
            sent_wall=clock.wall(),
            replicas=self.hooks.replica_reports(),
            extra=self.hooks.report_extra(),
        )
        try:
            await self.store.heartbeat(
                self.instance, encode_report(report), self.timing.member_ttl_s
            )
            raw = await self.store.members()
        except StoreUnavailable as e:
            self._store_failed(e)
            return
        self._store_ok()
        reports: dict[str, InstanceReport] = {}
        for name, item in raw.items():
            if name == self.instance:
                continue
            try:
                reports[name] = decode_report(item)
            except ValueError as e:
                log.debug("ignoring the report of %s: %s", name, e)
        live = 1 + len(reports)
        if clock.monotonic() - self._store_back_at < self.timing.member_ttl_s:
            # A store that just came back (perhaps empty) fills up again as instances
            # heartbeat: until each had its turn, a smaller count is not news.
            live = max(live, self._instances)
        changed = live != self._instances
        self._instances = live
        self.peers.update(reports, clock.monotonic())
        if changed:
            self.hooks.instances_changed(live)

    async def _election_loop(self) -> None:
        while True:
            await self._elect()
            await asyncio.sleep(self.timing.renew_interval_s)

    async def _elect(self) -> None:
        t = self.timing
        started = clock.monotonic()
        try:
            if t.may_lead and (self._candidate or self._leading):
                lease = await self.elector.acquire(
                    self.instance, self.hooks.admin_url(), t.lease_ttl_s, self._seen_epoch
                )
            else:
                lease = None  # follows only (`cluster.may_lead: false`): reads the lease
            if lease is None or lease.holder != self.instance:
                lease = await self.elector.leader()
        except StoreUnavailable as e:
            self._store_failed(e)
            if self._leading and must_step_down(
                clock.monotonic(), self._last_renewed, t.lease_ttl_s, t.renew_interval_s
            ):
                await self._demote(f"could not renew the lease: {e}")
            return
        if self.elector is self.store:
            self._store_ok()
        self._lease = lease
        if lease is not None:
            self._seen_epoch = max(self._seen_epoch, lease.epoch)
        if lease is not None and lease.holder == self.instance:
            # Renewed as of when we asked: the store's TTL runs from no earlier than that.
            self._last_renewed = started
            if not self._leading:
                await self._promote(lease)
        elif self._leading:
            holder = lease.holder if lease is not None else "nobody"
            await self._demote(f"the lease is held by {holder}")

    async def _promote(self, lease: Lease) -> None:
        async with self._role_lock:
            if self._leading:
                return
            try:
                if self.elector is not self.store:
                    # Elected elsewhere (a Kubernetes Lease): fence the store first, so the
                    # old leader's late writes are refused from now on.
                    await self.store.raise_epoch(lease.epoch)
                await self._catch_up()
            except StoreUnavailable as e:
                self._store_failed(e)
                log.warning("elected, but the cluster store is unreachable: not leading yet")
                return
            self._epoch = lease.epoch
            self._leading = True
            self._pending_seq = self._seq + 1
            await self.hooks.promote()
            self._export_role()
            self._assess()
            log.warning(
                "instance %s now leads the fleet (epoch %d; %d instance(s) live)",
                self.instance,
                lease.epoch,
                self._instances,
            )
            self._dirty.set()

    async def _catch_up(self) -> None:
        """Before leading, apply the newest view in the store if it is newer than ours
        (this instance may have been cut off while another led)."""
        raw = await self.store.get(VIEW_KEY)
        if raw is not None:
            self._apply(raw)

    async def _demote(self, why: str) -> None:
        async with self._role_lock:
            if not self._leading:
                return
            self._leading = False
            await self.hooks.demote()
            self._export_role()
            self._assess()
            log.warning("instance %s no longer leads the fleet: %s", self.instance, why)

    async def _view_loop(self) -> None:
        while True:
            if self._leading:
                await self._publish_when_due()
            else:
                await self._follow_once()
                age_s = self.view_age_s()
                if age_s is not None and age_s > self.timing.view_stale_s:
                    self.hooks.hold_view()
                await asyncio.sleep(self.timing.view_poll_interval_s)

    async def _publish_when_due(self) -> None:
        t = self.timing
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(t.publish_interval_s):
                await self._dirty.wait()
        spacing = t.min_publish_interval_s - (clock.monotonic() - self._last_publish)
        if spacing > 0:
            await asyncio.sleep(spacing)  # coalesce a burst of changes into one write
        if not self._leading:
            return
        self._dirty.clear()
        self._seq += 1
        epoch, seq = self._epoch, self._seq
        now = clock.monotonic()
        view = self.hooks.export_view(
            self.instance, epoch, seq, clock.wall(), self.hooks.quotas(self.peers.reports)
        )
        raw = encode_view(view, now)
        self._last_publish = now
        try:
            await self.store.put(VIEW_KEY, raw, epoch)
        except FencedOut as e:
            await self._demote(f"a newer leader fenced this one out ({e})")
            return
        except StoreUnavailable as e:
            self._store_failed(e)
            return
        self._store_ok()
        self._applied = (epoch, seq)
        self._view = view

    async def _follow_once(self) -> None:
        try:
            raw = await self.store.get(VIEW_KEY)
        except StoreUnavailable as e:
            self._store_failed(e)
            return
        self._store_ok()
        if raw is not None:
            self._apply(raw)

    def _apply(self, raw: bytes) -> None:
        order = view_order(raw)
        if order is None or order <= self._applied:
            return
        try:
            view = decode_view(raw, self._view_clock, clock.monotonic())
        except ValueError as e:
            log.warning("ignoring an unreadable fleet view: %s", e)
            return
        self._applied = order
        self._seen_epoch = max(self._seen_epoch, view.epoch)
        self._seq = max(self._seq, view.seq)
        self._view = view
        if not self._leading:
            self.hooks.apply_view(view)
        self._assess()


def _log_crash(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("cluster task failed", exc_info=task.exception())
