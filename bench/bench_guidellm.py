"""guidellm's TTFT and ITL through `seawall serve` against direct, with the noise.

    python bench/bench_guidellm.py [--seconds 20] [--rate 4] [--prompt-tokens 128]
        [--output-tokens 64] [--replicas 1] [--rounds 1] [--warmup 5] [--peers] [--floor]

guidellm 0.8 (unchanged, in its own venv: `./dev setup`, tests/support/guidellm.py)
runs the same constant-rate load several times against the same `seawall sim` replica:
direct, through the gateway (`seawall serve --replica ...`), through vllm-router with
`--peers` (PyPI `vllm-router`, installed once into bench/.peers as bench_gateway.py
does), and direct again. One replica by default, so every proxied run meets the same
engine as the direct ones (guidellm has one target; with `--replicas N` the proxies
spread over N, direct still uses the first). The two direct runs of a round give the
noise: a proxy matches direct when its difference from the round's direct mean is within
the two direct runs' spread. `--floor` adds `tcp_relay.py`, a byte relay with no HTTP
in front of the first replica: the part of any proxy's hop that one more process and two
more loopback hops cost on this machine, which no proxy can go under; `py_proxy.py`,
which parses HTTP and JSON and relays from the socket callback and does nothing else: the
floor under a gateway written in Python; and `aio_proxy.py`, the same on aiohttp's
server (as Seawall takes its requests), so the pooled figures also say what Seawall adds
beyond each of the two. `--rounds N`
repeats the whole sequence N times (the proxies stay up), so the verdict can be read over
rounds rather than from one. Within a round the proxies run in a shuffled order (seeded,
printed), between the two direct runs: with a fixed order, a drift over the round (direct 2
came out faster than direct 1 in 9 of 12 rounds of four runs) would be read as the cost of
whichever proxy runs first. Before the first round, `--warmup` seconds of the same load go
through each target, not reported, so no measured run is a process's first. Each run has
its own data seed, so no run reuses another's prompts from the sims' prefix cache.

Prints per run: requests ok / errored, TTFT and ITL (ms) median and p95 as guidellm
measures them, with guidellm's own 95% confidence interval of the TTFT median, and the
engine's own TTFT and ITL means over the run (the sims' `vllm:time_to_first_token_seconds`
and `vllm:inter_token_latency_seconds`, scraped before and after it: from a request's
arrival at the engine, so a proxy's hop is the client's TTFT minus the engine's, and an
engine that steps slower or faster in one run shows there); then per
round and proxy: its minus the direct mean beside |direct 1 - direct 2|; then, pooled
over every round's requests, each proxy's TTFT median minus direct's and direct 2's
minus direct 1's, with 95% bootstrap intervals (2,000 resamples of the requests): one
run's median is known to about a millisecond either way, so the spread of one pair of
direct runs is a noisy yardstick, and the pooled figure says what a proxy adds.
Bounded: each run is `--seconds` at `--rate` requests/s, to 127.0.0.1 only.
Figures from a busy machine measure the wait for a core as well; publish only
quiet-machine runs.
"""

from __future__ import annotations

import argparse
import random
import re
import statistics
import sys
import tempfile
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from tests.support import guidellm  # noqa: E402

from _common import (  # noqa: E402
    FLOORS,
    Proc,
    free_port,
    machine_context,
    print_table,
    seawall_env,
    sim_argv,
    start_floor,
    start_plain_gateway,
    start_vllm_router,
    wait_http,
)

MODEL = "sim-model"
_ENGINE_SERIES = re.compile(
    r"^vllm:(time_to_first_token|inter_token_latency)_seconds_(sum|count)\{[^}]*\} (\S+)$",
    re.MULTILINE,
)


def engine_sums(urls: list[str]) -> dict[tuple[str, str], float]:
    """The sims' TTFT and ITL histogram sums and counts, added over the sims."""
    out: dict[tuple[str, str], float] = {}
    for url in urls:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for name, part, value in _ENGINE_SERIES.findall(text):
            out[name, part] = out.get((name, part), 0.0) + float(value)
    return out


def engine_means_ms(
    before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]
) -> tuple[float, float]:
    """(TTFT, ITL) means in ms over what the engines did between two scrapes."""
    means = []
    for name in ("time_to_first_token", "inter_token_latency"):
        count = after.get((name, "count"), 0.0) - before.get((name, "count"), 0.0)
        total = after.get((name, "sum"), 0.0) - before.get((name, "sum"), 0.0)
        means.append(total / count * 1000 if count else float("nan"))
    return means[0], means[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="direct, proxies, direct; N times")
    parser.add_argument(
        "--warmup",
        type=float,
        default=5.0,
        help="seconds of load through each target before the first round, not reported",
    )
    parser.add_argument("--peers", action="store_true", help="also through vllm-router")
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also through a byte relay (no HTTP) and a do-nothing Python proxy: the floors",
    )
    args = parser.parse_args()
    if guidellm.binary() is None:
        print(f"guidellm is not installed in {guidellm.venv_dir()}: run ./dev setup")
        return 2
    print(machine_context())
    work = Path(tempfile.mkdtemp(prefix="bench-guidellm-"))
    tokenizer = guidellm.make_tokenizer(work / "tokenizer")
    procs: list[Proc] = []
    proxies: dict[str, str] = {}  # name -> its url
    notes: dict[str, str] = {}
    try:
        sims = []
        for i in range(args.replicas):
            port = free_port()
            sim = Proc(
                f"sim{i}", sim_argv(port, MODEL), work / f"sim{i}.log", seawall_env(), REPO, port
            )
            procs.append(sim)
            sims.append(sim)
        for sim in sims:
            wait_http(f"http://127.0.0.1:{sim.port}/health", 30, sim)
        upstreams = [f"http://127.0.0.1:{sim.port}" for sim in sims]
        gateway = start_plain_gateway(upstreams, work / "gateway.log")
        procs.append(gateway)
        proxies["gateway"] = f"http://127.0.0.1:{gateway.port}"
        if args.peers:
            port = free_port()
            router, notes["vllm-router"] = start_vllm_router(
                upstreams, port, work / "vllm-router.log"
            )
            procs.append(router)
            proxies["vllm-router"] = f"http://127.0.0.1:{port}"

        if args.floor:
            assert sims[0].port is not None
            for script in FLOORS:
                floor = start_floor(script, sims[0].port, work / f"{script}.log")
                procs.append(floor)
                proxies[floor.name] = f"http://127.0.0.1:{floor.port}"

        direct = upstreams[0]
        seed = 101
        engine: dict[tuple[str, str], tuple[float, float]] = {}  # (label, name) -> means

        def run(name: str, target: str, label: str, seconds: float) -> guidellm.Result:
            nonlocal seed
            seed += 1
            before = engine_sums(upstreams)
            try:
                return guidellm.run(
                    target,
                    work / f"{label}-{name.replace(' ', '-')}.json",
                    seed=seed,
                    seconds=seconds,
                    rate=args.rate,
                    tokenizer=tokenizer,
                    prompt_tokens=args.prompt_tokens,
                    output_tokens=args.output_tokens,
                    timeout_s=seconds * 4 + 300,
                )
            finally:
                engine[label, name] = engine_means_ms(before, engine_sums(upstreams))

        if args.warmup > 0:
            for name, target in [("direct", direct), *proxies.items()]:
                run(name, target, "warmup", args.warmup)  # not reported
        results: list[dict[str, guidellm.Result]] = []
        orders: list[list[str]] = []
        shuffle = random.Random(14)
        for i in range(1, args.rounds + 1):
            order = list(proxies)
            shuffle.shuffle(order)
            orders.append(order)
            got = {"direct 1": run("direct 1", direct, f"round{i}", args.seconds)}
            for name in order:
                got[name] = run(name, proxies[name], f"round{i}", args.seconds)
            got["direct 2"] = run("direct 2", direct, f"round{i}", args.seconds)
            results.append(got)
    finally:
        for p in reversed(procs):
            p.stop()

    peers = f"; vllm-router {notes['vllm-router']} (round_robin)" if "vllm-router" in notes else ""
    print(
        f"\nguidellm {guidellm.VERSION}, constant {args.rate:g} req/s for {args.seconds:g} s, "
        f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens, "
        f"{args.replicas} sim replica(s) behind each proxy; direct uses the first{peers}\n"
    )
    for i, order in enumerate(orders, start=1):
        print(f"round {i}: direct 1, {', '.join(order)}, direct 2")
    print()
    rows = []
    for i, got in enumerate(results, start=1):
        for name, r in got.items():
            e_ttft, e_itl = engine[f"round{i}", name]
            rows.append(
                [
                    i, name, r.successful, r.errored, f"{r.ttft_ms['median']:.1f}",
                    "{:.1f}-{:.1f}".format(*r.ttft_median_ci), f"{r.ttft_ms['p95']:.1f}",
                    f"{r.itl_ms['median']:.2f}", f"{r.itl_ms['p95']:.2f}",
                    f"{e_ttft:.2f}", f"{e_itl:.2f}",
                ]
            )  # fmt: skip
    print_table(
        [
            "round",
            "run",
            "ok",
            "errored",
            "TTFT p50 ms",
            "its 95% CI",
            "TTFT p95 ms",
            "ITL p50 ms",
            "ITL p95 ms",
            "engine TTFT mean",
            "engine ITL mean",
        ],
        rows,
    )
    print()
    rows = []
    for label, pick in (
        ("TTFT p50 ms", lambda r: r.ttft_ms["median"]),
        ("ITL p50 ms", lambda r: r.itl_ms["median"]),
    ):
        for i, got in enumerate(results, start=1):
            d1, d2 = got["direct 1"], got["direct 2"]
            noise = abs(pick(d1) - pick(d2))
            for name in proxies:
                added = pick(got[name]) - (pick(d1) + pick(d2)) / 2
                verdict = "within noise" if abs(added) <= noise else "outside noise"
                rows.append([label, i, name, f"{added:+.2f}", f"{noise:.2f}", verdict])
    print_table(
        ["figure", "round", "through", "minus direct mean", "|direct 1 - direct 2|", ""], rows
    )
    pooled = {
        name: [t for got in results for t in got[name].ttfts_ms]
        for name in ("direct 1", "direct 2", *proxies)
    }
    direct = pooled["direct 1"] + pooled["direct 2"]
    rows = [["direct 2", "direct 1", *_median_difference(pooled["direct 2"], pooled["direct 1"])]]
    rows += [[name, "direct", *_median_difference(pooled[name], direct)] for name in proxies]
    # Seawall beside the do-nothing Python proxies (`--floor`): what its own features add
    # under guidellm, apart from what any Python proxy adds here.
    rows += [
        ["gateway", floor, *_median_difference(pooled["gateway"], pooled[floor])]
        for floor in ("aio-proxy", "py-proxy")
        if floor in pooled
    ]
    print(f"\npooled over {len(results)} round(s), every successful request (95% bootstrap CI):")
    print_table(["TTFT p50 of", "minus that of", "ms", "95% CI"], rows)
    print(f"\nlogs and guidellm reports: {work}")
    return 0


def _median_difference(a: list[float], b: list[float], resamples: int = 2000) -> list[str]:
    """median(a) - median(b), and its 95% interval from resampling each with replacement
    (seeded: the same reports give the same interval)."""
    rng = random.Random(14)
    diffs = sorted(
        statistics.median(rng.choices(a, k=len(a))) - statistics.median(rng.choices(b, k=len(b)))
        for _ in range(resamples)
    )
    low, high = diffs[int(0.025 * resamples)], diffs[int(0.975 * resamples) - 1]
    return [f"{statistics.median(a) - statistics.median(b):+.2f}", f"{low:+.2f} to {high:+.2f}"]


if __name__ == "__main__":
    sys.exit(main())
