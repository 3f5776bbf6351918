"""The local actuator: engine processes Seawall starts and supervises itself.

Owns: starting N replicas from a command template on free loopback ports (one log file
each), watching their processes, restarting the ones that die with exponential backoff
on crash loops, deliberate restarts and stops, cordons (of this machine's node, or of
one replica that is its own failure domain), and leaving no process behind on
`close()`. It reports process facts as events: `starting` (a process was spawned),
`exited`, `backoff`, `stopped`.

Must not: judge readiness or health. Whether a replica serves, whether it is still
loading or has used up its startup allowance, and whether a running one is unhealthy
are the fleet monitor's calls (its startup allowance is the one rule): the monitor
calls `restart`, and `mark_serving` once it finds the replica serving, which is when the
supervisor shows it `running` (and `wait_running` returns). Must not route traffic (the
gateway does) or read the clock outside `seawall.clock`. The backoff arithmetic is the
pure `plan_restart`.

Each replica runs in its own session (process group), so an engine that forks workers
(vLLM's engine core, tensor-parallel ranks) is stopped as a whole: SIGTERM to the group,
then SIGKILL to the group after the grace period, and SIGKILL to the group again after
the leader exits so no orphaned worker holds a GPU or a port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import signal
import socket
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from seawall import clock
from seawall.actuate.base import Actuator, Evidence, ReplicaRef
from seawall.policy.ledger import failure_domain

log = logging.getLogger(__name__)

ReplicaState = Literal["starting", "running", "backoff", "stopped"]
EventKind = Literal[
    "starting",  # a process was spawned; not yet known to serve
    "running",  # the fleet monitor found it serving (`mark_serving`)
    "exited",  # the process died without being asked to
    "backoff",  # waiting before the next start of a crash-looping replica
    "stopped",  # stopped on purpose (or held down by a cordon): not coming back by itself
    "restart_refused",  # a restart was asked for while a crash backoff is running
]

DEFAULT_COMMAND: tuple[str, ...] = (
    sys.executable,
    "-m",
    "seawall",
    "sim",
    "--host",
    "127.0.0.1",
    "--port",
    "{port}",
    "--model",
    "{model}",
)
TEMPLATE_FIELDS = ("port", "model", "replica", "index")


class CordonedError(RuntimeError):
    """Raised when asked to (re)start a replica on a cordoned node."""


# --------------------------------------------------------------------------- pure parts


@dataclass(frozen=True, slots=True)
class BackoffPolicy:
    """Crash-loop backoff: `initial_s`, doubling per consecutive crash, capped at `max_s`.

    A replica that stayed up for `reset_after_s` before dying is not in a crash loop: its
    streak starts again, so a replica that crashes once a day restarts after `initial_s`.
    """

    initial_s: float = 1.0
    max_s: float = 60.0
    reset_after_s: float = 120.0


@dataclass(frozen=True, slots=True)
class RestartPlan:
    delay_s: float
    crash_streak: int  # consecutive crashes including this one


def plan_restart(policy: BackoffPolicy, crash_streak: int, up_for_s: float) -> RestartPlan:
    """How long to wait before starting a replica again after it died.

    `crash_streak` counts the crashes before this one; `up_for_s` is how long the process
    that just died had been up.
    """
    streak = 0 if up_for_s >= policy.reset_after_s else crash_streak
    streak += 1
    # min() before the power keeps the exponent small for a replica crashing for days.
    delay_s = policy.initial_s * 2.0 ** min(streak - 1, 62)
    return RestartPlan(delay_s=min(delay_s, policy.max_s), crash_streak=streak)


def render_command(
    template: Sequence[str], *, port: int, model: str, replica: str, index: int
) -> list[str]:
    """The argv for one replica: each element formatted with the template fields."""
    values = {"port": port, "model": model, "replica": replica, "index": index}
    argv: list[str] = []
    for part in template:
        try:
            argv.append(part.format_map(values))
        except KeyError as e:
            allowed = ", ".join("{" + f + "}" for f in TEMPLATE_FIELDS)
            raise ValueError(
                f"command template {part!r}: unknown placeholder {{{e.args[0]}}}; "
                f"allowed: {allowed} (write {{{{ and }}}} for literal braces)"
            ) from None
    return argv


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
RESERVED_FROM = 20000  # replica ports are chosen from here up to the ephemeral range


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out for `bind(0)` and outgoing connections."""
    try:
        low, high = (int(n) for n in EPHEMERAL_RANGE.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default
    return low, high


def free_loopback_port(host: str = "127.0.0.1", rng: random.Random | None = None) -> int:
    """A port free on `host` now, below the kernel's ephemeral range, so that nothing
    bound to port 0 (the admin API, a client's connection) takes it before the replica
    binds it, or while the replica is down between restarts. Seen in CI: the admin API,
    bound to port 0, got the port chosen for a replica a moment before the replica came
    up, which then failed to bind three times and was cordoned. Falls back to any free
    port when the range below the ephemeral one is too small to choose from."""
    low, _ = ephemeral_range()
    draw = rng or random
    if low - RESERVED_FROM >= 1000:
        for _ in range(64):
            port = draw.randrange(RESERVED_FROM, low)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        any_port: int = s.getsockname()[1]
        return any_port


# --------------------------------------------------------------------------- public data


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    replica_id: str
    url: str
    port: int
    model: str
    node: str | None  # None: the replica is its own failure domain
    pid: int | None
    state: ReplicaState
    restarts: int
    uptime_s: float  # since the current process started; 0 when there is none
    last_exit_code: int | None = None
    reason: str = ""  # why the replica is in this state (last exit, backoff, cordon)
    backoff_remaining_s: float = 0.0
    crash_streak: int = 0  # consecutive crashes; sets the backoff
    log_path: str = ""

    @property
    def ref(self) -> ReplicaRef:
        return ReplicaRef(
            replica_id=self.replica_id, url=self.url, node=self.node, model=self.model
        )


@dataclass(frozen=True, slots=True)
class ReplicaEvent:
    """A change in one replica's process. For routing: add the replica on `running`;
    take it out on `exited`, `backoff` and `stopped` (its URL stays the same across
    restarts, so a restarted replica comes back with the same id and URL)."""

    kind: EventKind
    status: ReplicaStatus
    reason: str = ""
    exit_code: int | None = None  # `exited`: the process's exit status (None: never ran)


# --------------------------------------------------------------------------- the supervisor


@dataclass
class _Replica:
    replica_id: str
    index: int
    model: str
    node: str | None
    port: int
    url: str
    argv: list[str]
    log_path: Path
    state: ReplicaState = "starting"
    proc: asyncio.subprocess.Process | None = None
    started_at: float = 0.0
    restarts: int = 0
    crash_streak: int = 0
    last_exit_code: int | None = None
    reason: str = ""
    backoff_until: float = 0.0
    want_stop: bool = False
    restart_requested: str = ""  # the reason, when a deliberate restart is pending
    held_by_cordon: bool = False
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    pids: list[int] = field(default_factory=list)

    @property
    def domain(self) -> str:
        return failure_domain(self.node, self.replica_id)


class LocalSupervisor:
    """`local`: replicas as child processes of this Seawall process.

    Usage: `await sup.start(model, count)`, then `sup.replicas()` for the view and
    `on_change` for routing. Always `await sup.close()` (or use `async with`).
    """

    name = "local"

    def __init__(
        self,
        *,
        log_dir: Path,
        command: Sequence[str] | None = None,
        node: str | None = None,
        env: Mapping[str, str] | None = None,
        backoff: BackoffPolicy | None = None,
        on_change: Callable[[ReplicaEvent], None] | None = None,
        host: str = "127.0.0.1",
        stop_grace_s: float = 10.0,
    ) -> None:
        self.log_dir = Path(log_dir)
        self.command: tuple[str, ...] = tuple(command) if command else DEFAULT_COMMAND
        render_command(self.command, port=0, model="m", replica="r", index=0)  # fail early
        self.node = node  # None: each replica is its own failure domain
        self.env = dict(env or {})
        self.backoff = backoff or BackoffPolicy()
        self.host = host
        self.stop_grace_s = stop_grace_s
        self._listeners: list[Callable[[ReplicaEvent], None]] = []
        if on_change is not None:
            self._listeners.append(on_change)
        self._replicas: dict[str, _Replica] = {}
        self._next_index = 0
        self._cordoned: dict[str, Evidence] = {}  # failure domain -> why
        self._closed = False

    async def __aenter__(self) -> LocalSupervisor:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- events

    def subscribe(self, listener: Callable[[ReplicaEvent], None]) -> None:
        """Add an `on_change` listener (the gateway's routing table, the `up` view)."""
        self._listeners.append(listener)

    def _emit(self, rep: _Replica, kind: EventKind, reason: str = "") -> None:
        event = ReplicaEvent(
            kind=kind,
            status=self._status(rep, clock.monotonic()),
            reason=reason,
            exit_code=rep.last_exit_code if kind == "exited" else None,
        )
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a broken listener must not stop supervision
                log.exception("on_change listener failed for %s %s", rep.replica_id, kind)

    # ---- queries

    def replicas(self) -> list[ReplicaStatus]:
        now = clock.monotonic()
        return [self._status(r, now) for r in self._replicas.values()]

    def refs(self) -> list[ReplicaRef]:
        return [s.ref for s in self.replicas()]

    def all_pids(self) -> list[int]:
        """Every pid this supervisor ever started (for checks that nothing is left behind)."""
        return [pid for r in self._replicas.values() for pid in r.pids]

    def is_cordoned(self, domain: str) -> bool:
        return domain in self._cordoned

    def mark_serving(self, replica_id: str) -> None:
        """The fleet monitor found the replica serving since its process started: it is
        shown `running` (and `wait_running` returns) until the process goes."""
        rep = self._replicas.get(replica_id)
        if rep is None or rep.state != "starting":
            return
        if rep.proc is None or rep.proc.returncode is not None:
            return  # the verdict is about a process that is gone
        rep.state = "running"
        rep.reason = ""
        self._emit(rep, "running")

    def _status(self, rep: _Replica, now: float) -> ReplicaStatus:
        live = rep.proc is not None and rep.proc.returncode is None
        return ReplicaStatus(
            replica_id=rep.replica_id,
            url=rep.url,
            port=rep.port,
            model=rep.model,
            node=rep.node,
            pid=rep.proc.pid if live and rep.proc is not None else None,
            state=rep.state,
            restarts=rep.restarts,
            uptime_s=max(0.0, now - rep.started_at) if live else 0.0,
            last_exit_code=rep.last_exit_code,
            reason=rep.reason,
            backoff_remaining_s=max(0.0, rep.backoff_until - now)
            if rep.state == "backoff"
            else 0.0,
            crash_streak=rep.crash_streak,
            log_path=str(rep.log_path),
        )

    async def wait_running(self, timeout_s: float, replica_ids: Sequence[str] = ()) -> bool:
        """Wait until every named replica (default: every replica not stopped) is running:
        spawned, and found serving by the fleet monitor (`mark_serving`)."""
        deadline = clock.monotonic() + timeout_s
        while True:
            wanted = [
                r
                for r in self._replicas.values()
                if (r.replica_id in replica_ids) or (not replica_ids and not r.want_stop)
            ]
            if wanted and all(r.state == "running" for r in wanted):
                return True
            if clock.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)

    # ---- starting

    async def start(self, model: str, count: int) -> list[ReplicaRef]:
        """Start `count` replicas of `model`; returns at once (they are `starting`)."""
        return [await self.start_new(model) for _ in range(count)]

    async def start_new(
        self,
        model: str,
        *,
        command: Sequence[str] | None = None,
        replica_id: str | None = None,
        port: int | None = None,
    ) -> ReplicaRef:
        """Start one more replica on a new port (surge-first rollouts start the new
        version next to the old one, then stop the old one once the new one runs).
        `command` overrides the supervisor's template for this replica only."""
        if self._closed:
            raise RuntimeError("supervisor is closed")
        if self.node is not None and self.is_cordoned(self.node):
            raise CordonedError(f"node {self.node} is cordoned: not starting a replica")
        index = self._next_index
        self._next_index += 1
        rid = replica_id or f"r{index}"
        if rid in self._replicas:
            raise ValueError(f"replica id {rid!r} already exists")
        port = port or free_loopback_port(self.host)
        argv = render_command(
            command or self.command, port=port, model=model, replica=rid, index=index
        )
        self.log_dir.mkdir(parents=True, exist_ok=True)
        rep = _Replica(
            replica_id=rid,
            index=index,
            model=model,
            node=self.node,
            port=port,
            url=f"http://{self.host}:{port}",
            argv=argv,
            log_path=self.log_dir / f"{rid}.log",
        )
        self._replicas[rid] = rep
        rep.task = asyncio.create_task(self._supervise(rep), name=f"supervise-{rid}")
        return ReplicaRef(replica_id=rid, url=rep.url, node=rep.node, model=model)

    # ---- the per-replica loop

    async def _spawn(self, rep: _Replica) -> None:
        now_wall = clock.wall()
        with rep.log_path.open("ab") as fh:
            fh.write(
                f"\n=== seawall: starting {rep.replica_id} (restarts={rep.restarts}, "
                f"unix={now_wall:.0f}): {' '.join(rep.argv)}\n".encode()
            )
            fh.flush()
            env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
            rep.proc = await asyncio.create_subprocess_exec(
                *rep.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=fh,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        rep.pids.append(rep.proc.pid)
        rep.started_at = clock.monotonic()
        rep.state = "starting"
        self._emit(rep, "starting", rep.reason)

    async def _supervise(self, rep: _Replica) -> None:
        try:
            while not _stopping(rep):
                if self.is_cordoned(rep.domain):
                    rep.held_by_cordon = True
                    rep.reason = f"node {rep.domain} cordoned"
                    break
                try:
                    await self._spawn(rep)
                except OSError as e:  # the binary is missing: treat as a crash, keep trying
                    rep.proc = None
                    rep.started_at = clock.monotonic()
                    rep.reason = f"could not start: {e}"
                    exit_code: int | None = None
                else:
                    exit_code = await self._watch(rep)
                if _stopping(rep):  # stop() or close() ran while we awaited
                    break
                if rep.restart_requested:
                    rep.reason = f"restarted: {rep.restart_requested}"
                    rep.restart_requested = ""
                    rep.restarts += 1
                    rep.crash_streak = 0
                    continue
                now = clock.monotonic()
                if exit_code is not None:
                    rep.last_exit_code = exit_code
                    rep.reason = f"exited with code {exit_code}"
                    self._emit(rep, "exited", rep.reason)
                if self.is_cordoned(rep.domain):
                    continue  # the loop's first check holds it down without a backoff wait
                plan = plan_restart(self.backoff, rep.crash_streak, now - rep.started_at)
                rep.crash_streak = plan.crash_streak
                rep.state = "backoff"
                rep.backoff_until = now + plan.delay_s
                rep.reason = (
                    f"{rep.reason}; crash {plan.crash_streak}, next start in {plan.delay_s:.0f}s"
                )
                self._emit(rep, "backoff", rep.reason)
                rep.wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(rep.wake.wait(), plan.delay_s)
                if _stopping(rep):  # stop() or close() ran while we awaited
                    break
                if asked := _pending_restart(rep):  # restart() cut the backoff short
                    rep.reason = f"restarted: {asked}"
                    rep.restart_requested = ""
                else:
                    rep.reason = f"restart after crash {rep.crash_streak}"
                rep.restarts += 1
        finally:
            await self._kill_now(rep)
            rep.state = "stopped"
            self._emit(rep, "stopped", rep.reason)

    async def _watch(self, rep: _Replica) -> int:
        """Until the process exits; returns the exit code."""
        proc = rep.proc
        assert proc is not None
        code = await proc.wait()
        # The leader is gone; its workers must not outlive it (nor hold the port the
        # next start needs).
        _killpg(proc.pid, signal.SIGKILL)
        await _group_gone(proc.pid)
        return code

    async def _terminate(self, rep: _Replica, grace_s: float) -> None:
        """SIGTERM the replica's process group; SIGKILL it after `grace_s`."""
        proc = rep.proc
        if proc is None or proc.returncode is not None:
            return
        _killpg(proc.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(proc.wait()), grace_s)
        except TimeoutError:
            log.warning("%s did not exit %gs after SIGTERM: killing", rep.replica_id, grace_s)
            _killpg(proc.pid, signal.SIGKILL)

    async def _kill_now(self, rep: _Replica) -> None:
        proc = rep.proc
        if proc is None:
            return
        _killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
        await _group_gone(proc.pid)

    # ---- Actuator

    def _get(self, replica: ReplicaRef) -> _Replica:
        rep = self._replicas.get(replica.replica_id)
        if rep is None:
            raise KeyError(f"no local replica {replica.replica_id!r}")
        return rep

    async def restart(self, replica: ReplicaRef, reason: str, *, force: bool = False) -> bool:
        """Stop the replica's process and start it again at once (no backoff). Returns
        True: a restart happened or is under way (raises `CordonedError` instead when
        the replica's domain is cordoned).

        Whether to restart a loading replica is the fleet monitor's call (its startup
        allowance). A replica that crashed and is waiting out its backoff is not started
        early (unless `force`; a `restart_refused` event says so): the supervisor is
        already restarting it, and skipping the wait would turn a crash loop into a
        tight loop (the fleet monitor asks for a restart whenever it sees a replica
        die). A process that has just died on its own is left to the crash path for
        the same reason. A stopped replica is started again.
        """
        rep = self._get(replica)
        asked = reason or "requested"
        if self.is_cordoned(rep.domain):
            raise CordonedError(f"node {rep.domain} is cordoned: not restarting {rep.replica_id}")
        if rep.task is None or rep.task.done():  # stopped: start it again
            rep.want_stop = False
            rep.held_by_cordon = False
            rep.restarts += 1
            rep.reason = f"restarted: {asked}"
            rep.task = asyncio.create_task(self._supervise(rep), name=f"supervise-{rep.replica_id}")
            return True
        if rep.state == "backoff":
            if not force:
                self._emit(rep, "restart_refused", f"already restarting (asked: {asked})")
                return True
            rep.restart_requested = asked
            rep.wake.set()
            return True
        proc = rep.proc
        if proc is None or proc.returncode is not None:
            return True  # it died on its own just now: the crash path restarts it
        rep.restart_requested = asked
        await self._terminate(rep, self.stop_grace_s)
        return True

    async def stop(self, replica: ReplicaRef, grace_s: float) -> None:
        """SIGTERM, SIGKILL after `grace_s`; the replica stays listed as `stopped`."""
        rep = self._get(replica)
        rep.want_stop = True
        rep.reason = "stopped on request"
        rep.wake.set()
        await self._terminate(rep, grace_s)
        if rep.task is not None:
            await rep.task

    async def remove(self, replica: ReplicaRef, grace_s: float) -> None:
        """Stop the replica and forget it (a rollout's old version)."""
        await self.stop(replica, grace_s)
        self._replicas.pop(replica.replica_id, None)

    async def cordon(self, node: str, evidence: Evidence) -> None:
        """Mark failure domain `node` (this machine's node, or `replica:<id>`) not
        schedulable: replicas in it that die stay down."""
        self._cordoned[node] = evidence

    async def uncordon(self, node: str) -> None:
        """Schedulable again: replicas held down by the cordon start again."""
        self._cordoned.pop(node, None)
        for rep in self._replicas.values():
            if rep.domain == node and rep.held_by_cordon and (rep.task is None or rep.task.done()):
                rep.held_by_cordon = False
                rep.want_stop = False
                rep.reason = "node uncordoned"
                rep.restarts += 1
                rep.task = asyncio.create_task(
                    self._supervise(rep), name=f"supervise-{rep.replica_id}"
                )

    async def close(self, grace_s: float | None = None) -> None:
        """Stop every replica (SIGTERM, then SIGKILL after the grace); idempotent."""
        grace = self.stop_grace_s if grace_s is None else grace_s
        for rep in self._replicas.values():
            rep.want_stop = True
            rep.wake.set()
        await asyncio.gather(
            *(self._terminate(rep, grace) for rep in self._replicas.values()),
            return_exceptions=True,
        )
        tasks = [r.task for r in self._replicas.values() if r.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._closed = True


if TYPE_CHECKING:  # mypy proves the supervisor is an Actuator the monitor can take

    def _is_an_actuator(supervisor: LocalSupervisor) -> Actuator:
        return supervisor


def _die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM if Seawall itself dies (even by
    SIGKILL), so a crashed supervisor does not leave engines holding GPUs and ports.
    Best effort: elsewhere, and for the engine's own workers, `close()` is the guarantee."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _stopping(rep: _Replica) -> bool:
    # A function, not the attribute, because other tasks flip it while this one awaits.
    return rep.want_stop


def _pending_restart(rep: _Replica) -> str:
    return rep.restart_requested


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_has_live_members(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    proc = Path("/proc")
    if not proc.is_dir():
        return True
    # killpg(0) also succeeds for zombies, which a container's init may never reap;
    # a zombie holds no port or GPU, so only members in another state count.
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


async def _group_gone(pgid: int, timeout_s: float = 5.0) -> None:
    """Wait (bounded) until SIGKILL has taken effect on every member of the group:
    kill() returns before the target is gone, and callers promise nothing is left."""
    deadline = clock.monotonic() + timeout_s
    while _group_has_live_members(pgid):
        if clock.monotonic() >= deadline:
            log.error("process group %d still has members %gs after SIGKILL", pgid, timeout_s)
            return
        _killpg(pgid, signal.SIGKILL)
        await asyncio.sleep(0.01)


__all__ = [
    "DEFAULT_COMMAND",
    "BackoffPolicy",
    "CordonedError",
    "LocalSupervisor",
    "ReplicaEvent",
    "ReplicaStatus",
    "RestartPlan",
    "plan_restart",
    "render_command",
]
