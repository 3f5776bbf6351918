"""guidellm's TTFT and ITL through `seawall serve` against direct, with the noise.

    python bench/bench_guidellm.py [--seconds 20] [--rate 4] [--prompt-tokens 128]
        [--output-tokens 64] [--replicas 1]

guidellm 0.8 (unchanged, in its own venv: `./dev setup`, tests/support/guidellm.py)
runs the same constant-rate load three times against the same `seawall sim` replica:
direct, through the gateway (`seawall serve --replica ...`), and direct again. One
replica by default, so the gateway's run meets the same engine as the direct ones
(guidellm has one target; with `--replicas N` the gateway spreads over N, direct
still uses the first). The two direct runs give the noise: the gateway matches direct when its
difference from the direct mean is within the two direct runs' spread. Each run has its
own data seed, so no run reuses another's prompts from the sims' prefix cache.

Prints per run: requests ok / errored, TTFT and ITL (ms) median and p95 as guidellm
measures them, then gateway minus direct-mean beside |direct 1 - direct 2|. Bounded:
each run is `--seconds` at `--rate` requests/s, to 127.0.0.1 only. Figures from a busy
machine measure the wait for a core as well; publish only quiet-machine runs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from tests.support import guidellm  # noqa: E402

from _common import (  # noqa: E402
    Proc,
    free_port,
    machine_context,
    print_table,
    seawall_env,
    sim_argv,
    wait_http,
)

MODEL = "sim-model"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=4.0, help="requests per second")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--replicas", type=int, default=1)
    args = parser.parse_args()
    if guidellm.binary() is None:
        print(f"guidellm is not installed in {guidellm.venv_dir()}: run ./dev setup")
        return 2
    print(machine_context())
    work = Path(tempfile.mkdtemp(prefix="bench-guidellm-"))
    tokenizer = guidellm.make_tokenizer(work / "tokenizer")
    procs: list[Proc] = []
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
        port = free_port()
        argv = [sys.executable, "-m", "seawall", "serve", "--port", str(port), "--no-access-log"]
        for sim in sims:
            argv += ["--replica", f"http://127.0.0.1:{sim.port}"]
        gateway = Proc("gateway", argv, work / "gateway.log", seawall_env(), REPO, port)
        procs.append(gateway)
        wait_http(f"http://127.0.0.1:{port}/readyz?fleet=1", 30, gateway)

        runs = [
            ("direct 1", f"http://127.0.0.1:{sims[0].port}"),
            ("gateway", f"http://127.0.0.1:{port}"),
            ("direct 2", f"http://127.0.0.1:{sims[0].port}"),
        ]
        results = {}
        for seed, (name, target) in enumerate(runs, start=101):
            results[name] = guidellm.run(
                target,
                work / f"{name.replace(' ', '-')}.json",
                seed=seed,
                seconds=args.seconds,
                rate=args.rate,
                tokenizer=tokenizer,
                prompt_tokens=args.prompt_tokens,
                output_tokens=args.output_tokens,
                timeout_s=args.seconds * 4 + 300,
            )
    finally:
        for p in reversed(procs):
            p.stop()

    print(
        f"\nguidellm {guidellm.VERSION}, constant {args.rate:g} req/s for {args.seconds:g} s, "
        f"{args.prompt_tokens} prompt / {args.output_tokens} output tokens, "
        f"{args.replicas} sim replica(s) behind the gateway; direct uses the first\n"
    )
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name, r.successful, r.errored,
                f"{r.ttft_ms['median']:.1f}", f"{r.ttft_ms['p95']:.1f}",
                f"{r.itl_ms['median']:.2f}", f"{r.itl_ms['p95']:.2f}",
            ]
        )  # fmt: skip
    print_table(
        ["run", "ok", "errored", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms"], rows
    )
    d1, gw, d2 = results["direct 1"], results["gateway"], results["direct 2"]
    print()
    rows = []
    for label, pick in (
        ("TTFT p50 ms", lambda r: r.ttft_ms["median"]),
        ("ITL p50 ms", lambda r: r.itl_ms["median"]),
    ):
        added = pick(gw) - (pick(d1) + pick(d2)) / 2
        noise = abs(pick(d1) - pick(d2))
        verdict = "within noise" if abs(added) <= noise else "outside noise"
        rows.append([label, f"{added:+.2f}", f"{noise:.2f}", verdict])
    print_table(["figure", "gateway - direct mean", "|direct 1 - direct 2|", ""], rows)
    print(f"\nlogs and guidellm reports: {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
