"""What reading an engine's `/metrics` costs the gateway's event loop, per scrape.

    .venv/bin/python bench/bench_scrape.py [--baseline REV]... [--rounds 5] [--parses 300]

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


def timed(src: Path, pages: dict[str, tuple[str, str]], parses: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    out = subprocess.run(
        [sys.executable, "-c", WORKER, str(parses)],
        input=json.dumps(pages),
        capture_output=True,
        text=True,
        env=env,
        check=True,
        timeout=300,
    )
    got: dict[str, float] = json.loads(out.stdout)
    return got


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", action="append", default=[], metavar="REV")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parses", type=int, default=300, help="per page per round")
    args = parser.parse_args()
    print(machine_context())
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


if __name__ == "__main__":
    sys.exit(main())
