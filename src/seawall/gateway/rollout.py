"""Surge-first rolling restarts, and draining one replica, without dropping streams.

A rollout restarts every replica on purpose; done carelessly it drops every stream in
flight on each one. Done surge-first it drops none:

1. start the new replica next to the old one (up to `max_surge` at a time), so ready
   capacity never falls below what it was;
2. wait for it to load (its `/health`), then warm it with a few real requests: a new
   version that cannot serve stops the rollout here, with the old replicas untouched;
3. put it into routing and wait until the fleet monitor finds it routable;
4. drain the old one: no new requests at once, in-flight streams finish (up to a
   deadline, counting any it had to cut), then SIGTERM, then SIGKILL after a grace.

Works with an actuator that can start replicas (`LocalSupervisor.start_new`, i.e. under
`seawall up`). On Kubernetes the Deployment's own rolling update does this
(`maxSurge: 1, maxUnavailable: 0`, see deploy/kubernetes), with the gateway draining on
readiness.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp

from seawall import clock
from seawall.actuate.base import DrainReport, ReplicaRef
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.metrics import Metrics

if TYPE_CHECKING:
    from seawall.actuate.local import LocalSupervisor

log = logging.getLogger("seawall.rollout")


class FleetOps(Protocol):
    """What a rollout (and the admin API) needs of the gateway: its replica set and
    metrics, and the two operations that change the fleet."""

    replicas: ReplicaSet
    metrics: Metrics

    @property
    def session(self) -> aiohttp.ClientSession: ...

    def add_replica(
        self,
        replica_id: str,
        url: str,
        model: str | None,
        node: str | None = ...,
        api_key: str | None = ...,
        engine: str = ...,
        model_name: str | None = ...,
        pool: str = ...,
    ) -> Replica: ...

    async def drain_replica(
        self, replica_id: str, timeout_s: float, stop_grace_s: float | None = None
    ) -> DrainReport: ...


@dataclass(frozen=True, slots=True)
class RolloutOptions:
    max_surge: int = 1
    warmup_requests: int = 3
    load_timeout_s: float = 600.0  # a new replica may take this long to load
    ready_timeout_s: float = 30.0  # ...and then this long to be found routable
    drain_timeout_s: float = 30.0  # old replica's in-flight streams get this long
    stop_grace_s: float = 10.0  # SIGTERM -> SIGKILL
    command: tuple[str, ...] | None = None  # the new version's command template

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> RolloutOptions:
        known = {k: body[k] for k in cls.__dataclass_fields__ if k in body}
        unknown = sorted(set(body) - set(known))
        if unknown:
            raise ValueError(
                f"unknown rollout option(s) {unknown}; known: {sorted(cls.__dataclass_fields__)}"
            )
        if "command" in known and known["command"] is not None:
            known["command"] = tuple(str(a) for a in known["command"])
        opts = cls(**known)
        if opts.max_surge < 1 or opts.warmup_requests < 0:
            raise ValueError("max_surge must be >= 1 and warmup_requests >= 0")
        return opts


@dataclass(slots=True)
class RolloutReport:
    state: str = "running"  # running | done | failed
    replaced: list[tuple[str, str]] = field(default_factory=list)  # (old, new)
    failure: str = ""
    streams_cut_by_drains: int = 0
    requests_failed: int = 0  # 5xx and 429 answered by the gateway during the rollout
    streams_dropped: int = 0  # streams that started and ended with an error event
    ttft_mean_before_s: float | None = None
    ttft_mean_during_s: float | None = None
    ready_before: int = 0
    ready_min_during: int = 0
    duration_s: float = 0.0
    steps: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Rollout:
    def __init__(self, gw: FleetOps, supervisor: LocalSupervisor, opts: RolloutOptions) -> None:
        self.gw = gw
        self.sup = supervisor
        self.opts = opts
        self.report = RolloutReport()

    def _step(self, text: str) -> None:
        log.info("rollout: %s", text)
        self.report.steps.append(text)

    def _ready_count(self) -> int:
        snap = self.gw.replicas.snapshot()
        now = clock.monotonic()
        return sum(1 for r in self.gw.replicas.all() if self.gw.replicas.usable(r, now, snap))

    async def run(self) -> RolloutReport:
        rep = self.report
        started = clock.monotonic()
        before = _failure_counts(self.gw)
        ttft_count0, ttft_sum0 = _ttft_totals(self.gw)
        rep.ttft_mean_before_s = ttft_sum0 / ttft_count0 if ttft_count0 else None
        rep.ready_before = rep.ready_min_during = self._ready_count()
        watcher = asyncio.create_task(self._watch_ready())
        try:
            snap = self.gw.replicas.snapshot()
            # Replicas an operator holds out of routing are not the rollout's to replace.
            olds = [
                r
                for r in self.gw.replicas.all()
                if r.id not in snap.replicas or not snap.replicas[r.id].held
            ]
            for i in range(0, len(olds), self.opts.max_surge):
                await self._replace(olds[i : i + self.opts.max_surge])
            rep.state = "done"
        except RolloutFailed as e:
            rep.state, rep.failure = "failed", str(e)
            self._step(f"stopped: {e}; the old replicas keep serving")
        finally:
            watcher.cancel()
            after = _failure_counts(self.gw)
            rep.requests_failed = after[0] - before[0]
            rep.streams_dropped = after[1] - before[1]
            count, total = _ttft_totals(self.gw)
            if count > ttft_count0:
                rep.ttft_mean_during_s = (total - ttft_sum0) / (count - ttft_count0)
            rep.duration_s = clock.monotonic() - started
        return rep

    async def _watch_ready(self) -> None:
        while True:
            self.report.ready_min_during = min(self.report.ready_min_during, self._ready_count())
            await asyncio.sleep(0.05)

    async def _replace(self, batch: Sequence[Any]) -> None:
        news: list[ReplicaRef] = []
        try:
            for old in batch:
                ref = await self.sup.start_new(old.model or "", command=self.opts.command)
                news.append(ref)
                self._step(f"started {ref.replica_id} at {ref.url} to replace {old.id}")
            for ref in news:
                await self._wait_loaded(ref)
                await self._warm(ref)
        except (RolloutFailed, OSError, RuntimeError, ValueError) as e:
            for ref in news:
                await self.sup.remove(ref, self.opts.stop_grace_s)
            raise RolloutFailed(str(e)) from None
        for old, ref in zip(batch, news, strict=True):
            # The new replica keeps the public name (alias) of the one it replaces.
            self.gw.add_replica(
                ref.replica_id,
                ref.url,
                ref.model or None,
                ref.node,
                model_name=old.model_name,
                pool=old.pool,
            )
        await self._wait_routable([ref.replica_id for ref in news])
        for old, new in zip(batch, news, strict=True):
            report = await self.gw.drain_replica(
                old.id, self.opts.drain_timeout_s, self.opts.stop_grace_s
            )
            self.report.streams_cut_by_drains += report.streams_cut
            self.report.replaced.append((old.id, new.replica_id))
            self._step(f"drained and stopped {old.id} ({report.streams_cut} stream(s) cut)")

    async def _wait_loaded(self, ref: ReplicaRef) -> None:
        if not await self.sup.wait_running(self.opts.load_timeout_s, [ref.replica_id]):
            raise RolloutFailed(f"{ref.replica_id} did not load within {self.opts.load_timeout_s}s")

    async def _warm(self, ref: ReplicaRef) -> None:
        """A few real requests straight to the new replica: it must produce text."""
        body = {
            "model": ref.model,
            "prompt": "Warm-up: say something.",
            "max_tokens": 8,
            "temperature": 0,
        }
        timeout = aiohttp.ClientTimeout(total=30)
        for n in range(self.opts.warmup_requests):
            try:
                async with self.gw.session.post(
                    ref.url + "/v1/completions", json=body, timeout=timeout
                ) as resp:
                    data = await resp.json(content_type=None)
                    ok = resp.status == 200 and bool(data["choices"][0]["text"])
            except (
                aiohttp.ClientError,
                TimeoutError,
                KeyError,
                IndexError,
                TypeError,
                ValueError,
            ) as e:
                raise RolloutFailed(
                    f"{ref.replica_id} failed warm-up request {n + 1}: {type(e).__name__}"
                ) from None
            if not ok:
                raise RolloutFailed(
                    f"{ref.replica_id} failed warm-up request {n + 1} (HTTP {resp.status})"
                )
        self._step(f"{ref.replica_id} warmed with {self.opts.warmup_requests} request(s)")

    async def _wait_routable(self, ids: list[str]) -> None:
        deadline = clock.monotonic() + self.opts.ready_timeout_s
        while True:
            snap = self.gw.replicas.snapshot()
            if all(snap.replicas.get(i) is not None and snap.replicas[i].routable for i in ids):
                return
            if clock.monotonic() >= deadline:
                raise RolloutFailed(f"{ids} not routable within {self.opts.ready_timeout_s}s")
            await asyncio.sleep(0.05)


class RolloutFailed(Exception):
    pass


def _failure_counts(gw: FleetOps) -> tuple[int, int]:
    failed = 0
    for metric in gw.metrics.requests.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and (
                s.labels["status"].startswith("5") or s.labels["status"] == "429"
            ):
                failed += int(s.value)
    dropped = 0
    for metric in gw.metrics.stream_errors.collect():
        for s in metric.samples:
            if s.name.endswith("_total"):
                dropped += int(s.value)
    return failed, dropped


def _ttft_totals(gw: FleetOps) -> tuple[float, float]:
    count = total = 0.0
    for metric in gw.metrics.ttft.collect():
        for s in metric.samples:
            if s.name.endswith("_count"):
                count += s.value
            elif s.name.endswith("_sum"):
                total += s.value
    return count, total
