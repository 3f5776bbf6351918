"""Losing a region: `seawall drill pool-loss` against two pools, with a standby and without.

    .venv/bin/python bench/bench_pools.py [--rounds 2] [--duration 40] [--concurrency 8]
        [--wan-ms 20] [--failback-after 5]

About 3 minutes with the defaults. The fleet: pool `east` (two `seawall sim` replicas on
loopback) and pool `west` (one sim behind a relay that delays every read by `--wan-ms`,
standing in for another region), one gateway with `pools: {east: {}, west: {priority: 1,
mode: passive}}` and the default `failover.after_s` (2 s); `failover.failback_after_s`
is `--failback-after` (the default 30 s would not fit the drill's window). The drill
(`seawall drill pool-loss`) streams `--concurrency` requests for `--duration` seconds,
kills every engine of the serving pool for 40% of the rest of the window (their /health
503, requests 500), then brings them back, and reports what the clients saw.

Side by side in one run, the same drill on the same fleet:
  standby     the tier may fail over (the default): requests that had not yet received
              a first token go on to west at once, and the pool state follows;
  no-standby  the tier's `pools: {failover: false}`: what a fleet without a standby
              region (or a tier kept in its region) gets: a 503 with Retry-After.
Printed per run: requests, failed before a first token, streams dropped mid-stream (on
the engines that died under them), time to fail over (injection -> the model's serving
pool is west), time to fail back (the pool's return -> serving pool east again), retries
and TTFT p50/p99 during the fault (west is `--wan-ms` further away). Logs go to
bench/results/pools-logs/.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))

from tests.support.chop import ChoppingRelay  # noqa: E402

from _common import (  # noqa: E402
    Proc,
    free_port,
    machine_context,
    print_table,
    seawall_env,
    sim_argv,
    wait_http,
)
from seawall.auth import hash_key  # noqa: E402

MODEL = "sim-model"
ADMIN_TOKEN = "bench-pools-admin-token"
LOGS = REPO / "bench" / "results" / "pools-logs"


def _gateway_config(
    east: list[str], west: str, admin_port: int, port: int, args: argparse.Namespace, standby: bool
) -> dict[str, Any]:
    replicas = [
        {"id": f"east-{i}", "url": u, "model": MODEL, "pool": "east", "node": f"east-node-{i}"}
        for i, u in enumerate(east)
    ]
    replicas.append({"id": "west-0", "url": west, "model": MODEL, "pool": "west"})
    cfg: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"enabled": True, "port": admin_port, "token_hash": hash_key(ADMIN_TOKEN)},
        "replicas": replicas,
        "pools": {"east": {}, "west": {"priority": 1, "mode": "passive"}},
        "failover": {"failback_after_s": args.failback_after},
        "fleet": {"liveness_interval_s": 0.5, "deep_probe_interval_s": 1.0},
    }
    if not standby:
        cfg["tiers"] = {"default": {"pools": {"failover": False}}}
    return cfg


def _routable(admin: str) -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "seawall", "status", "--admin", admin, "--json"],
        capture_output=True,
        text=True,
        timeout=20,
        env=seawall_env({"SEAWALL_ADMIN_TOKEN": ADMIN_TOKEN}),
    )
    if out.returncode != 0:
        return False
    return all(r["routable"] for r in json.loads(out.stdout)["replicas"])


def run_one(args: argparse.Namespace, standby: bool, round_: int) -> dict[str, Any]:
    name = f"{'standby' if standby else 'no-standby'}-{round_}"
    logs = LOGS / name
    env = seawall_env()
    procs: list[Proc] = []
    try:
        east = []
        for i in range(2):
            p = free_port()
            procs.append(
                Proc(f"east{i}", sim_argv(p, MODEL, "--enable-faults"), logs / f"east{i}.log", env)
            )
            east.append(f"http://127.0.0.1:{p}")
        wport = free_port()
        procs.append(Proc("west", sim_argv(wport, MODEL), logs / "west.log", env))
        for proc, url in zip(procs, [*east, f"http://127.0.0.1:{wport}"], strict=True):
            wait_http(url + "/health", 30, proc)
        with ChoppingRelay(wport, piece=None, delay_s=args.wan_ms / 1000) as wan:
            port, admin_port = free_port(), free_port()
            cfg = _gateway_config(east, wan.url, admin_port, port, args, standby)
            path = logs / "gateway.yaml"
            path.write_text(yaml.safe_dump(cfg))
            gw = Proc(
                "gateway",
                [sys.executable, "-m", "seawall", "serve", "--config", str(path)],
                logs / "gateway.log",
                env,
            )
            procs.append(gw)
            admin = f"http://127.0.0.1:{admin_port}"
            wait_http(f"http://127.0.0.1:{port}/readyz", 30, gw)
            deadline = time.monotonic() + 30
            while not _routable(admin):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: replicas not routable:\n{gw.tail()}")
                time.sleep(0.3)
            out = subprocess.run(
                [
                    sys.executable, "-m", "seawall", "drill", "pool-loss", "--admin", admin,
                    "--duration", str(args.duration), "--concurrency", str(args.concurrency),
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=args.duration + 60,
                env=seawall_env({"SEAWALL_ADMIN_TOKEN": ADMIN_TOKEN}),
            )  # fmt: skip
            gw.stop()  # before the relay goes: nothing left mid-pipe
            (logs / "drill.json").write_text(out.stdout + out.stderr)
            if out.returncode != 0:
                raise RuntimeError(f"{name}: drill exited {out.returncode}:\n{out.stderr}")
            report: dict[str, Any] = json.loads(out.stdout)
            report["run"] = name
            return report
    finally:
        for p in reversed(procs):
            p.stop()


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--duration", type=float, default=40.0, help="the drill's whole window")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--wan-ms", type=float, default=20.0, help="delay added to west's reads")
    ap.add_argument("--failback-after", type=float, default=5.0)
    args = ap.parse_args(argv)
    shutil.rmtree(LOGS, ignore_errors=True)
    print(machine_context())
    print(
        f"east: 2 sims; west: 1 sim behind {args.wan_ms:g} ms per read; drill {args.duration:g}"
        f" s x {args.concurrency} streams; failover.after_s 2, failback_after_s "
        f"{args.failback_after:g}\n"
    )
    rows = []
    for r in range(args.rounds):
        for standby in (True, False):
            rep = run_one(args, standby, r)
            d = rep["during"]
            rows.append(
                [
                    rep["run"], rep["requests"], rep["failed_before_first_token"],
                    rep["streams_dropped"], rep["requests_failed"], _s(rep["failover_s"]),
                    _s(rep["failback_s"]), f"{rep['retries']:.0f}", d["ok"],
                    _ms(d["ttft_p50_s"]), _ms(d["ttft_p99_s"]),
                ]
            )  # fmt: skip
            print(f"  {rep['run']}: done", flush=True)
    print()
    print_table(
        [
            "run", "requests", "failed before 1st token", "dropped mid-stream", "failed",
            "failover s", "failback s", "retries", "ok during", "TTFT p50 ms", "p99",
        ],
        rows,
    )  # fmt: skip
    print(f"\nreports and logs: {LOGS.relative_to(REPO)}/")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
