"""What reading an engine's `/metrics` costs the gateway's event loop, per scrape.

    .venv/bin/python bench/bench_scrape.py [--baseline REV]... [--rounds 5] [--parses 300]
    .venv/bin/python bench/bench_scrape.py --fleet 1,8,32,128 [--baseline REV]... [--rounds 5]

The fleet monitor scrapes every replica once a second (`fleet.scrape_interval_s`) and
parses the page on the gateway's event loop, between requests: a fleet of N replicas
costs N of these a second, each a pause for every stream on that loop. Timed here, in
the parser alone (the fetch is aiohttp's), on:

- the real vLLM 0.33.0 scrape (`tests/data/vllm-0.33.0-metrics.txt`, 555 lines), read
  into the load view (running, waiting, KV use, preemptions, progress, KV size);
- a real llama-server scrape (`tests/data/llamacpp/metrics-busy-1.txt`);
- `seawall sim`'s dcgm-exporter page for 8 GPUs, read for GPU health.

Each parser runs in its own process (this checkout, and with `--baseline REV` the source
at REV beside it), `--parses` times per round after a warm-up, rounds interleaved; printed:
the median microseconds per parse over rounds, and each baseline's ratio to this
checkout. Warm figures: a scrape that lands on an idle loop costs more (bench/README).

`--fleet N,...`: the fleet monitor's whole handling of one vLLM scrape (parse, health
score, publish, the fleet metrics listening) with N replicas watched, in a leading
monitor that is never started (its private `_on_scrape`, fed the real scrape; nothing
fetched); `--parses` scrapes per size and round, round-robin over the replicas.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    REPO,
    Proc,
    baseline_src,
    free_port,
    machine_context,
    print_table,
    seawall_env,
    sim_argv,
    wait_http,
)

DATA = REPO / "tests" / "data"
PAGES = {
    "vLLM 0.33 load view": ("vllm", DATA / "vllm-0.33.0-metrics.txt"),
    "llama.cpp load view": ("llamacpp", DATA / "llamacpp" / "metrics-busy-1.txt"),
    "DCGM, 8 GPUs": ("dcgm", None),  # fetched from a sim
}

WORKER = """
import json, sys, time
from seawall.fleet.adapters import EngineKind, adapter_for
from seawall.fleet.gpu import parse_dcgm
pages, parses = json.load(sys.stdin), int(sys.argv[1])
out = {}
for name, (kind, text) in pages.items():
    parse = parse_dcgm if kind == "dcgm" else adapter_for(EngineKind(kind)).parse
    for _ in range(50):
        parse(text)
    start = time.perf_counter()
    for _ in range(parses):
        parse(text)
    out[name] = (time.perf_counter() - start) / parses * 1e6
print(json.dumps(out))
"""


FLEET_WORKER = """
import json, statistics, sys, time
from seawall import clock
from seawall.fleet.config import FleetMonitorConfig
from seawall.fleet.monitor import FleetMonitor
from seawall.fleet.tracked import ReplicaSpec
from seawall.metrics import Metrics
text, sizes, scrapes = json.load(sys.stdin), json.loads(sys.argv[1]), int(sys.argv[2])
out = {}
for n in sizes:
    # A leading monitor, never started (nothing is fetched), with the gateway's fleet
    # metrics listening; its replicas added as start() would, then each scraped in turn.
    monitor = FleetMonitor(FleetMonitorConfig(), metrics=Metrics())
    for i in range(n):
        spec = ReplicaSpec(f"r{i}", f"http://127.0.0.1:{9000 + i}", "m", engine="vllm")
        monitor._replicas[spec.replica_id] = monitor._new_replica(spec)
    monitor._publish(force=True)
    reps = list(monitor._replicas.values())
    for rep in reps * 3:
        monitor._on_scrape(rep, text, clock.monotonic())
    took = []
    for k in range(scrapes):
        rep = reps[k % n]
        start = time.perf_counter()
        monitor._on_scrape(rep, text, clock.monotonic())
        took.append(time.perf_counter() - start)
    views = monitor.snapshot().replicas
    assert len(views) == n and all(v.load is not None for v in views.values()), "not scraped"
    out[str(n)] = statistics.median(took) * 1e6
print(json.dumps(out))
"""


def dcgm_page(work: Path) -> str:
    port = free_port()
    argv = sim_argv(port, "sim-model", "--dcgm-gpus", "8")
    sim = Proc("sim", argv, work / "sim.log", seawall_env(), REPO, port)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 30, sim)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/dcgm/metrics", timeout=10) as r:
            return str(r.read().decode())
    finally:
        sim.stop()


def run_worker(src: Path, code: str, argv: list[str], given: object) -> dict[str, float]:
    """`code` in its own Python with `src` on its path, `given` as JSON on its stdin; its
    JSON answer (microseconds per name)."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", code, *argv],
        input=json.dumps(given),
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    got: dict[str, float] = json.loads(out.stdout)
    return got


def timed(src: Path, pages: dict[str, tuple[str, str]], parses: int) -> dict[str, float]:
    return run_worker(src, WORKER, [str(parses)], pages)


def fleet_timed(src: Path, text: str, sizes: list[int], scrapes: int) -> dict[str, float]:
    return run_worker(src, FLEET_WORKER, [json.dumps(sizes), str(scrapes)], text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", action="append", default=[], metavar="REV")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parses", type=int, default=300, help="per page per round")
    parser.add_argument(
        "--fleet",
        metavar="N,N,...",
        help="instead: the fleet monitor's whole handling of one vLLM scrape (parse, "
        "score, publish, listeners) with N replicas watched",
    )
    args = parser.parse_args()
    print(machine_context())
    if args.fleet:
        return fleet(args, [int(n) for n in args.fleet.split(",")])
    work = Path(tempfile.mkdtemp(prefix="bench-scrape-"))
    pages = {
        name: (kind, path.read_text() if path is not None else dcgm_page(work))
        for name, (kind, path) in PAGES.items()
    }
    sources = {"this checkout": REPO / "src"}
    sources.update({f"seawall@{rev}": baseline_src(rev) for rev in args.baseline})
    runs: dict[str, dict[str, list[float]]] = {s: {p: [] for p in pages} for s in sources}
    started = time.monotonic()
    for _ in range(args.rounds):
        for source, src in sources.items():
            for page, us in timed(src, pages, args.parses).items():
                runs[source][page].append(us)
    rows = []
    for page, (_kind, text) in pages.items():
        mine = statistics.median(runs["this checkout"][page])
        for source in sources:
            us = statistics.median(runs[source][page])
            rows.append([page, len(text.splitlines()), source, us, us / mine])
    print(
        f"\n{args.rounds} rounds of {args.parses} parses per page and source, interleaved, "
        f"warm ({time.monotonic() - started:.0f} s)\n"
    )
    print_table(["page", "lines", "parser", "us per parse (median)", "x this checkout"], rows)
    return 0


def fleet(args: argparse.Namespace, sizes: list[int]) -> int:
    text = (DATA / "vllm-0.33.0-metrics.txt").read_text()
    sources = {"this checkout": REPO / "src"}
    sources.update({f"seawall@{rev}": baseline_src(rev) for rev in args.baseline})
    runs: dict[str, dict[str, list[float]]] = {s: {str(n): [] for n in sizes} for s in sources}
    for _ in range(args.rounds):
        for source, src in sources.items():
            for n, us in fleet_timed(src, text, sizes, args.parses).items():
                runs[source][n].append(us)
    rows = []
    for n in sizes:
        mine = statistics.median(runs["this checkout"][str(n)])
        for source in sources:
            us = statistics.median(runs[source][str(n)])
            rows.append([n, source, us, us * n / 1000, us / mine])
    print(
        f"\n{args.rounds} rounds of {args.parses} scrapes per fleet size and source, "
        "interleaved; each replica scraped once a second (fleet.scrape_interval_s)\n"
    )
    print_table(
        ["replicas", "monitor", "us per scrape (median)", "ms of loop a second", "x this checkout"],
        rows,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
