"""A benchmark stopped with SIGTERM or SIGHUP takes its sims and gateways with it.

Each child a benchmark starts (`bench/_common.Proc`) runs in its own session, so a signal
sent to the benchmark never reaches it; before this, `kill <bench>` left sims and
gateways running, holding ports and CPU for the next run. Real processes: a benchmark-like
script under uvloop, as the benchmarks run, and a child that would sleep for a minute.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.procs import pid_alive as alive

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys
    from pathlib import Path
    sys.path.insert(0, {bench!r})
    from _common import Proc

    async def main():
        child = Proc("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                     Path({log!r}))
        print(child.pid, flush=True)
        await asyncio.sleep(60)

    import uvloop
    uvloop.install()
    asyncio.run(main())
    """
)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signalled_benchmark_stops_its_children(tmp_path: Path, sig: signal.Signals) -> None:
    script = tmp_path / "bench_like.py"
    script.write_text(SCRIPT.format(bench=str(REPO / "bench"), log=str(tmp_path / "sleeper.log")))
    bench = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    child = 0
    try:
        assert bench.stdout is not None
        child = int(bench.stdout.readline())
        assert alive(child)
        bench.send_signal(sig)
        assert bench.wait(timeout=20) == 128 + sig
        deadline = time.monotonic() + 10
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the benchmark's child outlived it"
    finally:
        bench.kill()
        bench.wait()
        if child and alive(child):
            os.killpg(child, signal.SIGKILL)
