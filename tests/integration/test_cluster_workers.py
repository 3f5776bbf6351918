"""`seawall serve --workers 2`: two gateway processes on one port, one fleet, over real
`seawall sim` replicas on loopback (and, for the last test, a real redis-server).

What a user of workers must be able to count on:
- both workers take connections on the one port, exactly one leads, and the replicas are
  probed and scraped once for the host, as by one process, not once per worker;
- one admin API: an operator's drain sent to it changes routing in every worker;
- a worker that dies is started again, a new leader takes over within the fail-over
  bound, and the streams on the other worker complete;
- SIGTERM drains every worker (streams in flight finish, new requests get 503) and the
  parent exits 0 with no worker left;
- with `cluster.store: redis`, the workers are instances of the Redis fleet like any
  other (the parent hosts no store of its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from seawall.auth import hash_key
from seawall.config import ClusterConfig
from seawall.policy.leadership import failover_bound_s
from tests.support.cluster import (
    ADMIN_TOKEN,
    AUTH,
    FAST_FLEET,
    ReservationSampler,
    granted_everywhere,
    stream_events,
)
from tests.support.counting_proxy import CountingProxy, counting_proxy
from tests.support.fleet import MODEL, metric_sum, scrape, start_sim, wait_until
from tests.support.procs import Proc, bound_port, seawall_argv, spawn, wait_http
from tests.support.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_WORKER = re.compile(
    r"worker (\d+) \((\S+), pid (\d+)\) listening, admin API on (http://127\.0\.0\.1:\d+)"
)


def _config(replica_urls: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "replicas": [
            {"url": u, "id": f"r{i}", "model": MODEL, "node": f"node-{i}"}
            for i, u in enumerate(replica_urls)
        ],
        "admin": {"enabled": True, "port": 0, "token_hash": hash_key(ADMIN_TOKEN)},
        "fleet": dict(FAST_FLEET),
        **extra,
    }


class Served:
    """A `seawall serve` process (with `--workers N`, the parent) and its addresses."""

    def __init__(self, artifacts: Path, name: str, config: dict[str, Any], *args: str) -> None:
        path = artifacts / f"{name}.yaml"
        path.write_text(yaml.safe_dump(config))
        self.proc: Proc = spawn(
            seawall_argv("serve", "--config", str(path), "--no-access-log", *args),
            artifacts / f"{name}.log",
        )
        try:
            self.admin_port = bound_port(self.proc, b"seawall admin API listening", timeout=60)
            bound_port(self.proc, b"seawall gateway listening", timeout=60)
            wait_http(f"{self.url}/healthz", timeout=30, proc=self.proc)
        except BaseException:
            self.proc.stop()
            raise

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def workers(self) -> dict[int, dict[str, Any]]:
        """Each worker slot's latest process, from the parent's log."""
        out: dict[int, dict[str, Any]] = {}
        for m in _WORKER.finditer(self.proc.log()):
            index = int(m.group(1))
            out[index] = {
                "index": index,
                "instance": m.group(2),
                "pid": int(m.group(3)),
                "admin": m.group(4),
            }
        return out

    def cluster(self) -> dict[str, Any]:
        """/readyz's cluster detail from whichever worker takes a new connection."""
        with httpx.Client() as fresh:
            out: dict[str, Any] = fresh.get(f"{self.url}/readyz", timeout=5).json()["cluster"]
        return out

    def seen_instances(self, tries: int = 40) -> Counter[str]:
        """Which workers answered `tries` requests, each on a new connection."""
        return Counter(self.cluster()["instance"] for _ in range(tries))


def worker_state(worker: dict[str, Any]) -> dict[str, Any]:
    r = httpx.get(f"{worker['admin']}/admin/state", headers=AUTH, timeout=5)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def routable(worker: dict[str, Any]) -> dict[str, bool]:
    return {r["id"]: r["routable"] for r in worker_state(worker)["replicas"]}


def wait_for_one_leader(served: Served, count: int, timeout: float = 20) -> dict[str, Any]:
    """Until every worker is up, agrees on one leader among them, and counts `count`
    instances; returns the leader's slot."""

    def agreed() -> dict[str, Any] | None:
        workers = served.workers()
        if len(workers) < 2:
            return None
        try:
            views = [worker_state(w)["cluster"] for w in workers.values()]
        except httpx.HTTPError:
            return None
        leaders = {v["leader"] for v in views}
        if len(leaders) != 1 or any(v["instances"] != count for v in views):
            return None
        [leader] = leaders
        return next((w for w in workers.values() if w["instance"] == leader), None)

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = agreed()
        if found is not None:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no agreed leader among the workers:\n{served.proc.log()[-3000:]}")


@pytest.fixture
def sims(artifacts: Path) -> Iterator[list[Proc]]:
    started = [start_sim(artifacts, name=f"sim{i}") for i in range(2)]
    try:
        yield started
    finally:
        for s in started:
            s.stop()


def _rates(proxies: list[CountingProxy], seconds: float) -> list[dict[str, float]]:
    before = [p.counts() for p in proxies]
    time.sleep(seconds)  # a measurement window, not a wait for a condition
    out = []
    for p, b in zip(proxies, before, strict=True):
        delta = p.counts() - b
        out.append(
            {
                "deep": delta[("POST", "/v1/completions")] / seconds,
                "scrape": delta[("GET", "/metrics")] / seconds,
                "liveness": delta[("GET", "/health")] / seconds,
            }
        )
    return out


def _complete(url: str) -> int:
    with httpx.Client() as fresh:  # a new connection: the kernel picks the worker
        body = {"model": MODEL, "prompt": "A seawall is", "max_tokens": 4}
        return fresh.post(f"{url}/v1/completions", json=body, timeout=30).status_code


def _finished(result: dict[str, Any], tokens: int) -> None:
    assert result["status"] == 200, result
    assert result["events"][-1] == "[DONE]", result["events"][-3:]
    chunks = [json.loads(e) for e in result["events"][:-1]]
    assert not any("error" in c for c in chunks), result["events"][-3:]
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) >= tokens - 10


# --------------------------------------------------------------- one fleet, one port


def test_two_workers_share_the_port_probe_once_and_obey_one_admin_api(
    artifacts: Path, sims: list[Proc]
) -> None:
    with counting_proxy(sims[0].port or 0) as p0, counting_proxy(sims[1].port or 0) as p1:
        proxies = [p0, p1]
        config = _config([f"http://127.0.0.1:{p.port}" for p in proxies])
        # The reference: one process, as `seawall serve` runs without --workers.
        single = Served(artifacts, "single", config)
        wait_http(f"{single.url}/readyz?fleet=1", timeout=20, proc=single.proc)
        one = _rates(proxies, 5.0)
        single.proc.stop()

        served = Served(artifacts, "workers", config, "--workers", "2")
        leader = wait_for_one_leader(served, count=2)
        for w in served.workers().values():
            wait_until(lambda w=w: all(routable(w).values()), 15, what="both replicas routable")
        two = _rates(proxies, 5.0)

        # Both processes take connections on the one port.
        seen = served.seen_instances()
        assert set(seen) == {w["instance"] for w in served.workers().values()}, seen
        for _ in range(6):
            assert _complete(served.url) == 200

        # The one admin API is the leader's, and a drain there holds r0 out everywhere.
        state = httpx.get(f"{served.admin}/admin/state", headers=AUTH, timeout=5).json()
        assert state["cluster"]["instance"] == leader["instance"]
        assert state["cluster"]["leader_admin_url"] == served.admin  # advertised: the parent
        drained = httpx.post(f"{served.admin}/admin/replicas/r0/drain", headers=AUTH, timeout=10)
        assert drained.status_code == 200, drained.text
        for w in served.workers().values():
            wait_until(lambda w=w: not routable(w)["r0"], 5, what=f"r0 out on {w['instance']}")
        follower = next(w for w in served.workers().values() if w["instance"] != leader["instance"])
        # A lever sent to a follower's own admin API is carried out by the leader.
        back = httpx.post(
            f"{follower['admin']}/admin/replicas/r0/undrain", headers=AUTH, timeout=10
        )
        assert back.status_code == 200 and back.headers["X-Seawall-Leader"] == leader["instance"]
        for w in served.workers().values():
            wait_until(lambda w=w: routable(w)["r0"], 5, what=f"r0 back on {w['instance']}")
        refused = httpx.post(f"{served.admin}/admin/replicas/r0/drain", timeout=10)
        assert refused.status_code == 401  # the workers check the credential, not the relay

    print(f"\nper replica per second, 1 process: {one}\n2 workers: {two}")
    # One monitor's worth: the single process's measured rate, or the configured one where
    # that is higher (under CI's parallel load the reference process once probed 2.8 scrapes
    # a second against the 4 its interval asks for, and the workers' 4.0 read as doubled).
    # Two monitors would probe twice the configured rate.
    configured = {
        "deep": 1 / FAST_FLEET["deep_probe_idle_interval_s"],
        "scrape": 1 / FAST_FLEET["scrape_interval_s"],
        "liveness": 1 / FAST_FLEET["liveness_interval_s"],
    }
    for r1, r2 in zip(one, two, strict=True):
        for kind in ("deep", "scrape", "liveness"):
            assert r1[kind] > 0, (kind, r1)
            assert r2[kind] <= 1.35 * max(r1[kind], configured[kind]), (kind, r1, r2)


# ----------------------------------------------------- a worker dies; SIGTERM drains


def test_a_dead_worker_is_replaced_and_sigterm_drains_every_worker(
    artifacts: Path, sims: list[Proc]
) -> None:
    cc = ClusterConfig()
    bound_s = failover_bound_s(cc.lease_ttl_s, cc.renew_interval_s)
    served = Served(artifacts, "workers", _config([s.url for s in sims]), "--workers", "2")
    leader = wait_for_one_leader(served, count=2)
    survivor = next(w for w in served.workers().values() if w["instance"] != leader["instance"])
    wait_until(lambda: all(routable(survivor).values()), 15, what="routable on the survivor")
    for worker in served.workers().values():
        wait_until(
            lambda w=worker: granted_everywhere(worker_state(w)), 15, what="the leader's split"
        )

    # Streams through the survivor (its own admin port is not the client port, so go
    # through the shared port and keep the ones the survivor took). The kernel spreads
    # connections over the workers at random: once in CI none of six reached the
    # survivor (all six on the leader is a 1-in-64 draw), so more are sent until the
    # survivor has one, at most 24.
    results: list[dict[str, Any]] = []
    threads: list[threading.Thread] = []

    def inflight(worker: dict[str, Any]) -> int:
        return sum(r["inflight"] for r in worker_state(worker)["replicas"])

    while len(threads) < 24:
        batch = [
            threading.Thread(target=stream_events, args=(served.url, 400, results))
            for _ in range(6)
        ]
        for t in batch:
            t.start()
        threads += batch
        sent = len(threads)
        with contextlib.suppress(AssertionError):  # all on the leader: another batch
            wait_until(lambda n=sent: inflight(survivor) >= 1 or inflight(leader) >= n, 10)
        if inflight(survivor):
            break
    wait_until(lambda: inflight(survivor) >= 1, 10, what="streams in flight on the survivor")
    on_survivor = inflight(survivor)
    killed_at = time.monotonic()
    os.kill(leader["pid"], signal.SIGKILL)
    # As the survivor sees it: another instance leads (the survivor, or the replacement
    # if it came up in time to win the election).
    wait_until(
        lambda: worker_state(survivor)["cluster"]["leader"] not in (None, leader["instance"]),
        bound_s + 10,
        what="a new leader",
    )
    took_s = time.monotonic() - killed_at
    new = wait_for_one_leader(served, count=2, timeout=20)
    print(f"\nnew leader {new['instance']} after {took_s:.2f} s (bound {bound_s:g} s)")
    for t in threads:
        t.join(60)
    # The slot was filled again, by a new instance (the dead one's name is not reused).
    replacement = served.workers()[leader["index"]]
    assert replacement["pid"] != leader["pid"]
    assert replacement["instance"] != leader["instance"]
    assert "exited with code -9" in served.proc.log()
    assert took_s <= bound_s + 0.5, took_s  # + this test's polling
    # The streams the survivor carried finished; those the killed worker carried were cut
    # with it (a process killed outright cannot drain).
    done = [r for r in results if r["events"] and r["events"][-1] == "[DONE]"]
    assert len(done) >= on_survivor
    for r in done:
        _finished(r, 400)

    # SIGTERM: every worker drains. A stream in flight finishes; a new request is refused.
    wait_until(lambda: _complete(served.url) == 200, 10, what="serving again")
    late: list[dict[str, Any]] = []
    streaming = [
        threading.Thread(target=stream_events, args=(served.url, 300, late)) for _ in range(4)
    ]
    for t in streaming:
        t.start()
    wait_until(
        lambda: (
            sum(
                r["inflight"]
                for w in served.workers().values()
                for r in worker_state(w)["replicas"]
            )
            >= 4
        ),
        10,
        what="four streams in flight",
    )
    pids = [w["pid"] for w in served.workers().values()]
    served.proc.signal(signal.SIGTERM)
    wait_until(lambda: _complete(served.url) == 503, 5, what="new requests refused while draining")
    for t in streaming:
        t.join(60)
    assert served.proc.wait(60) == 0, served.proc.log()[-3000:]
    assert len(late) == 4
    for r in late:
        _finished(r, 300)
    assert [pid for pid in pids if _running(pid)] == []


# ------------------------------------------------------------------ workers over Redis


def test_with_redis_the_workers_join_the_fleet_of_other_instances(
    artifacts: Path, sims: list[Proc], redis_server: RedisServer
) -> None:
    cluster = {"store": "redis", "redis_url": redis_server.url}
    other = Served(
        artifacts,
        "other",
        _config([s.url for s in sims], cluster={"instance_id": "other", **cluster}),
    )
    wait_until(lambda: other_role(other) == "leader", 15, what="the first instance to lead")
    served = Served(
        artifacts, "workers", _config([s.url for s in sims], cluster=cluster), "--workers", "2"
    )
    # Three instances, one fleet: the other instance still leads; the workers follow it.
    for w in _two_workers(served):
        wait_until(
            lambda w=w: (
                worker_state(w)["cluster"]["instances"] == 3
                and worker_state(w)["cluster"]["leader"] == "other"
            ),
            15,
            what=f"{w['instance']} in the fleet of three",
        )
        wait_until(lambda w=w: all(routable(w).values()), 15, what="routable")
    assert "share the cluster's Redis" in served.proc.log()
    assert not re.search(r"seawall-workers-\w+/cluster\.sock", served.proc.log())
    # A lever sent to this host's admin API goes to the leader elsewhere.
    drained = httpx.post(f"{served.admin}/admin/replicas/r1/drain", headers=AUTH, timeout=10)
    assert drained.status_code == 200 and drained.headers["X-Seawall-Leader"] == "other"
    for w in _two_workers(served):
        wait_until(lambda w=w: not routable(w)["r1"], 5, what="r1 out on the workers")
    for _ in range(6):
        assert _complete(served.url) == 200


def _running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def other_role(other: Served) -> str:
    role: str = other.cluster()["role"]
    return role


def _two_workers(served: Served) -> list[dict[str, Any]]:
    wait_until(lambda: len(served.workers()) == 2, 30, what="two workers")
    return list(served.workers().values())


# ------------------------------------------------------------------- admission, 3x


# 160 blocks of 16 tokens (one is vLLM's null block): 159 hold tokens. A full-length
# request (4-token prompt, 190 out) takes 13 blocks: 12 fit a replica, 24 the fleet, and
# 72 closed-loop clients are 3x its capacity (as in test_cluster_admission.py).
SMALL_KV = ("--kv-blocks", "160", "--max-model-len", "2048")
CACHE_BLOCKS = 159
OVERLOAD_S = 12.0


def test_two_workers_at_3x_overload_never_reserve_more_than_a_cache_and_never_preempt(
    artifacts: Path,
) -> None:
    """Each worker admits within the grant the leader worker gives it: together they
    never reserve more than a replica's cache, so no engine preempts (before: each worker
    reserved against the whole cache, as two gateways did, and the engines preempted)."""
    small = [start_sim(artifacts, *SMALL_KV, name=f"small{i}") for i in range(2)]
    try:
        config = _config(
            [s.url for s in small],
            admission={"mode": "reserve"},
            timeouts={"ttft_s": 30.0, "total_s": 60.0},
        )
        served = Served(artifacts, "workers", config, "--workers", "2")
        wait_for_one_leader(served, count=2)
        workers = _two_workers(served)
        for w in workers:
            wait_until(lambda w=w: all(routable(w).values()), 15, what="both replicas routable")
        before = sum(metric_sum(scrape(s.url), "vllm:num_preemptions_total") for s in small)
        body = {"model": MODEL, "prompt": "A seawall is", "max_tokens": 190, "ignore_eos": True}
        flood = subprocess.Popen(
            [
                sys.executable, "-m", "tests.support.flood", f"{served.url}/v1/completions",
                "none", str(OVERLOAD_S), "72", json.dumps(body),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        with ReservationSampler([w["admin"] for w in workers]) as sampler:
            flood.wait(timeout=OVERLOAD_S + 60)
        worst, samples = sampler.worst(), len(sampler.samples)
        stdout, stderr = flood.communicate(timeout=60)
        assert flood.returncode == 0, stderr
        counts = json.loads(stdout.strip().splitlines()[-1])
        preempted = (
            sum(metric_sum(scrape(s.url), "vllm:num_preemptions_total") for s in small) - before
        )
        print(f"\nflood {counts}, preempted {preempted}, most reserved {worst}")
        assert samples > 20
        assert preempted == 0
        assert worst and all(blocks <= CACHE_BLOCKS for blocks in worst.values()), worst
        # Most of the capacity is served (12 a second: 24 at a time, ~2 s each), and
        # everything else is a 429.
        assert counts.get("200", 0) > 0.5 * 12 * OVERLOAD_S, counts
        assert set(counts) <= {"200", "429"}, counts
        served.proc.stop()
    finally:
        for s in small:
            s.stop()
