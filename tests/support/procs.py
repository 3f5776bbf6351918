"""Real processes on loopback for integration tests: ports, subprocesses, readiness waits.

Every integration test starts what it needs through here, so a test never leaves a
process behind (each `Proc` is killed at fixture teardown) and never talks to anything
but 127.0.0.1.
"""

from __future__ import annotations

import os
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


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
    return Proc(list(argv), popen, log_path, port)


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
