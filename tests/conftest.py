"""Shared fixtures. Process helpers live in `tests/support/procs.py`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.procs import ARTIFACTS


@pytest.fixture
def artifacts(request: pytest.FixtureRequest) -> Iterator[Path]:
    """A per-test folder under test-artifacts/ for logs and screenshots kept after the run."""
    path = ARTIFACTS / request.node.name.replace("/", "_").replace("[", "_").replace("]", "")
    path.mkdir(parents=True, exist_ok=True)
    yield path
