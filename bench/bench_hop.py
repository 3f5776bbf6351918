"""What one hop through `seawall serve` adds to a lone request's time to first token.

    python bench/bench_hop.py [--rounds 200] [--max-tokens 8] [--baseline REV]... [--python PY]...
        [--stages] [--tenant] [--new-connections]

One `seawall sim` replica; in front of it the gateway (`seawall serve --replica ...`),
`tcp_relay.py` (a byte relay that parses nothing: the floor under any proxy's hop on this
machine), `py_proxy.py` (httptools, orjson and Seawall's upstream client, relaying from
the socket callback and doing nothing else: the floor under a Python gateway) and
`aio_proxy.py` (the same on aiohttp's server, router and request, as Seawall takes its
requests). Each round sends one streamed chat request to each of the five, in random
order, one at a time,
20-60 ms apart, each on its own kept-alive connection (as guidellm's httpx client does),
and times the write to the first non-empty content in the stream. A lone request is
where a proxy's own latency is least hidden by queueing: issue 14's guidellm comparison
asks it to be within the noise of direct runs.

Prints per target: TTFT p50 / p90 / mean (ms) and its p50 minus direct's, then the hop
in four parts: one more process (the relay over direct), Python's HTTP handling
(py-proxy over the relay), aiohttp's server (aio-proxy over py-proxy) and Seawall's
features (the gateway over aio-proxy). Bounded: `--rounds` x 5 requests, 127.0.0.1 only.
The sim batches on 10 ms steps, so a target's TTFT moves by a millisecond between runs:
read the differences of one run, whose targets interleave, not figures across runs.
`--baseline REV` (repeatable) adds the gateway as of git revision REV (its `src/`
exported under bench/.peers, as `bench_gateway.py` does): a change to the request path
measured against what it changes, in the same run. `--python PY` (repeatable) adds this
checkout's gateway run by another interpreter, one with Seawall's dependencies installed
(`PY -m pip install -e .`). `--stages` adds one more, this checkout's gateway with a
timestamp at each stage of a request's way through it (`stage_gateway.py`), and prints
where its time goes, stage by stage (p50 and mean): that target's own TTFT includes the
timestamps' cost, so read the hop from the others. `--tenant` runs every gateway with
one keyed tenant and a tier with every limit a request meets on its way in (none
reached), and sends its key with every request: the hop of the shape production runs,
where the default is a gateway with nothing configured. `--new-connections` opens a
connection for each request (as guidellm does) and times it from before the connect.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    FLOORS,
    REPO,
    Proc,
    baseline_src,
    free_port,
    machine_context,
    percentile,
    print_table,
    seawall_env,
    sim_argv,
    start_floor,
    start_plain_gateway,
    wait_http,
)

MODEL = "sim-model"


class Client:
    """One kept-alive HTTP/1.1 connection, one request at a time; with `fresh`, a new
    connection for each request (guidellm's client opened 43 for 38 requests in a 10 s
    run, `ss -tan` after it), timed from before the connect."""

    def __init__(self, port: int, key: str | None = None, fresh: bool = False) -> None:
        self.port = port
        self.auth = f"Authorization: Bearer {key}\r\n" if key else ""
        self.fresh = fresh
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def ttft_s(self, n: int, max_tokens: int) -> float:
        began = time.perf_counter()
        if self.streams is None:
            self.streams = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self.streams
        body = json.dumps(
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"request {n}: " + "hello " * 20}],
                "max_tokens": max_tokens,
                "ignore_eos": True,  # the sim samples EOS: an answer could be empty
                "stream": True,
            }
        ).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{self.auth}\r\n"
        ).encode()
        sent = began if self.fresh else time.perf_counter()
        writer.write(head + body)
        buf = b""
        first: float | None = None
        while not buf.endswith(b"0\r\n\r\n"):  # the chunked body's end: the connection is free
            chunk = await reader.read(65536)
            if not chunk:
                raise ConnectionError(f"127.0.0.1:{self.port} closed the connection")
            buf += chunk
            if first is None and b'"content":"' in buf.replace(b'"content":""', b""):
                first = time.perf_counter() - sent
        if first is None:
            raise RuntimeError(f"no content from 127.0.0.1:{self.port}: {buf[-600:]!r}")
        if self.fresh:
            writer.close()
            self.streams = None
        return first


async def measure(
    targets: dict[str, int],
    rounds: int,
    max_tokens: int,
    key: str | None = None,
    fresh: bool = False,
) -> dict[str, list[float]]:
    clients = {name: Client(port, key, fresh) for name, port in targets.items()}
    got: dict[str, list[float]] = {name: [] for name in targets}
    rng = random.Random(14)
    for n in range(rounds):
        for name in rng.sample(list(targets), len(targets)):
            got[name].append(await clients[name].ttft_s(n, max_tokens))
            await asyncio.sleep(rng.uniform(0.02, 0.06))
    for c in clients.values():
        if c.streams is not None:
            c.streams[1].close()
    return got


def tenant_config(work: Path) -> tuple[Path, str]:
    """A config with one tenant, its key and a tier with every limit a request meets on
    its way in (prompt and output bounds, request and token rates, concurrency), none of
    them reached by the bench: the path a keyed, limited request takes (`--tenant`)."""
    from seawall.auth import hash_key, new_key

    key = new_key()
    path = work / "tenant.yaml"
    path.write_text(
        json.dumps(
            {
                "tiers": {
                    "gold": {
                        "max_prompt_tokens": 16000,
                        "max_tokens": 4096,
                        "requests_per_min": 1_000_000,
                        "prompt_tokens_per_min": 100_000_000,
                        "max_concurrent": 64,
                    }
                },
                "tenants": {"bench": {"tier": "gold", "api_key_hashes": [hash_key(key)]}},
            }
        )
    )
    return path, key


def start_stage_gateway(sim_port: int, work: Path, config: Path | None = None) -> Proc:
    """`stage_gateway.py serve` in front of the sim, ready (`--stages`)."""
    return start_plain_gateway(
        [f"http://127.0.0.1:{sim_port}"],
        work / "stage_gateway.log",
        name="seawall (timed stages)",
        launcher=(str(REPO / "bench" / "stage_gateway.py"),),
        env={"SEAWALL_STAGES_OUT": str(work / "stages.json")},
        config=config,
    )


def read_stages(proc: Proc, path: Path) -> list[dict[str, float]]:
    """Every request the stage gateway timed (it writes them on SIGUSR1)."""
    os.kill(proc.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} wrote no {path.name}: see {proc.log_path}")
        time.sleep(0.05)
    timed: list[dict[str, float]] = json.loads(path.read_text())
    return timed


def print_stages(timed: list[dict[str, float]]) -> None:
    """Per stage, the p50 and mean of its time since the stage before it, over the
    requests that passed every stage; then the request's time in the gateway (its way
    in, and the first token's way out), without the engine's time between them."""
    order = max(timed, key=len)
    names = sorted(order, key=order.__getitem__)
    whole = [t for t in timed if t.keys() == order.keys()]
    rows = []
    for before, after in itertools.pairwise(names):
        ms = [(t[after] - t[before]) * 1e3 for t in whole]
        rows.append(
            [f"{before} -> {after}", f"{percentile(ms, 50):.3f}", f"{sum(ms) / len(ms):.3f}"]
        )
    own = [
        (t["sent upstream"] + t["token out"] - t["token in"]) * 1e3
        for t in whole
        if {"sent upstream", "token in", "token out"} <= t.keys()
    ]
    print(
        f"\nwhere a lone request's time in the gateway goes ({len(whole)} of {len(timed)} timed):"
    )
    print_table(["stage", "p50 ms", "mean ms"], rows)
    if own:
        print(
            f"time in the gateway on the request's path (in -> sent upstream, token in -> "
            f"token out): "
            f"p50 {percentile(own, 50):.3f} ms, mean {sum(own) / len(own):.3f}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=200, help="requests to each target")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument(
        "--baseline",
        metavar="REV",
        action="append",
        default=[],
        help="also the gateway as of git revision REV (repeatable)",
    )
    parser.add_argument(
        "--python",
        metavar="PY",
        action="append",
        default=[],
        help="also this checkout's gateway run by interpreter PY (repeatable)",
    )
    parser.add_argument(
        "--stages", action="store_true", help="also a gateway timing each stage of a request"
    )
    parser.add_argument(
        "--tenant",
        action="store_true",
        help="every gateway with a keyed tenant and tier limits, every request with its key",
    )
    parser.add_argument(
        "--new-connections",
        action="store_true",
        help="a new connection for each request, timed from before the connect",
    )
    args = parser.parse_args()
    print(machine_context())
    work = Path(tempfile.mkdtemp(prefix="bench-hop-"))
    procs: list[Proc] = []
    try:
        sim_port = free_port()
        sim = Proc(
            "sim", sim_argv(sim_port, MODEL), work / "sim.log", seawall_env(), REPO, sim_port
        )
        procs.append(sim)
        wait_http(f"http://127.0.0.1:{sim_port}/health", 30, sim)
        config, key = tenant_config(work) if args.tenant else (None, None)
        gateway = start_plain_gateway(
            [f"http://127.0.0.1:{sim_port}"], work / "gateway.log", config=config
        )
        procs.append(gateway)
        targets = {"direct": sim_port, "seawall": gateway.port}
        for rev in args.baseline:
            base = start_plain_gateway(
                [f"http://127.0.0.1:{sim_port}"],
                work / f"seawall-{rev}.log",
                src=baseline_src(rev),
                name=f"seawall@{rev}",
                config=config,
            )
            procs.append(base)
            targets[base.name] = base.port
        for py in args.python:
            version = subprocess.run(
                [py, "-c", "import sys; print(sys.version.split()[0])"],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.strip()
            other = start_plain_gateway(
                [f"http://127.0.0.1:{sim_port}"],
                work / f"python-{version}.log",
                name=f"seawall@py{version}",
                python=py,
                config=config,
            )
            procs.append(other)
            targets[other.name] = other.port
        for script in FLOORS:
            floor = start_floor(script, sim_port, work / f"{script}.log")
            procs.append(floor)
            targets[floor.name] = floor.port
        timed: Proc | None = None
        if args.stages:
            timed = start_stage_gateway(sim_port, work, config)
            procs.append(timed)
            targets[timed.name] = timed.port or 0
        got = asyncio.run(measure(targets, args.rounds, args.max_tokens, key, args.new_connections))
        stages = read_stages(timed, work / "stages.json") if timed is not None else []
    finally:
        for p in reversed(procs):
            p.stop()
    p50 = {name: percentile(v, 50) * 1e3 for name, v in got.items()}
    rows = []
    for name, v in got.items():
        ms = [x * 1e3 for x in v]
        rows.append(
            [
                name, len(ms), f"{p50[name]:.2f}", f"{percentile(ms, 90):.2f}",
                f"{sum(ms) / len(ms):.2f}", f"{p50[name] - p50['direct']:+.2f}",
            ]
        )  # fmt: skip
    print(
        f"\none request at a time, {args.rounds} to each target in random order, "
        f"{args.max_tokens} output tokens, one sim replica"
        f"{'; the gateways with a keyed, limited tenant (--tenant)' if args.tenant else ''}\n"
    )
    print_table(["target", "n", "TTFT p50 ms", "p90", "mean", "p50 minus direct"], rows)
    print(
        f"\nthe hop's parts (p50): one more process {p50['tcp-relay'] - p50['direct']:+.2f} ms "
        f"(tcp-relay), Python's HTTP handling {p50['py-proxy'] - p50['tcp-relay']:+.2f} ms "
        f"(py-proxy beyond tcp-relay), aiohttp's server {p50['aio-proxy'] - p50['py-proxy']:+.2f} "
        f"ms (aio-proxy beyond py-proxy), Seawall's features "
        f"{p50['seawall'] - p50['aio-proxy']:+.2f} ms (beyond aio-proxy); Seawall beyond the "
        f"byte relay {p50['seawall'] - p50['tcp-relay']:+.2f} ms"
    )
    for rev in args.baseline:
        label = f"seawall@{rev}"
        print(f"this checkout minus {label} (p50): {p50['seawall'] - p50[label]:+.2f} ms")
    if stages:
        print_stages(stages)
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
