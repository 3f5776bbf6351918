"""Running a benchmark from `bench/` end to end in a test (its figures are not asserted,
only that it ran and what it printed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, timeout_s: float) -> str:
    """`bench/<script>` with this Python, to its end; its stdout. Fails with the tail of
    its output when it exits non-zero."""
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / script), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout
