"""What exact admission across gateway instances costs on the request path: leader-issued
quotas (what Seawall does) against shared reservations in Redis (the alternative).

    .venv/bin/python bench/bench_quota.py [--calls 20000] [--redis-calls 2000] [--json]

- **quotas**: per request, fleet admission judges each candidate replica against this
  instance's grant (`ReplicaSet.candidates`, as `FleetAdmission.admit` and routing call
  it). Measured in-process: CPU per call with two replicas, alone (no grants) and with
  grants, in `admission.mode: reserve` and `adaptive`. Nothing waits: no added TTFT.
- **shared reservations**: per request, one atomic check-and-reserve on a shared counter
  (a Lua script over one key per replica, as `state/limits_redis.py` does for limits)
  before the first byte is sent, and one release after the last: two round trips to a
  real redis-server on loopback, through redis-py's asyncio client as the gateway would
  use it. Measured: wall time per reserve (what every first token waits for) and client
  CPU per request (reserve + release).

`measure()` returns the figures as a dict (bench/bench_cluster.py prints them beside
its fleet figures); run as a script it prints them as a table. Figures from a loaded
machine say little: publish only a quiet machine's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import REPO, free_port, percentile

sys.path.insert(0, str(REPO / "src"))

from seawall.config import AdmissionConfig
from seawall.fleet.view import EngineLoad, FleetSnapshot, ReplicaView
from seawall.gateway.fleet_admission import FleetAdmission
from seawall.gateway.fleet_quota import Grants
from seawall.gateway.inflight import InFlight
from seawall.gateway.replicas import Replica, ReplicaSet
from seawall.metrics import Metrics

MODEL = "bench-model"
CAPACITY_BLOCKS = 159
NEED_TOKENS = 200  # 13 blocks


def _fleet(mode: str, grants: bool) -> tuple[ReplicaSet, FleetAdmission]:
    ledger = InFlight()
    replicas = ReplicaSet(ledger, random.Random(1))
    now = time.monotonic()
    views = {}
    for i in range(2):
        rid = f"r{i}"
        replicas.add(Replica(rid, f"http://127.0.0.1:{9000 + i}", MODEL, f"node-{i}"))
        load = EngineLoad(
            running=4,
            waiting=0,
            kv_usage=0.3,
            preemptions_total=0,
            generation_tokens_total=1000,
            kv_capacity_tokens=CAPACITY_BLOCKS * 16,
            kv_block_size=16,
            scraped_at=now + 3600,  # fresh for the whole run
        )
        views[rid] = ReplicaView(rid, "", MODEL, f"node-{i}", routable=True, load=load)
        for _ in range(3):
            ledger.hold(rid, 13)
    snap = FleetSnapshot(views, now)
    replicas.snapshot = lambda: snap
    admission = FleetAdmission(AdmissionConfig.model_validate({"mode": mode}), replicas, Metrics())
    if grants:
        entry = {f"r{i}": {"kv_blocks": [53, CAPACITY_BLOCKS, 53]} for i in range(2)}
        admission.use_grants(Grants(lambda: entry))
    return replicas, admission


def quota_cpu_ns(calls: int) -> dict[str, float]:
    """CPU per `candidates` call (two replicas), in ns, per mode, alone and with grants."""
    out: dict[str, float] = {}
    for mode in ("reserve", "adaptive"):
        for grants in (False, True):
            replicas, _ = _fleet(mode, grants)
            now = time.monotonic()
            for _ in range(min(calls, 1000)):  # warm
                replicas.candidates(MODEL, now, need_tokens=NEED_TOKENS)
            start = time.process_time_ns()
            for _ in range(calls):
                replicas.candidates(MODEL, now, need_tokens=NEED_TOKENS)
            out[f"{mode}/{'grants' if grants else 'alone'}"] = (
                time.process_time_ns() - start
            ) / calls
    return out


_RESERVE_LUA = """
local held = tonumber(redis.call('GET', KEYS[1]) or '0')
local want = tonumber(ARGV[1])
if held + want > tonumber(ARGV[2]) then return 0 end
redis.call('INCRBY', KEYS[1], want)
return 1
"""
_RELEASE_LUA = "return redis.call('DECRBY', KEYS[1], ARGV[1])"


async def _shared(url: str, calls: int) -> dict[str, float]:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, socket_timeout=1.0)
    reserve = client.register_script(_RESERVE_LUA)
    release = client.register_script(_RELEASE_LUA)
    key = ["bench:reserved:r0"]
    try:
        for _ in range(200):  # warm: the connection and the scripts' SHA
            await reserve(keys=key, args=[13, 10**9])
            await release(keys=key, args=[13])
        walls: list[float] = []
        cpu0 = time.process_time_ns()
        for _ in range(calls):
            t0 = time.perf_counter()
            await reserve(keys=key, args=[13, 10**9])
            walls.append(time.perf_counter() - t0)
            await release(keys=key, args=[13])
        cpu_ns = (time.process_time_ns() - cpu0) / calls
    finally:
        await client.aclose()
    return {
        "reserve_wall_p50_us": percentile(walls, 50) * 1e6,
        "reserve_wall_p99_us": percentile(walls, 99) * 1e6,
        "client_cpu_per_request_us": cpu_ns / 1000,
    }


def shared_reservation_cost(calls: int) -> dict[str, float] | None:
    """Against a redis-server of its own on loopback (None when there is none)."""
    binary = shutil.which("redis-server")
    if binary is None:
        return None
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        import redis

        probe = redis.Redis(host="127.0.0.1", port=port, socket_timeout=0.5)
        for _ in range(100):  # bounded: 100 x 50 ms
            try:
                if probe.ping():
                    break
            except redis.exceptions.ConnectionError:
                time.sleep(0.05)
        probe.close()
        return asyncio.run(_shared(f"redis://127.0.0.1:{port}/0", calls))
    finally:
        proc.terminate()
        proc.wait(10)


def measure(calls: int = 20_000, redis_calls: int = 2_000) -> dict[str, Any]:
    """Both ideas' request-path cost (see the module docstring)."""
    quotas = quota_cpu_ns(calls)
    shared = shared_reservation_cost(redis_calls)
    return {
        "quotas": {
            "candidates_cpu_ns": quotas,
            "added_cpu_per_request_us": {
                mode: (quotas[f"{mode}/grants"] - quotas[f"{mode}/alone"]) / 1000
                for mode in ("reserve", "adaptive")
            },
            "added_ttft_us": 0.0,  # nothing waits: the grant is an attribute read
        },
        "shared_reservations": shared,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--redis-calls", type=int, default=2_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    figures = measure(args.calls, args.redis_calls)
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    q = figures["quotas"]
    print("request-path cost of exact admission across instances (two replicas)")
    print(f"{'':34} {'alone':>10} {'with grants':>12} {'added':>10}")
    for mode in ("reserve", "adaptive"):
        alone, granted = (
            q["candidates_cpu_ns"][f"{mode}/alone"],
            q["candidates_cpu_ns"][f"{mode}/grants"],
        )
        print(
            f"quotas, {mode:8} CPU per admission  {alone / 1000:8.2f}us {granted / 1000:10.2f}us "
            f"{(granted - alone) / 1000:8.2f}us"
        )
    print("quotas: added TTFT 0 (no wait on the request path)")
    s = figures["shared_reservations"]
    if s is None:
        print("shared reservations: no redis-server here")
    else:
        print(
            f"shared reservations (Redis, loopback): reserve p50 {s['reserve_wall_p50_us']:.0f}us "
            f"p99 {s['reserve_wall_p99_us']:.0f}us added to every TTFT; client CPU "
            f"{s['client_cpu_per_request_us']:.0f}us per request (reserve + release)"
        )


if __name__ == "__main__":
    main()
