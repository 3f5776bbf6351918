"""`bench/bench_hop.py` runs end to end with every option, and its timed gateway sees
every stage of every request.

`stage_gateway.py` wraps the request path's functions by name and signature; a change to
one of them (the relay's `commit`, 5ee1af1) once broke it without any test noticing,
until the benchmark was run by hand. Real processes: the benchmark itself, with its sim,
gateways and floors, three rounds (figures from three rounds mean nothing; only that
it runs and times whole requests is asserted).
"""

from __future__ import annotations

import re

import pytest

from tests.support.benches import run_bench

pytestmark = pytest.mark.integration


def test_bench_hop_runs_and_times_every_stage() -> None:
    rounds = 3
    out = run_bench(
        "bench_hop.py",
        *("--rounds", str(rounds), "--stages", "--tenant", "--new-connections"),
        timeout_s=240,
    )
    for target in (
        "direct",
        "seawall",
        "tcp-relay",
        "py-proxy",
        "aio-proxy",
        "seawall (timed stages)",
    ):
        assert re.search(rf"^{re.escape(target)}\s+{rounds}\s", out, re.M), (target, out)
    # Every timed request passed every stage, the first token's way out included.
    assert f"({rounds} of {rounds} timed)" in out, out
    for stage in ("in -> parsed", "step fleet -> sent upstream", "token in -> token out"):
        assert stage in out, (stage, out)
