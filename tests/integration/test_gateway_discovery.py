"""DNS discovery through a running gateway: replicas join and leave as a name's records do.

A headless Service answers its name with one A record per ready pod. Here the name is
`sims.demo.svc` (discovery asks for `service.namespace.svc`), answered by a hosts file
that the test bind-mounts over /etc/hosts for the gateway process alone, in a mount
namespace of its own (`unshare`): the gateway's real resolver (glibc, through
getaddrinfo) reads it on every lookup, so editing the file is a DNS change. The replicas
are `seawall sim` processes on the same port of two loopback addresses, as pods of one
Service are.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.fleet import MODEL, metric_sum, running, scrape, wait_until
from tests.support.procs import Proc, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration

NAME = "sims.demo.svc"
PUBLIC = "tide-7b"  # discovery's public name for the pods' `sim-model`


def _namespaced(hosts: Path) -> list[str]:
    """The argv prefix that runs a command with `hosts` as its /etc/hosts."""
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare (util-linux) is not installed")
    # As root a mount namespace is enough; otherwise a user namespace maps us to root in it.
    flags = ["--mount"] if os.geteuid() == 0 else ["--mount", "--map-root-user"]
    argv = [unshare, *flags, "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"', str(hosts)]
    probe = subprocess.run([*argv, "true"], capture_output=True, timeout=10)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a mount namespace here: {probe.stderr.decode().strip()}")
    return argv


def _sim(artifacts: Path, address: str, port: int) -> Proc:
    argv = seawall_argv("sim", "--host", address, "--port", str(port), "--model", MODEL)
    proc = spawn(argv, artifacts / f"sim-{address}.log", port=port)
    wait_http(f"http://{address}:{port}/health", timeout=20, proc=proc)
    return proc


def _served_by(url: str) -> float:
    return metric_sum(scrape(url), "vllm:request_success_total")


def test_replicas_follow_the_services_dns_records(artifacts: Path) -> None:
    hosts = artifacts / "hosts"
    hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {NAME}\n")
    prefix = _namespaced(hosts)
    port = free_port()
    a, b = _sim(artifacts, "127.0.0.1", port), _sim(artifacts, "127.0.0.2", port)
    a_url, b_url = f"http://127.0.0.1:{port}", f"http://127.0.0.2:{port}"
    gw_port = free_port()
    config = {
        "listen": {"host": "127.0.0.1", "port": gw_port},
        "fleet": {
            "ledger_path": str(artifacts / "ledger.sqlite"),
            "liveness_interval_s": 0.25,
            "scrape_interval_s": 0.25,
            "discovery": {
                "mode": "dns",
                "service": "sims",
                "namespace": "demo",
                "port": port,
                "interval_s": 0.25,
                # Clients ask for the public name; each pod is asked for its served one.
                "model_name": PUBLIC,
            },
        },
    }
    config_path = artifacts / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config))
    argv = [*prefix, *seawall_argv("serve", "--config", str(config_path))]
    gw = spawn(argv, artifacts / "gateway.log", port=gw_port)
    with running(gw, a, b), httpx.Client(timeout=30) as client:
        wait_http(f"{gw.url}/readyz?fleet=1", timeout=20, proc=gw)

        def send(n: int) -> None:
            for _ in range(n):
                r = client.post(
                    f"{gw.url}/v1/completions",
                    json={"model": PUBLIC, "prompt": "A seawall is", "max_tokens": 4},
                )
                assert r.status_code == 200, r.text
                assert r.json()["model"] == PUBLIC

        # One record: every request goes to the one pod behind the name.
        send(10)
        # (the fleet monitor's one-token deep probes count there too)
        assert _served_by(a_url) >= 10 and _served_by(b_url) == 0
        models = client.get(f"{gw.url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [PUBLIC]  # the replica's card, renamed

        # A second pod becomes ready: its record appears, and it gets a share of the work.
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {NAME}\n127.0.0.2 {NAME}\n")
        wait_until(
            lambda: (send(4), _served_by(b_url))[1] > 0,
            timeout=15,
            interval=0.1,
            what="the new replica to receive requests",
        )

        # The first pod goes away (its record first, as Kubernetes does): no new work for it.
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.2 {NAME}\n")
        wait_until(
            lambda: _quiet(client, gw.url, a_url),
            timeout=15,
            interval=0.2,
            what="the departed replica to leave routing",
        )
        before = _served_by(a_url)
        send(10)
        assert _served_by(a_url) == before


def _quiet(client: httpx.Client, gw_url: str, a_url: str) -> bool:
    """True once a batch of requests leaves the departed replica's count unchanged."""
    before = _served_by(a_url)
    for _ in range(6):
        r = client.post(
            f"{gw_url}/v1/completions",
            json={"model": PUBLIC, "prompt": "A seawall is", "max_tokens": 4},
        )
        assert r.status_code == 200, r.text
    return _served_by(a_url) == before
