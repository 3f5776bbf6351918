"""A real redis-server on a loopback port, for tests of the shared limits."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.support.procs import Proc, spawn


@dataclass
class RedisServer:
    binary: str
    port: int
    log_dir: Path
    proc: Proc | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.starts += 1
        argv = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--save", "", "--appendonly", "no"]
        self.proc = spawn(argv, self.log_dir / f"redis-{self.starts}.log", port=self.port)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0)
        try:
            for _ in range(200):  # bounded: 200 x 50 ms
                if not self.proc.alive():
                    raise AssertionError(f"redis-server exited:\n{self.proc.log()}")
                try:
                    if client.ping():
                        return
                except redis.exceptions.ConnectionError:
                    pass
                time.sleep(0.05)
            raise AssertionError(f"redis-server not ready:\n{self.proc.log()}")
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
