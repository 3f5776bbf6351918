"""Real processes on loopback for integration tests: ports, subprocesses, readiness waits.

Every integration test starts what it needs through here, so a test never talks to
anything but 127.0.0.1 and never leaves a process behind: every `Proc` is registered
when spawned, and whatever a test body spawned is stopped when the test ends, however it
ends (`tests/conftest.py`), even when a later start failed before the test could enter
its own `running(...)` block.

Seawall's own processes bind port 0 and print the address they got (`bound_port`), so
no port is picked by the test and then raced for; `free_port` remains for third-party
servers that cannot report theirs, and for tests that need a port nothing listens on.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"


def module_artifacts(name: str) -> Path:
    """A fresh folder under test-artifacts/ for a module-scoped fixture: one per xdist
    worker, since each worker that runs one of the module's tests starts its own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    path = ARTIFACTS / (f"{name}-{worker}" if worker else name)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return path


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie counts as dead: its parent has not reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_STABLE = (10_000, 30_000)  # below Linux's default ephemeral range (32768-60999)


def stable_port() -> int:
    """A free port the kernel never hands out by itself, for a server a test stops and
    starts again on the same address (Redis after an outage, a region coming back):
    with `free_port`, a port left free while the server is down is in the ephemeral range,
    where another test's `bind(0)` or outgoing connection can take it (a Redis client
    once met a gateway's `HTTP/1.0 400` there). Picked at random below that range, and
    checked free; tests on several xdist workers pick apart."""
    low, high = _ephemeral_range()
    lo, hi = _STABLE if _STABLE[1] < low or _STABLE[0] > high else (1024, max(1025, low - 1))
    for _ in range(200):
        port = random.randint(lo, hi)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise AssertionError(f"no free port in {lo}-{hi}")


def require_binary(name: str) -> str:
    """Path of a system binary a test needs. Skips locally when absent; fails in CI,
    where `.ci/run` must have installed it."""
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if Path(p).exists()), None
    )
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is not installed; .ci/run must install it")
        pytest.skip(f"{name} is not installed")
    return path


@dataclass
class Proc:
    """A child process with its log file; `stop()` is idempotent."""

    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path
    port: int | None = None
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive():
            self.popen.send_signal(sig)

    def wait(self, timeout: float) -> int:
        return self.popen.wait(timeout=timeout)

    def stop(self, timeout: float = 5.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=timeout)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


_SPAWNED: list[Proc] = []


def spawn(
    argv: Sequence[str], log_path: Path, port: int | None = None, env: dict[str, str] | None = None
) -> Proc:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    fh = log_path.open("wb")
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    popen = subprocess.Popen(
        list(argv), stdout=fh, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
    )
    fh.close()
    proc = Proc(list(argv), popen, log_path, port)
    _SPAWNED.append(proc)
    return proc


def spawned_mark() -> int:
    return len(_SPAWNED)


def stop_spawned_since(mark: int) -> None:
    """Stop every process spawned after `mark` that is still running, newest first."""
    for proc in reversed(_SPAWNED[mark:]):
        proc.stop()
    del _SPAWNED[mark:]


_BOUND = re.compile(rb"on http://127\.0\.0\.1:(\d+)")


def bound_port(proc: Proc, marker: bytes, timeout: float = 20.0) -> int:
    """The port a child bound itself, from the first log line containing `marker` and
    `on http://127.0.0.1:PORT`. Fails with the log if the child exits or never says."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in proc.log_path.read_bytes().splitlines():
            if marker in line and (m := _BOUND.search(line)):
                proc.port = int(m.group(1))
                return proc.port
        if not proc.alive():
            raise AssertionError(f"process exited ({proc.popen.returncode}):\n{proc.log()[-4000:]}")
        time.sleep(0.02)
    proc.stop()
    raise AssertionError(f"no '{marker.decode()}' address after {timeout}s:\n{proc.log()[-4000:]}")


def seawall_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "seawall", *args]


def wait_http(
    url: str, timeout: float = 15.0, proc: Proc | None = None, ok: Sequence[int] = (200,)
) -> None:
    """Poll `url` until it answers with one of `ok`; fail with the process log otherwise."""
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise AssertionError(f"process exited ({proc.popen.returncode}):\n{proc.log()[-4000:]}")
        try:
            with urllib.request.urlopen(url, timeout=1.0) as r:
                if r.status in ok:
                    return
                last = r.status
        except urllib.error.HTTPError as e:
            if e.code in ok:
                return
            last = e.code
        except OSError as e:
            last = e
        time.sleep(0.05)
    log = proc.log()[-4000:] if proc else ""
    raise AssertionError(f"{url} not ready after {timeout}s (last: {last})\n{log}")
