"""Shared fixtures. Process helpers live in `tests/support/procs.py`."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import (
    ARTIFACTS,
    require_binary,
    spawned_mark,
    stable_port,
    stop_spawned_since,
)
from tests.support.redis_server import RedisServer
from tests.support.up import Up, start_up


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """Whatever the test body started is stopped when it ends, however it ends: a failed
    start (a gateway that never became ready) must not leave the sims before it running.
    Fixtures stop what they start themselves, in their own teardown."""
    mark = spawned_mark()
    try:
        return (yield)
    finally:
        stop_spawned_since(mark)


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A per-test folder under test-artifacts/ for logs and screenshots kept after the run."""
    path = ARTIFACTS / request.node.name.replace("/", "_").replace("[", "_").replace("]", "")
    # Fresh each run: a restart ledger left by an earlier run would cordon a node here.
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    yield path


@pytest.fixture
def redis_server(artifacts: Path) -> Iterator[RedisServer]:
    server = RedisServer(require_binary("redis-server"), stable_port(), artifacts)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def up(artifacts: Path) -> Iterator[Up]:
    """`seawall up` with three sim replicas and the admin API (see tests/support/up.py)."""
    handle = start_up(artifacts)
    try:
        yield handle
    finally:
        handle.proc.stop()
