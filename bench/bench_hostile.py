"""Hostile floods beside a bystander tenant: what the bystander notices, and what the
gateway keeps afterwards (issue 11's "must show").

    python bench/bench_hostile.py [--connections 10000] [--seconds 20] [--probe-every 0.25]
        [--prompt-flood] [--prompt-mb 3.8] [--prompt-loops 2] [--replicas 2]

About a minute with the defaults (add ~25 s with `--prompt-flood`). Smoke run:
`--connections 1000 --seconds 4 --prompt-flood --prompt-mb 1`.

Setup: `--replicas` `seawall sim` replicas and one gateway with the default `server:`
settings (the production defaults are what is measured), two tenants (the attacker's
key and the bystander's, whose tier limits prompts to 4,096 tokens) and the admin API.

Phases, one gateway, in this order:
  baseline      the bystander alone: a short stream every `--probe-every` s (TTFT) and
                one long stream (400 tokens) that must arrive intact
  connections   a separate process opens `--connections` connections without a key and
                sends nothing; each one the gateway closes it reopens (bounded by
                `--reopen-max`), for `--seconds`; the bystander probes as in baseline
  prompts       (`--prompt-flood`) `--prompt-loops` loops of the attacker sending
                `--prompt-mb` MB prompts, refused for size, for `--seconds`
  after         the floods are over: descriptors and RSS given back (waits up to 20 s)

Printed per phase: the bystander's TTFT p50/p99 and the p99 ratio to baseline, whether its
long stream was intact, the admin API's p99 latency, the gateway's RSS (MiB) and open
descriptors at the end of the phase, and the replica states the fleet monitor reported
during it; the flooder's counts (held, reopened after the gateway closed them, refused).
Goals (issue 11): bystander TTFT p99 within 2x of baseline, no replica marked failed,
RSS back within 10% of baseline. Figures from a loaded machine mean nothing: the lead
publishes them from a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Proc,
    free_port,
    machine_context,
    percentile,
    print_table,
    seawall_env,
    sim_argv,
    wait_http,
)

MODEL = "sim-model"
ADMIN_TOKEN = "sk-sw-bench-admin-token-000000000000000000000000000"
BYSTANDER_KEY = "sk-sw-bench-bystander-key-00000000000000000000000000"
ATTACKER_KEY = "sk-sw-bench-attacker-key-000000000000000000000000000"
LONG_STREAM_TOKENS = 400


# ---------------------------------------------------------------------- the flooder


async def _flood(port: int, connections: int, seconds: float, reopen_max: int) -> dict[str, int]:
    """Hold `connections` idle connections for `seconds`, reopening any the server closes
    (at most `reopen_max` times in all)."""
    stats = {"held_peak": 0, "reopened": 0, "refused": 0, "closed_by_gateway": 0}
    held = 0
    deadline = time.monotonic() + seconds
    budget = [reopen_max]

    async def one() -> None:
        nonlocal held
        first = True
        while time.monotonic() < deadline and (first or budget[0] > 0):
            if not first:
                budget[0] -= 1
                stats["reopened"] += 1
            first = False
            try:
                reader, writer = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", port), timeout=5
                )
            except (OSError, TimeoutError):
                stats["refused"] += 1
                await asyncio.sleep(0.05)
                continue
            held += 1
            stats["held_peak"] = max(stats["held_peak"], held)
            try:
                remaining = deadline - time.monotonic()
                data = await asyncio.wait_for(reader.read(), timeout=max(0.01, remaining))
                stats["closed_by_gateway"] += 1
                del data
            except TimeoutError:
                pass
            except OSError:
                stats["closed_by_gateway"] += 1
            finally:
                held -= 1
                writer.close()

    await asyncio.gather(*(one() for _ in range(connections)))
    return stats


def flood_main(args: argparse.Namespace) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, args.connections + 512)
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    stats = asyncio.run(_flood(args.port, args.connections, args.seconds, args.reopen_max))
    Path(args.out).write_text(json.dumps(stats))
    return 0


# -------------------------------------------------------------------- the bystander


class Bystander:
    """Short streams back to back (TTFT), one long stream, and admin API latency."""

    def __init__(self, url: str, admin: str, probe_every_s: float) -> None:
        self.url, self.admin, self.every = url, admin, probe_every_s
        self.ttft_s: list[float] = []
        self.failures: list[str] = []
        self.admin_s: list[float] = []
        self.states: set[str] = set()
        self.long_ok: bool | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def _stream(self, client: httpx.Client, max_tokens: int) -> tuple[float | None, int, bool]:
        body = {
            "model": MODEL,
            "prompt": "the bystander",
            "max_tokens": max_tokens,
            "stream": True,
            "ignore_eos": True,
        }
        started = time.monotonic()
        ttft: float | None = None
        chunks, done = 0, False
        with client.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{r.status_code}: {r.text[:120]}")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: ") and '"text":"' in line and '"text":""' not in line:
                    chunks += 1
                    if ttft is None:
                        ttft = time.monotonic() - started
        return ttft, chunks, done

    def _probes(self) -> None:
        headers = {"Authorization": f"Bearer {BYSTANDER_KEY}"}
        with httpx.Client(timeout=30, headers=headers) as client:
            for _ in range(100_000):  # bounded; stopped long before
                if self._stop.is_set():
                    return
                try:
                    ttft, _, _ = self._stream(client, 4)
                    if ttft is not None:
                        self.ttft_s.append(ttft)
                except (httpx.HTTPError, RuntimeError) as e:
                    self.failures.append(f"{type(e).__name__}: {e}"[:160])
                self._stop.wait(self.every)

    def _long(self) -> None:
        headers = {"Authorization": f"Bearer {BYSTANDER_KEY}"}
        try:
            with httpx.Client(timeout=60, headers=headers) as client:
                _, chunks, done = self._stream(client, LONG_STREAM_TOKENS)
            self.long_ok = done and chunks >= LONG_STREAM_TOKENS // 2
        except (httpx.HTTPError, RuntimeError) as e:
            self.failures.append(f"long: {type(e).__name__}: {e}"[:160])
            self.long_ok = False

    def _admin(self) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        with httpx.Client(timeout=10, headers=headers) as client:
            for _ in range(100_000):
                if self._stop.is_set():
                    return
                started = time.monotonic()
                try:
                    state = client.get(self.admin + "/admin/state").json()
                    self.admin_s.append(time.monotonic() - started)
                    self.states.update(str(r.get("state")) for r in state.get("replicas", []))
                except (httpx.HTTPError, ValueError) as e:
                    self.failures.append(f"admin: {type(e).__name__}"[:160])
                self._stop.wait(0.5)

    def start(self) -> Bystander:
        for target in (self._probes, self._long, self._admin):
            t = threading.Thread(target=target, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(90)


# ------------------------------------------------------------------------- the gateway


def proc_status(pid: int) -> tuple[float, int]:
    """(RSS MiB, open descriptors) of `pid`."""
    rss_kib = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss_kib = int(line.split()[1])
    return rss_kib / 1024.0, len(list(Path(f"/proc/{pid}/fd").iterdir()))


def start_fleet(workdir: Path, replicas: int) -> tuple[list[Proc], Proc, str]:
    from seawall.auth import hash_key

    sims = []
    for i in range(replicas):
        port = free_port()
        sims.append(Proc(f"sim{i}", sim_argv(port, MODEL), workdir / f"sim{i}.log",
                         env=seawall_env(), port=port))  # fmt: skip
    for sim in sims:
        wait_http(f"http://127.0.0.1:{sim.port}/health", 30, sim)
    port, admin_port = free_port(), free_port()
    cfg = {
        "listen": {"host": "127.0.0.1", "port": port},
        "replicas": [
            {"url": f"http://127.0.0.1:{s.port}", "model": MODEL, "id": f"r{i}", "node": f"n{i}"}
            for i, s in enumerate(sims)
        ],
        "tiers": {
            "bystander": {"max_prompt_tokens": 4096},
            "attacker": {"max_prompt_tokens": 4096},
        },
        "tenants": {
            "bystander": {"tier": "bystander", "api_key_hashes": [hash_key(BYSTANDER_KEY)]},
            "attacker": {"tier": "attacker", "api_key_hashes": [hash_key(ATTACKER_KEY)]},
        },
        "admin": {"enabled": True, "port": admin_port, "token_hash": hash_key(ADMIN_TOKEN)},
        "fleet": {"ledger_path": str(workdir / "ledger.sqlite")},
    }
    path = workdir / "gateway.yaml"
    path.write_text(yaml.safe_dump(cfg))
    gw = Proc("gateway", [sys.executable, "-m", "seawall", "serve", "--config", str(path)],
              workdir / "gateway.log", env=seawall_env(), port=port)  # fmt: skip
    wait_http(f"http://127.0.0.1:{port}/readyz", 30, gw)
    return sims, gw, f"http://127.0.0.1:{admin_port}"


def prompt_flood(url: str, megabytes: float, loops: int, seconds: float) -> dict[str, int]:
    body = json.dumps(
        {"model": MODEL, "prompt": "word " * int(megabytes * 1e6 / 5), "max_tokens": 4}
    ).encode()
    counts: dict[str, int] = {}
    deadline = time.monotonic() + seconds

    def loop() -> None:
        headers = {"Authorization": f"Bearer {ATTACKER_KEY}", "Content-Type": "application/json"}
        with httpx.Client(timeout=30, headers=headers) as client:
            for _ in range(10_000):
                if time.monotonic() >= deadline:
                    return
                try:
                    status = str(client.post(url + "/v1/completions", content=body).status_code)
                except httpx.HTTPError as e:
                    status = type(e).__name__
                counts[status] = counts.get(status, 0) + 1

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(loops)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(seconds + 60)
    return counts


def run_phase(
    name: str, gw: Proc, url: str, admin: str, args: argparse.Namespace, attack: Any
) -> dict[str, Any]:
    bystander = Bystander(url, admin, args.probe_every).start()
    attack_result = attack()
    bystander.stop()
    rss, fds = proc_status(gw.pid)
    return {
        "phase": name,
        "ttft": bystander.ttft_s,
        "long_ok": bystander.long_ok,
        "admin_p99": percentile(bystander.admin_s, 99),
        "rss": rss,
        "fds": fds,
        "states": sorted(bystander.states),
        "failures": bystander.failures[:5],
        "attack": attack_result,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd")
    f = sub.add_parser("flood", help="(internal) the connection flooder")
    f.add_argument("--port", type=int, required=True)
    f.add_argument("--connections", type=int, required=True)
    f.add_argument("--seconds", type=float, required=True)
    f.add_argument("--reopen-max", type=int, required=True)
    f.add_argument("--out", required=True)
    parser.add_argument("--connections", type=int, default=10_000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--reopen-max", type=int, default=50_000)
    parser.add_argument("--probe-every", type=float, default=0.25)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--prompt-flood", action="store_true")
    parser.add_argument("--prompt-mb", type=float, default=3.8)
    parser.add_argument("--prompt-loops", type=int, default=2)
    args = parser.parse_args()
    if args.cmd == "flood":
        return flood_main(args)

    print(machine_context())
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        workdir = Path(tmp)
        sims, gw, admin = start_fleet(workdir, args.replicas)
        url = f"http://127.0.0.1:{gw.port}"
        results: list[dict[str, Any]] = []
        try:
            start_rss, start_fds = proc_status(gw.pid)

            def idle() -> dict[str, int]:
                time.sleep(args.seconds)
                return {}

            def connections() -> dict[str, int]:
                out = workdir / "flood.json"
                argv = [sys.executable, __file__, "flood", "--port", str(gw.port),
                        "--connections", str(args.connections), "--seconds", str(args.seconds),
                        "--reopen-max", str(args.reopen_max), "--out", str(out)]  # fmt: skip
                subprocess.run(argv, check=True, timeout=args.seconds + 120)
                stats: dict[str, int] = json.loads(out.read_text())
                return stats

            def prompts() -> dict[str, int]:
                return prompt_flood(url, args.prompt_mb, args.prompt_loops, args.seconds)

            results.append(run_phase("baseline", gw, url, admin, args, idle))
            results.append(run_phase("connections", gw, url, admin, args, connections))
            if args.prompt_flood:
                results.append(run_phase("prompts", gw, url, admin, args, prompts))
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proc_status(gw.pid)[1] > start_fds + 8:
                time.sleep(0.25)
            end_rss, end_fds = proc_status(gw.pid)
        finally:
            gw.stop()
            for sim in sims:
                sim.stop()

    base = results[0]
    base_p99 = percentile(base["ttft"], 99)
    rows = []
    for r in results:
        p99 = percentile(r["ttft"], 99)
        rows.append([
            r["phase"], len(r["ttft"]), percentile(r["ttft"], 50) * 1000, p99 * 1000,
            p99 / base_p99 if base_p99 else float("nan"), r["long_ok"], r["admin_p99"] * 1000,
            r["rss"], r["fds"], ",".join(r["states"]),
        ])  # fmt: skip
    print()
    print_table(
        ["phase", "probes", "ttft p50 ms", "ttft p99 ms", "p99 x base", "long ok",
         "admin p99 ms", "rss MiB", "fds", "replica states"],
        rows,
    )  # fmt: skip
    print(f"\ngateway at start: rss {start_rss:.1f} MiB, {start_fds} fds; after the floods: "
          f"rss {end_rss:.1f} MiB ({end_rss / start_rss:.2f}x), {end_fds} fds")  # fmt: skip
    for r in results[1:]:
        print(f"{r['phase']}: {r['attack']}")
        if r["failures"]:
            print(f"  bystander failures: {r['failures']}")
    worst = max(percentile(r["ttft"], 99) for r in results[1:]) / base_p99
    failed = any("failed" in s or "restarting" in s for r in results for s in r["states"])
    print("\ngoals: bystander TTFT p99 within 2x: "
          f"{'PASS' if worst <= 2 else 'MISS'} ({worst:.2f}x); no replica failed: "
          f"{'PASS' if not failed else 'MISS'}; RSS back within 10%: "
          f"{'PASS' if end_rss <= start_rss * 1.10 else 'MISS'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
