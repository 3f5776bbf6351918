"""`seawall serve --workers N`: N gateway processes on one port, one fleet.

Why. One Python process serves from one core. Workers are the way past that on one host,
and they must stay one gateway to the fleet: one set of deep probes and scrapes per
replica, one restart ledger, one actor. So each worker is an ordinary cluster instance
(`seawall.cluster`), exactly as instances on several hosts are: one is elected leader,
the others follow its published view. Nothing to set up: the parent brings what they
share.

The parent (`supervise`) serves no request itself. In order:

1. The store. With `cluster.store: none` it hosts a `StoreServer` (`cluster/local.py`) on
   a Unix socket in a private directory (mode 0700) and the workers run `store: local`
   over it. With `local` it hosts one at `cluster.local_socket`, unless a server already
   answers there (then its workers join that fleet). With `redis` it hosts nothing: the
   workers share the Redis like any instances, with the instances on other hosts.
2. The port. It binds `listen.host:listen.port` with SO_REUSEPORT and never listens on
   it: `port: 0` becomes one port that every worker binds, still held while a worker
   restarts. The kernel spreads new connections over the workers' listeners.
3. One admin API, on `admin.host:admin.port`: each request is relayed to the worker that
   holds the fleet's lease or, when the leader is elsewhere (another host, or nobody
   yet), to a live worker, whose admin API forwards the levers to the leader or answers
   503 `no_fleet_leader` (`gateway/admin.py`). Workers' own admin APIs listen on private
   loopback ports and advertise the parent's address, so other instances' forwards land
   here too. Not an admin API per worker: operators and the status page would need N
   addresses that change at every restart, and `GET /admin/state` would show another
   instance at each refresh. Not only the leader's on the port: the port would close at
   every change of leader, and followers could not forward to a stable address.
4. The workers: `seawall serve` with the same flags, each told through `SEAWALL_WORKER`
   (JSON, `WorkerSpec`) its index, its instance id (`<base>-w<i>`, and a new one at
   every start, so a worker that dies leaves the fleet as any crashed instance does; if
   it led, its lease expires within the fail-over bound), the store's socket, the port
   and the parent's admin URL. A worker says it listens in one JSON line on stdout.
5. Supervision. A worker that exits is started again after a backoff (0.5 s, doubling
   per consecutive crash, at most 10 s: `actuate.local.plan_restart`). SIGTERM or
   SIGINT: every worker gets SIGTERM and runs the gateway's own drain sequence (readiness
   fails, new requests 503 + Retry-After, in flight gets `drain.timeout_s`, then cut);
   the parent waits for them (SIGKILL after `drain.timeout_s` + `EXIT_MARGIN_S`), closes
   the admin API, then the store, and exits 0. SIGHUP is passed on: each worker reloads
   `--config`. Workers get SIGTERM if the parent dies (PR_SET_PDEATHSIG) and stay in its
   process group, so a supervisor's kill of the group reaches them.

Known: `/metrics` on the shared port answers from whichever worker took the connection
(each counts what it served); scrape with several samples, or each worker by its PID's
port, until an aggregated endpoint exists.

Must not: serve client requests, hold fleet state (what it hosts is a `MemoryStore` in a
`StoreServer`), or decide anything about replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from seawall import clock
from seawall.actuate.local import BackoffPolicy, plan_restart
from seawall.cluster.local import LocalStoreClient, StoreServer
from seawall.cluster.store import Elector, StoreUnavailable
from seawall.config import ClusterConfig, GatewayConfig
from seawall.errors import ApiError, unavailable

log = logging.getLogger("seawall.workers")

ENV = "SEAWALL_WORKER"
# A worker not listening by then is stopped and started again (imports on a loaded host).
READY_TIMEOUT_S = 60.0
# After the drain deadline a worker still cuts, closes and leaves the fleet.
EXIT_MARGIN_S = 10.0
BACKOFF = BackoffPolicy(initial_s=0.5, max_s=10.0, reset_after_s=30.0)
LEADER_CACHE_S = 0.25  # the relay asks who leads at most this often
RELAY_CONNECT_S = 2.0
RELAY_MARGIN_S = 30.0  # a relayed drain answers after its deadline plus the stop grace
_RELAYED_HEADERS = frozenset(
    {
        "Content-Type",
        "Retry-After",
        "retry-after-ms",
        "x-should-retry",
        "Location",
        "Cache-Control",
        "WWW-Authenticate",
        "X-Seawall-Leader",
    }
)


# ----------------------------------------------------------------------- worker side


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    """What the parent tells one worker (the `SEAWALL_WORKER` variable, JSON)."""

    index: int
    instance: str
    port: int
    store_socket: str | None  # the store the parent hosts; None: the configured one
    admin_url: str | None  # the parent's admin API, advertised as this instance's

    def to_env(self) -> str:
        return orjson.dumps(asdict(self)).decode()

    @classmethod
    def from_env(cls, environ: Any = os.environ) -> WorkerSpec | None:
        raw = environ.get(ENV)
        if not raw:
            return None
        d = orjson.loads(raw)
        return cls(
            index=int(d["index"]),
            instance=str(d["instance"]),
            port=int(d["port"]),
            store_socket=d.get("store_socket"),
            admin_url=d.get("admin_url"),
        )

    def apply(self, config: GatewayConfig) -> GatewayConfig:
        """The configuration as this worker runs it: the shared port, its own instance id,
        the parent's store (if it hosts one), its admin API on a private loopback port
        advertising the parent's."""
        cc = config.cluster
        cluster: dict[str, Any] = {"instance_id": self.instance}
        if self.store_socket is not None:
            cluster.update(store="local", local_socket=self.store_socket)
        if self.admin_url is not None and cc.advertise_admin_url is None:
            cluster["advertise_admin_url"] = self.admin_url
        return config.model_copy(
            update={
                "listen": config.listen.model_copy(update={"port": self.port}),
                "admin": config.admin.model_copy(update={"host": "127.0.0.1", "port": 0}),
                "cluster": cc.model_copy(update=cluster),
            }
        )

    def ready_line(self, port: int, admin_port: int | None) -> bytes:
        """What the worker writes on stdout once it listens (one JSON line)."""
        return orjson.dumps(
            {
                "worker": self.index,
                "instance": self.instance,
                "port": port,
                "admin_port": admin_port,
            }
        )


def worker_argv(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """`seawall serve` flags that give a worker the parent's options (all but
    `--workers`), rebuilt from the parser so that a new flag is passed on by itself."""
    out: list[str] = []
    for action in parser._actions:  # argparse keeps no public list of them
        if not action.option_strings or action.dest in ("help", "workers"):
            continue
        value = getattr(args, action.dest, None)
        flag = action.option_strings[-1]
        if isinstance(action, argparse._StoreTrueAction):
            if value:
                out.append(flag)
        elif isinstance(action, argparse._AppendAction):
            for item in value or ():
                out += [flag, str(item)]
        elif value is not None and value != action.default:
            out += [flag, str(value)]
    return out


def _die_with_parent() -> None:
    """In the worker, before exec: SIGTERM (a drain) if the parent dies, even by SIGKILL,
    so no worker is left holding the port. Linux; elsewhere the parent's stop is it."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


# ----------------------------------------------------------------------- parent side


def _hold_port(host: str, port: int) -> socket.socket:
    """Bind (never listen) with SO_REUSEPORT: the port every worker binds, reserved."""
    family, kind, proto, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def instance_base(cc: ClusterConfig) -> str:
    return cc.instance_id or os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}"


def public_admin_url(config: GatewayConfig, port: int) -> str:
    """Where other instances reach this host's admin API (the parent's)."""
    cc, admin = config.cluster, config.admin
    if cc.advertise_admin_url:
        return cc.advertise_admin_url.rstrip("/")
    host = admin.host
    if host in ("0.0.0.0", "::", ""):
        host = os.environ.get("POD_IP") or socket.gethostname()
    return f"http://{host}:{port}"


class _Worker:
    """One worker slot: the process now in it, and what it said when it started."""

    def __init__(self, index: int, base: str) -> None:
        self.index = index
        self.base = base
        self.starts = 0
        self.proc: asyncio.subprocess.Process | None = None
        self.instance = ""
        self.admin_port: int | None = None
        self.ready = asyncio.Event()
        self.started_at = 0.0
        self.crash_streak = 0

    def next_instance(self) -> str:
        self.starts += 1
        suffix = f"-w{self.index}" + (f"-{self.starts}" if self.starts > 1 else "")
        return self.base + suffix

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    @property
    def admin_url(self) -> str | None:
        if not (self.alive and self.ready.is_set() and self.admin_port):
            return None
        return f"http://127.0.0.1:{self.admin_port}"


class _LeaderLookup:
    """Who holds the fleet's lease, for the admin relay (cached `LEADER_CACHE_S`)."""

    def __init__(self, server: StoreServer | None, cc: ClusterConfig) -> None:
        self.server = server
        self.cc = cc
        self._elector: Elector | None = None
        self._cached: tuple[float, str | None] = (-1e9, None)

    async def _open(self) -> Elector:
        cc = self.cc
        if cc.election == "kubernetes":
            from seawall.cluster.kube import KubernetesLeaseElector, kube_api_client

            return KubernetesLeaseElector(
                await kube_api_client(), cc.lease_name, cc.lease_namespace
            )
        if cc.store == "redis":
            from seawall.cluster.redis_store import RedisStore

            return RedisStore(cc.redis_url, cc.key_prefix, socket_timeout_s=cc.store_timeout_s)
        return LocalStoreClient(cc.local_socket, timeout_s=cc.store_timeout_s)

    async def holder(self) -> str | None:
        at, holder = self._cached
        now = clock.monotonic()
        if now - at < LEADER_CACHE_S:
            return holder
        try:
            if self.server is not None and self.cc.election == "store":
                lease = await self.server.store.leader()
            else:
                if self._elector is None:
                    self._elector = await self._open()
                lease = await self._elector.leader()
        except StoreUnavailable:
            lease = None
        holder = lease.holder if lease is not None else None
        self._cached = (now, holder)
        return holder

    async def close(self) -> None:
        if self._elector is not None:
            await self._elector.close()


class AdminRelay:
    """The one admin API of a host's workers: each request goes to the worker that leads,
    else to a live one (see the module docstring)."""

    def __init__(
        self,
        workers: Sequence[_Worker],
        leader: _LeaderLookup,
        read_timeout_s: float,
    ) -> None:
        self.workers = workers
        self.leader = leader
        self.read_timeout_s = read_timeout_s
        self._runner: web.AppRunner | None = None
        self._http: aiohttp.ClientSession | None = None
        self.port: int | None = None

    async def target(self) -> str | None:
        holder = await self.leader.holder()
        live = [w for w in self.workers if w.admin_url is not None]
        leading = next((w for w in live if w.instance == holder), None)
        chosen = leading or (live[0] if live else None)
        return chosen.admin_url if chosen is not None else None

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        url = await self.target()
        if url is None:
            return _error(unavailable("No gateway worker is up to answer yet.", 1.0))
        if self._http is None:
            self._http = aiohttp.ClientSession(auto_decompress=False)
        headers = {
            k: v
            for k, v in request.headers.items()
            if k.lower() in ("authorization", "content-type", "x-seawall-forwarded", "accept")
        }
        timeout = aiohttp.ClientTimeout(
            total=None, connect=RELAY_CONNECT_S, sock_read=self.read_timeout_s
        )
        try:
            async with self._http.request(
                request.method,
                url + request.path_qs,
                data=await request.read(),
                headers=headers,
                timeout=timeout,
            ) as resp:
                body = await resp.read()
                out = {k: v for k, v in resp.headers.items() if k in _RELAYED_HEADERS}
                return web.Response(body=body, status=resp.status, headers=out)
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            return _error(
                unavailable(f"The leading worker did not answer: {type(e).__name__}.", 1.0)
            )

    async def start(self, host: str, port: int) -> int:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server: Any = site._server  # aiohttp keeps the bound sockets here only
        self.port = int(server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._http is not None:
            await self._http.close()


def _error(e: ApiError) -> web.Response:
    return web.Response(body=e.json_bytes(), status=e.status, headers=e.response_headers())


class WorkerPool:
    """Starts, watches and stops the workers (see the module docstring)."""

    def __init__(
        self,
        count: int,
        argv: Sequence[str],
        spec_for: Callable[[_Worker], WorkerSpec],
        base: str,
    ) -> None:
        self.argv = list(argv)
        self.spec_for = spec_for
        self.workers = [_Worker(i, base) for i in range(count)]
        self.stopping = False
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._readers: set[asyncio.Task[None]] = set()

    async def _spawn(self, w: _Worker) -> None:
        w.instance = w.next_instance()
        w.admin_port = None
        w.ready = asyncio.Event()
        spec = self.spec_for(w)
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "seawall",
            "serve",
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            env={**os.environ, ENV: spec.to_env()},
            preexec_fn=_die_with_parent,
        )
        w.started_at = clock.monotonic()
        reader = asyncio.get_running_loop().create_task(self._read(w, w.proc))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)

    async def _read(self, w: _Worker, proc: asyncio.subprocess.Process) -> None:
        """The worker's stdout: its ready line, then anything else passed through."""
        assert proc.stdout is not None
        while line := await proc.stdout.readline():
            try:
                said = orjson.loads(line)
            except orjson.JSONDecodeError:
                said = None
            if isinstance(said, dict) and "port" in said and proc is w.proc:
                w.admin_port = said.get("admin_port")
                w.ready.set()
                admin = f", admin API on http://127.0.0.1:{w.admin_port}" if w.admin_port else ""
                log.info("worker %d (%s, pid %d) listening%s", w.index, w.instance, proc.pid, admin)
            else:
                sys.stdout.buffer.write(line)
                sys.stdout.flush()

    async def start(self) -> None:
        """Start every worker and wait until all listen (raise if one exits first)."""
        for w in self.workers:
            await self._spawn(w)
        for w in self.workers:
            await self._until_ready(w)
        for w in self.workers:
            self._tasks.append(asyncio.get_running_loop().create_task(self._supervise(w)))

    async def _until_ready(self, w: _Worker) -> None:
        assert w.proc is not None
        ready = asyncio.ensure_future(w.ready.wait())
        exited = asyncio.ensure_future(w.proc.wait())
        try:
            await asyncio.wait(
                {ready, exited}, timeout=READY_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ready.cancel()
            exited.cancel()
        if not w.ready.is_set():
            code = w.proc.returncode
            raise RuntimeError(
                f"worker {w.index} exited with code {code} before listening"
                if code is not None
                else f"worker {w.index} did not listen within {READY_TIMEOUT_S:g}s"
            )

    def _stopping(self) -> bool:
        # A method, not the attribute: stop() flips it while the supervise loops await.
        return self.stopping

    async def _supervise(self, w: _Worker) -> None:
        while not self._stopping():
            assert w.proc is not None
            code = await w.proc.wait()
            if self._stopping():  # stop() ran while we awaited
                return
            up_for_s = clock.monotonic() - w.started_at
            plan = plan_restart(BACKOFF, w.crash_streak, up_for_s)
            w.crash_streak = plan.crash_streak
            log.warning(
                "worker %d (%s) exited with code %s after %.1f s; starting it again in %.1f s",
                w.index,
                w.instance,
                code,
                up_for_s,
                plan.delay_s,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), plan.delay_s)
            if self._stopping():  # stop() ran while we awaited
                return
            await self._spawn(w)
            try:
                await self._until_ready(w)
            except RuntimeError as e:
                log.error("%s", e)
                if w.alive:
                    assert w.proc is not None
                    w.proc.kill()

    def signal_all(self, sig: int) -> None:
        for w in self.workers:
            if w.alive:
                assert w.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(sig)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM every worker (each drains); SIGKILL what is left after `timeout_s`."""
        self.stopping = True
        self._wake.set()
        self.signal_all(signal.SIGTERM)
        waits = [w.proc.wait() for w in self.workers if w.proc is not None]
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*waits)
        except TimeoutError:
            log.error("workers still running %.0f s after SIGTERM: killing them", timeout_s)
            self.signal_all(signal.SIGKILL)
            await asyncio.gather(*(w.proc.wait() for w in self.workers if w.proc is not None))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, *self._readers, return_exceptions=True)

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None and w.alive]


async def _store_answers(path: str, timeout_s: float) -> bool:
    client = LocalStoreClient(path, timeout_s=timeout_s)
    try:
        await client.leader()
        return True
    except StoreUnavailable:
        return False
    finally:
        await client.close()


async def supervise(
    config: GatewayConfig,
    workers: int,
    argv: Sequence[str],
    say: Callable[[str], None],
) -> int:
    """Run `workers` gateway workers on one port until SIGTERM or SIGINT (see above)."""
    cc = config.cluster
    private_dir: Path | None = None
    server: StoreServer | None = None
    socket_path: str | None = None
    if cc.store == "none":
        # A short path (Unix socket paths are limited to about 100 bytes), this user's only.
        private_dir = Path(tempfile.mkdtemp(prefix="seawall-workers-"))
        socket_path = str(private_dir / "cluster.sock")
        server = StoreServer(socket_path)
    elif cc.store == "local" and not await _store_answers(cc.local_socket, cc.store_timeout_s):
        socket_path = cc.local_socket
        server = StoreServer(socket_path)
    relay: AdminRelay | None = None
    pool: WorkerPool | None = None
    held: socket.socket | None = None
    lookup = _LeaderLookup(server, cc)
    try:
        if server is not None:
            await server.start()
        held = _hold_port(config.listen.host, config.listen.port)
        port = int(held.getsockname()[1])
        base = instance_base(cc)
        admin_url: str | None = None
        slots: list[_Worker] = []
        if config.admin.enabled:
            read_s = config.drain.timeout_s + RELAY_MARGIN_S
            relay = AdminRelay(slots, lookup, read_s)
            admin_port = await relay.start(config.admin.host, config.admin.port)
            admin_url = public_admin_url(config, admin_port)

        def spec_for(w: _Worker) -> WorkerSpec:
            return WorkerSpec(w.index, w.instance, port, socket_path, admin_url)

        pool = WorkerPool(workers, argv, spec_for, base)
        slots.extend(pool.workers)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, pool.signal_all, signal.SIGHUP)
        starting = asyncio.ensure_future(pool.start())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done() and starting.exception() is None:
            url = f"http://{config.listen.host}:{port}"
            say(f"seawall gateway listening on {url} ({workers} workers)")
            if relay is not None and relay.port is not None:
                say(f"seawall admin API listening on http://{config.admin.host}:{relay.port}")
            store = (
                "the cluster's Redis"
                if cc.store == "redis"
                else f"unix:{socket_path or cc.local_socket}"
            )
            log.info("workers %s share %s", ", ".join(str(p) for p in pool.pids()), store)
            await stop.wait()
            log.info("draining %d worker(s), up to %.0fs", workers, config.drain.timeout_s)
        stopped.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
        failure = starting.exception() if not starting.cancelled() else None
        await pool.stop(config.drain.timeout_s + EXIT_MARGIN_S)
        if failure is not None:
            log.error("seawall serve --workers: %s", failure)
            return 1
        return 0
    finally:
        if relay is not None:
            await relay.close()
        await lookup.close()
        if server is not None:
            await server.close()
        if held is not None:
            held.close()
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)
