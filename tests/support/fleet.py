"""Start `seawall sim` replicas and a `seawall serve` gateway as real processes on loopback."""

from __future__ import annotations

import http.client
import itertools
import json
import re
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import Proc, bound_port, free_port, seawall_argv, spawn, wait_http

MODEL = "sim-model"


_SEQ = itertools.count()


def start_sim(
    log_dir: Path,
    *extra: str,
    name: str = "sim",
    faults: bool = True,
    wait: bool = True,
    model: str = MODEL,
    port: int | None = None,
) -> Proc:
    """A `seawall sim` on loopback. It binds port 0 and reports the port it got, unless
    `port` is given, or `wait=False` (the caller needs the address before it is bound)."""
    if port is None and not wait:
        port = free_port()
    argv = seawall_argv(
        "sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port or 0),
        "--model",
        model,
        *(["--enable-faults"] if faults else []),
        *extra,
    )
    proc = spawn(argv, log_dir / f"{name}-{next(_SEQ)}.log", port=port)
    if wait:
        try:
            bound_port(proc, b"seawall sim: serving")
            wait_http(f"{proc.url}/health", timeout=20, proc=proc)
        except BaseException:
            proc.stop()
            raise
    return proc


def start_gateway(
    log_dir: Path,
    replicas: Sequence[Proc | str],
    config: dict[str, Any] | None = None,
    wait_ready: bool = True,
    name: str = "gateway",
    args: Sequence[str] = (),
    env: dict[str, str] | None = None,
) -> Proc:
    seq = next(_SEQ)
    cfg: dict[str, Any] = {"listen": {"host": "127.0.0.1", "port": 0}, **(config or {})}
    cfg["replicas"] = [
        {
            "url": r if isinstance(r, str) else r.url,
            "id": f"r{i}",
            "node": f"node-{i}",
            **({"model": MODEL} if not isinstance(r, str) else {}),
        }
        for i, r in enumerate(replicas)
    ] + list(cfg.get("replicas", []))
    # A copy: callers pass shared dicts, and the ledger path is this gateway's own.
    fleet = cfg["fleet"] = dict(cfg.get("fleet") or {})
    fleet.setdefault("ledger_path", str(log_dir / f"{name}-{seq}-ledger.sqlite"))
    path = log_dir / f"{name}-{seq}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = spawn(
        seawall_argv("serve", "--config", str(path), *args), log_dir / f"{name}-{seq}.log", env=env
    )
    proc.extra["config_path"] = path
    try:
        bound_port(proc, b"seawall gateway listening")
        wait_http(f"{proc.url}/healthz", timeout=20, proc=proc)
        if wait_ready:
            wait_http(f"{proc.url}/readyz?fleet=1", timeout=20, proc=proc)
    except BaseException:
        proc.stop()  # a gateway that did not come up is not left behind
        raise
    return proc


@contextmanager
def running(*procs: Proc) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            p.stop()


def set_fault(sim: Proc, fault: dict[str, Any]) -> None:
    req = urllib.request.Request(
        f"{sim.url}/sim/fault",
        data=json.dumps(fault).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status == 200, r.status
    except (ConnectionError, http.client.RemoteDisconnected):
        # An immediate crash may take the answer down with the process.
        if fault.get("kind") != "crash":
            raise


def scrape(url: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample of a /metrics endpoint (labels sorted)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metric_sum(samples: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def wait_until(predicate: Any, timeout: float, interval: float = 0.02, what: str = "") -> float:
    """Poll `predicate` until true; return seconds waited. Bounded: raises after `timeout`."""
    start = time.monotonic()
    while True:
        if predicate():
            return time.monotonic() - start
        if time.monotonic() - start > timeout:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(interval)


_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def normalise(body: bytes) -> bytes:
    """Blank out the fields that differ between two runs of one request (id, created)."""
    return _VOLATILE.sub(rb'"\1":"_"', body)
