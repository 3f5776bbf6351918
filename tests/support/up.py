"""`seawall up` as a real process for tests: sim replicas under the local supervisor and
the gateway in-process with the admin API, so the fleet monitor acts on real processes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import yaml

from seawall.actuate.local import DEFAULT_COMMAND
from seawall.auth import hash_key
from tests.support.fleet import MODEL, wait_until
from tests.support.procs import Proc, free_port, seawall_argv, spawn, wait_http

TOKEN = "sk-sw-admin-up-tests-000000000000000000000000000"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def sim_command(*extra: str) -> list[str]:
    """The supervisor's default replica command, with faults on and a quick step."""
    return [*DEFAULT_COMMAND, "--enable-faults", "--step-base-ms", "5", *extra]


class Up:
    def __init__(self, proc: Proc, api: str, admin: str) -> None:
        self.proc, self.api, self.admin = proc, api, admin

    def state(self) -> dict[str, Any]:
        r = httpx.get(self.admin + "/admin/state", headers=AUTH, timeout=10)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def replica(self, rid: str) -> dict[str, Any]:
        return next(r for r in self.state()["replicas"] if r["id"] == rid)

    def routable(self) -> list[str]:
        return sorted(r["id"] for r in self.state()["replicas"] if r["routable"])


def start_up(
    artifacts: Path,
    replicas: int = 3,
    gateway: dict[str, Any] | None = None,
    fleet: dict[str, Any] | None = None,
) -> Up:
    """Start `seawall up`; the caller stops `.proc` (e.g. `with running(handle.proc)`)."""
    api_port, admin_port = free_port(), free_port()
    cfg = {
        "fleet": {
            "replicas": replicas,
            "model": MODEL,
            "command": sim_command(),
            "stop_grace_s": 5,
        },
        "gateway": {
            "admin": {"enabled": True, "port": admin_port, "token_hash": hash_key(TOKEN)},
            "fleet": {
                "liveness_interval_s": 0.25,
                "scrape_interval_s": 0.25,
                "deep_probe_interval_s": 1.0,
                "deep_probe_idle_interval_s": 1.0,
                **(fleet or {}),
            },
            "drain": {"timeout_s": 20},
            **(gateway or {}),
        },
    }
    path = artifacts / "up.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = spawn(
        seawall_argv(
            "up",
            "--config",
            str(path),
            "--gateway-port",
            str(api_port),
            "--plain",
            "--seconds",
            "170",
            "--log-dir",
            str(artifacts / "up"),
        ),
        artifacts / "up.log",
        port=api_port,
    )
    handle = Up(proc, f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{admin_port}")
    try:
        wait_http(handle.api + "/readyz?fleet=1", timeout=60, proc=proc)
        wait_until(lambda: len(handle.routable()) == replicas, 30, what="routable replicas")
    except BaseException:
        proc.stop()
        raise
    return handle
