"""`bench/bench_scrape.py --fleet` runs end to end.

Its worker drives the fleet monitor through private names (`_new_replica`, `_replicas`,
`_on_scrape`, `_publish`), so a change to one of them would break it without any other
test noticing. Real processes: the benchmark itself, one round of a few scrapes (only
that it runs, and that every replica's scrape reached the published view, is asserted;
the worker checks the latter).
"""

from __future__ import annotations

import re

import pytest

from tests.support.benches import run_bench

pytestmark = pytest.mark.integration


def test_bench_scrape_fleet_runs_for_each_fleet_size() -> None:
    out = run_bench(
        "bench_scrape.py", "--fleet", "1,4", "--rounds", "1", "--parses", "20", timeout_s=120
    )
    for n in (1, 4):
        assert re.search(rf"^{n}\s+this checkout\s+[\d,.]+\s", out, re.M), out
