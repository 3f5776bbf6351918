"""The local supervisor with real child processes on loopback.

The replicas here are a tiny HTTP server (`FAKE_ENGINE`: /health, and a one-token
answer to any POST) so the supervisor is tested on its own: it reports process facts
(starts, exits, backoff, stops). Whether a replica serves, and when a loading one has
used up its startup allowance, is the fleet monitor's call: the last tests run the two
together, wired as `seawall up` wires them (`MonitorFeed`). `test_local_sim.py` runs the
supervisor with real `seawall sim` replicas.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from seawall.actuate.base import Evidence
from seawall.actuate.local import (
    BackoffPolicy,
    CordonedError,
    LocalSupervisor,
    ReplicaEvent,
)
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.monitor import FleetMonitor
from seawall.up.fleet import MonitorFeed
from tests.support.procs import pid_alive as alive

pytestmark = pytest.mark.integration

# argv: port, seconds to "load" before serving, "ignore-term" to ignore SIGTERM.
FAKE_ENGINE = r"""
import http.server, json, signal, sys, time
port, load_s = int(sys.argv[1]), float(sys.argv[2])
if sys.argv[3:] == ["ignore-term"]:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(load_s)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        # A one-token completion (no braces here: this is a command template).
        body = json.dumps(dict(choices=[dict(index=0, text="x")], usage=dict(completion_tokens=1)))
        body = body.encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body)))
        self.end_headers(); self.wfile.write(body)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def fake(load_s: float = 0.0, *extra: str) -> list[str]:
    return [sys.executable, "-c", FAKE_ENGINE, "{port}", str(load_s), *extra]


async def until(cond: object, timeout_s: float = 20.0) -> None:
    """Poll a condition; bounded so a broken supervisor fails the test, not hangs it."""
    assert callable(cond)
    for _ in range(int(timeout_s / 0.05)):
        if cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met in time")


async def spawned(sup: LocalSupervisor, count: int = 1) -> None:
    """Every replica has a live process (the supervisor judges nothing more)."""
    await until(lambda: len(sup.replicas()) >= count and all(r.pid for r in sup.replicas()))


def judge(sup: LocalSupervisor, artifacts: Path, **overrides: object) -> FleetMonitor:
    """A fleet monitor acting through `sup`, fed its process events as `seawall up` does."""
    config = FleetMonitorConfig.model_validate(
        {
            "actuator": "local",
            "liveness_interval_s": 0.1,
            "liveness_timeout_s": 0.5,
            "ledger_path": str(artifacts / "ledger.sqlite"),
            **overrides,
        }
    )
    monitor = FleetMonitor(config, actuator=sup)
    MonitorFeed(monitor, sup).attach()
    return monitor


async def test_a_killed_replica_is_restarted_on_the_same_url(artifacts: Path) -> None:
    events: list[ReplicaEvent] = []
    async with LocalSupervisor(log_dir=artifacts, command=fake(), on_change=events.append) as sup:
        (ref,) = await sup.start("m", 1)
        await spawned(sup)
        (before,) = sup.replicas()
        assert before.pid is not None and before.state == "starting"
        os.kill(before.pid, signal.SIGKILL)
        await until(lambda: sup.replicas()[0].restarts == 1)
        await until(lambda: sup.replicas()[0].pid not in (None, before.pid))
        (after,) = sup.replicas()
        assert after.url == ref.url
        assert after.last_exit_code == -signal.SIGKILL
        # Process facts only: no `running` without a monitor's verdict.
        assert [e.kind for e in events] == ["starting", "exited", "backoff", "starting"]
        with open(after.log_path) as f:
            assert "=== seawall: starting r0 (restarts=1" in f.read()


async def test_a_crash_looping_command_backs_off_and_never_runs(artifacts: Path) -> None:
    events: list[ReplicaEvent] = []
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    async with LocalSupervisor(
        log_dir=artifacts,
        command=crash,
        backoff=BackoffPolicy(initial_s=0.05, max_s=0.2),
        on_change=events.append,
    ) as sup:
        await sup.start("m", 1)
        await until(lambda: sup.replicas()[0].crash_streak >= 4)
        backoffs = [e.status for e in events if e.kind == "backoff"]
        assert [s.crash_streak for s in backoffs[:4]] == [1, 2, 3, 4]
        assert all(s.last_exit_code == 3 and s.pid is None for s in backoffs)
        assert "exited with code 3" in backoffs[0].reason
        assert "running" not in [e.kind for e in events]


async def test_a_restart_request_does_not_cut_a_crash_backoff_short(artifacts: Path) -> None:
    """The fleet monitor asks for a restart whenever it sees a replica die; obeying
    during the backoff would make a crash loop a tight loop."""
    events: list[ReplicaEvent] = []
    crash = [sys.executable, "-c", "import sys; sys.exit(3)"]
    async with LocalSupervisor(
        log_dir=artifacts,
        command=crash,
        backoff=BackoffPolicy(initial_s=600.0),
        on_change=events.append,
    ) as sup:
        (ref,) = await sup.start("m", 1)
        await until(lambda: sup.replicas()[0].state == "backoff")
        await sup.restart(ref, "monitor saw it die")
        (status,) = sup.replicas()
        assert status.state == "backoff" and status.restarts == 0
        assert events[-1].kind == "restart_refused" and "already restarting" in events[-1].reason
        await sup.restart(ref, "operator insists", force=True)
        await until(lambda: sup.replicas()[0].restarts == 1)
        assert [e.kind for e in events].count("starting") == 2


async def test_stop_kills_a_replica_that_ignores_sigterm_after_the_grace(artifacts: Path) -> None:
    async with LocalSupervisor(log_dir=artifacts, command=fake(0.0, "ignore-term")) as sup:
        (ref,) = await sup.start("m", 1)
        await spawned(sup)
        pid = sup.replicas()[0].pid
        assert pid is not None
        await sup.stop(ref, grace_s=0.3)
        (status,) = sup.replicas()
        assert status.state == "stopped" and status.pid is None
        assert not alive(pid)


async def test_close_leaves_no_process_behind_not_even_a_forked_worker(artifacts: Path) -> None:
    pid_files = [artifacts / f"worker-r{i}.pid" for i in range(2)]
    for f in pid_files:
        f.unlink(missing_ok=True)
    # The engine forks a long-lived worker, as vLLM does, then serves.
    forking = [
        "sh",
        "-c",
        f"sleep 300 & echo $! > {artifacts}/worker-{{replica}}.pid.tmp; "
        f"mv {artifacts}/worker-{{replica}}.pid.tmp {artifacts}/worker-{{replica}}.pid; "
        f"exec {sys.executable} -m http.server --bind 127.0.0.1 {{port}}",
    ]
    sup = LocalSupervisor(log_dir=artifacts, command=forking, stop_grace_s=5)
    await sup.start("m", 2)
    await spawned(sup, 2)
    await until(lambda: all(f.exists() for f in pid_files))
    workers = []
    for pid_file in pid_files:
        with open(pid_file) as f:
            workers.append(int(f.read()))
    pids = [*sup.all_pids(), *workers]
    assert len(set(pids)) == 4
    assert all(alive(p) for p in pids)
    await sup.close()
    assert not any(alive(p) for p in pids)
    assert all(s.state == "stopped" for s in sup.replicas())


async def test_a_cordoned_node_keeps_dead_replicas_down_until_uncordoned(artifacts: Path) -> None:
    async with LocalSupervisor(log_dir=artifacts, command=fake(), node="local") as sup:
        (ref,) = await sup.start("m", 1)
        await spawned(sup)
        await sup.cordon("local", Evidence(node="local", reasons=("xid 79",)))
        with pytest.raises(CordonedError):
            await sup.restart(ref, "should be refused")
        with pytest.raises(CordonedError):
            await sup.start_new("m")
        pid = sup.replicas()[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await until(lambda: sup.replicas()[0].state == "stopped")
        assert "cordoned" in sup.replicas()[0].reason
        await sup.uncordon("local")
        await until(lambda: sup.replicas()[0].pid not in (None, pid))
        assert sup.replicas()[0].restarts == 1


async def test_restart_on_request_replaces_the_process_at_once(artifacts: Path) -> None:
    async with LocalSupervisor(log_dir=artifacts, command=fake()) as sup:
        (ref,) = await sup.start("m", 1)
        await spawned(sup)
        pid = sup.replicas()[0].pid
        assert await sup.restart(ref, "stuck")
        await until(lambda: sup.replicas()[0].restarts == 1)
        await until(lambda: sup.replicas()[0].pid not in (None, pid))
        (status,) = sup.replicas()
        assert status.crash_streak == 0
        # Surge-first: the new replica comes up next to the old one, then the old goes.
        extra = await sup.start_new("m")
        assert extra.url != ref.url
        await spawned(sup, 2)
        assert len(sup.replicas()) == 2
        old_pid = sup.replicas()[0].pid
        assert old_pid is not None
        await sup.remove(ref, grace_s=5)
        assert [s.replica_id for s in sup.replicas()] == [extra.replica_id]
        assert not alive(old_pid)


async def test_a_replica_without_a_node_is_its_own_cordon_domain(artifacts: Path) -> None:
    async with LocalSupervisor(log_dir=artifacts, command=fake()) as sup:
        first, second = await sup.start("m", 2)
        await spawned(sup, 2)
        await sup.cordon(first.domain, Evidence(first.domain, ("3 restarts within 3600 s",)))
        with pytest.raises(CordonedError):
            await sup.restart(first, "should be refused")
        assert await sup.restart(second, "the other replica is not cordoned")
        await until(lambda: sup.replicas()[1].restarts == 1)
        await sup.start_new("m")  # nothing machine-wide is cordoned


# ---- with the fleet monitor as the judge (wired as `seawall up` wires them)


async def test_the_monitor_leaves_a_loading_replica_alone_and_marks_it_running(
    artifacts: Path,
) -> None:
    events: list[ReplicaEvent] = []
    async with LocalSupervisor(
        log_dir=artifacts, command=fake(2.0), on_change=events.append
    ) as sup:
        monitor = judge(sup, artifacts, startup_allowance_s=60)
        async with monitor:
            await sup.start("m", 1)
            await spawned(sup)
            pid = sup.replicas()[0].pid
            assert sup.replicas()[0].state == "starting"
            assert await sup.wait_running(30)
            (status,) = sup.replicas()
            assert status.pid == pid and status.restarts == 0
            assert [e.kind for e in events] == ["starting", "running"]
            assert monitor.snapshot().replicas["r0"].routable


async def test_the_monitor_restarts_a_replica_that_never_answers_when_its_allowance_ends(
    artifacts: Path,
) -> None:
    """The monitor's startup allowance is the one rule: the supervisor has none."""
    events: list[ReplicaEvent] = []
    async with (
        LocalSupervisor(log_dir=artifacts, command=fake(600.0), on_change=events.append) as sup,
        judge(sup, artifacts, startup_allowance_s=1.0),
    ):
        await sup.start("m", 1)
        await spawned(sup)
        pid = sup.replicas()[0].pid
        await until(lambda: sup.replicas()[0].restarts == 1)
        await until(lambda: sup.replicas()[0].pid not in (None, pid))
        (status,) = sup.replicas()
        assert status.reason.startswith("restarted: not healthy within the startup allowance")
        assert status.crash_streak == 0  # a deliberate restart, no crash backoff
        assert [e.kind for e in events][:2] == ["starting", "starting"]
