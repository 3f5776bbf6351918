"""Several `seawall serve` instances over the same replicas, sharing one cluster store.

`Instance` is one gateway process with its admin API, started from a config built here
(`cluster:` pointing at the test's redis-server); `start_instances` starts several at
once (in parallel: each takes a second or two to import) and waits for all of them.
`leader_of` and `wait_for_leader` ask the instances themselves, through their
`/readyz` detail, who leads.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from seawall.auth import hash_key
from tests.support.fleet import MODEL
from tests.support.procs import Proc, bound_port, seawall_argv, spawn, wait_http

ADMIN_TOKEN = "sk-sw-admin-cluster-tests-000000000000000000000"
AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}

# Probing fast enough for a test to see a hang within a few seconds. The cluster's own
# timings stay at their defaults unless a test says otherwise: the fail-over bound the
# tests check is the one the defaults promise.
FAST_FLEET: dict[str, Any] = {
    "liveness_interval_s": 0.2,
    "scrape_interval_s": 0.25,
    "deep_probe_interval_s": 0.4,
    "deep_probe_idle_interval_s": 0.4,
    "deep_probe_timeout_s": 1.0,
    "deep_probe_failures_threshold": 2,
}


class Instance:
    """One `seawall serve` instance (not yet waited for: see `wait`)."""

    def __init__(
        self,
        artifacts: Path,
        name: str,
        replicas: Sequence[dict[str, Any]],
        cluster: dict[str, Any],
        fleet: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        config: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "replicas": list(replicas),
            "admin": {"enabled": True, "port": 0, "token_hash": hash_key(ADMIN_TOKEN)},
            "fleet": {**FAST_FLEET, **(fleet or {})},
            "cluster": {"instance_id": name, **cluster},
            **(extra or {}),
        }
        self.config_path = artifacts / f"{name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.proc: Proc = spawn(
            seawall_argv("serve", "--config", str(self.config_path)),
            artifacts / f"{name}.log",
            env=env,
        )
        self.admin_port = 0

    def wait(self) -> Instance:
        try:
            self.admin_port = bound_port(self.proc, b"seawall admin API listening")
            bound_port(self.proc, b"seawall gateway listening")
            wait_http(f"{self.proc.url}/healthz", timeout=30, proc=self.proc)
        except BaseException:
            self.proc.stop()
            raise
        return self

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def admin(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def readyz(self) -> dict[str, Any]:
        r = httpx.get(f"{self.url}/readyz", timeout=5)
        out: dict[str, Any] = r.json()
        out["http_status"] = r.status_code
        return out

    def cluster(self) -> dict[str, Any]:
        out: dict[str, Any] = self.readyz()["cluster"]
        return out

    def state(self) -> dict[str, Any]:
        r = httpx.get(f"{self.admin}/admin/state", headers=AUTH, timeout=5)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def replica(self, rid: str) -> dict[str, Any]:
        return next(r for r in self.state()["replicas"] if r["id"] == rid)

    def complete(self, max_tokens: int = 4, timeout: float = 30) -> httpx.Response:
        return httpx.post(
            f"{self.url}/v1/completions",
            json={"model": MODEL, "prompt": "A seawall is", "max_tokens": max_tokens},
            timeout=timeout,
        )


def start_instances(
    artifacts: Path,
    names: Sequence[str],
    replicas: Sequence[dict[str, Any]],
    cluster: dict[str, Any],
    **kwargs: Any,
) -> list[Instance]:
    started = [Instance(artifacts, n, replicas, cluster, **kwargs) for n in names]
    return [i.wait() for i in started]


def granted_everywhere(state: dict[str, Any]) -> bool:
    """Whether the instance whose admin `state` this is holds a grant of KV on every
    replica (the leader's split). Before that its requests wait for one: a leader killed
    before the split converged, or a test that starts its streams too soon, sees them
    queue (README, "What stays exact with several instances")."""
    quota = state["cluster"]["quota"]
    grants = [r["grant"] for r in quota["replicas"].values()]
    return bool(grants) and all(
        g and g["kv_blocks"] and g["kv_blocks"]["grant"] > 0 for g in grants
    )


def redis_cluster(url: str, **overrides: Any) -> dict[str, Any]:
    return {"store": "redis", "redis_url": url, **overrides}


def leader_of(instances: Sequence[Instance]) -> Instance | None:
    """The one instance that says it leads, if exactly one does."""
    leading = [i for i in instances if i.proc.alive() and i.cluster()["role"] == "leader"]
    return leading[0] if len(leading) == 1 else None


def wait_for_leader(instances: Sequence[Instance], timeout: float = 20) -> Instance:
    """Until exactly one instance leads and every live one agrees who."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        live = [i for i in instances if i.proc.alive()]
        try:
            views = {i.name: i.cluster() for i in live}
        except httpx.HTTPError as e:
            last = e
        else:
            last = views
            leaders = [n for n, v in views.items() if v["role"] == "leader"]
            if len(leaders) == 1 and all(v["leader"] == leaders[0] for v in views.values()):
                return next(i for i in live if i.name == leaders[0])
        time.sleep(0.05)
    raise AssertionError(f"no single agreed leader after {timeout}s: {last}")


def stream_events(url: str, max_tokens: int, out: list[dict[str, Any]], via: str = "") -> None:
    """One streamed completion through `url` (a thread's target): appends its status and
    `data:` payloads (or the transport error) to `out`."""
    body = {
        "model": MODEL,
        "prompt": "A seawall is",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    status = 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
    except httpx.HTTPError as e:
        events.append(f"transport error: {e!r}")
    out.append({"via": via, "status": status, "events": events})


class ReservationSampler:
    """Reads every gateway's KV reservations per replica from their admin APIs, as close
    together as the calls allow, until stopped: the sum per replica is the fleet's
    reservation there."""

    def __init__(self, admin_urls: Sequence[str]) -> None:
        self.admin_urls = list(admin_urls)
        self.samples: list[dict[str, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def __enter__(self) -> ReservationSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def worst(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for sample in self.samples:
            for rid, blocks in sample.items():
                out[rid] = max(out.get(rid, 0), blocks)
        return out

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                total: dict[str, int] = {}
                for admin in self.admin_urls:
                    state = client.get(f"{admin}/admin/state", headers=AUTH).json()
                    for r in state["replicas"]:
                        total[r["id"]] = total.get(r["id"], 0) + int(r["reserved_kv_blocks"])
                self.samples.append(total)
                time.sleep(0.05)  # a sampling interval, not a wait for a condition
