"""The shipped rules in a real Prometheus that scrapes the gateway and `seawall sim`
replicas on loopback: a `hang` fault on a busy replica fires `SeawallReplicaStuck` for
that replica and no other. The same live processes check the drift check and the
dashboard against what is really exported."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from seawall.ops import dashboard
from seawall.ops.promql import exposed_sample_names, metric_names
from tests.support.procs import (
    ARTIFACTS,
    Proc,
    free_port,
    require_binary,
    seawall_argv,
    spawn,
    wait_http,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim-model"
FIRE_DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    # One stack for the module: starting Prometheus, a gateway and two replicas is the
    # slow part, and the export check does not care whether a replica later hangs.
    prometheus = require_binary("prometheus")
    tmp_path = tmp_path_factory.mktemp("ops-live")
    artifacts = ARTIFACTS / "test_ops_prometheus_live"
    procs: dict[str, Proc] = {}
    try:
        for name in ("sim1", "sim2"):
            port = free_port()
            procs[name] = spawn(
                seawall_argv(
                    "sim",
                    "--port",
                    str(port),
                    "--model",
                    MODEL,
                    "--enable-faults",
                    "--step-base-ms",
                    "20",
                ),
                artifacts / f"{name}.log",
                port=port,
            )
        for name in ("sim1", "sim2"):
            wait_http(procs[name].url + "/health", proc=procs[name])
        port = free_port()
        procs["gateway"] = spawn(
            seawall_argv(
                "serve",
                "--port",
                str(port),
                "--no-access-log",
                "--replica",
                procs["sim1"].url,
                "--replica",
                procs["sim2"].url,
            ),
            artifacts / "gateway.log",
            port=port,
        )
        wait_http(procs["gateway"].url + "/metrics", proc=procs["gateway"])

        rules = tmp_path / "rules.yml"
        subprocess.run(
            seawall_argv("alerts", "--stuck-window", "10s", "--stuck-for", "3s", "-o", str(rules)),
            check=True,
            timeout=60,
        )
        target = lambda p: f"'127.0.0.1:{p.port}'"  # noqa: E731
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            f"rule_files: ['{rules}']\n"
            "scrape_configs:\n"
            f"- job_name: engines\n  static_configs: [{{targets: [{target(procs['sim1'])}, "
            f"{target(procs['sim2'])}]}}]\n"
            f"- job_name: seawall\n  static_configs: [{{targets: [{target(procs['gateway'])}]}}]\n"
        )
        port = free_port()
        procs["prometheus"] = spawn(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            artifacts / "prometheus.log",
            port=port,
        )
        wait_http(procs["prometheus"].url + "/-/ready", timeout=60, proc=procs["prometheus"])
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _query(prom: Proc, promql: str) -> list[Any]:
    url = prom.url + "/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    result: list[Any] = _get_json(url)["data"]["result"]
    return result


def _firing(prom: Proc, alertname: str) -> list[dict[str, str]]:
    alerts = _get_json(prom.url + "/api/v1/alerts")["data"]["alerts"]
    return [
        a["labels"]
        for a in alerts
        if a["labels"].get("alertname") == alertname and a["state"] == "firing"
    ]


def _wait_until(check: Any, what: str, timeout_s: float = FIRE_DEADLINE_S) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


def test_live_processes_export_what_the_rules_and_dashboard_use(stack: dict[str, Proc]) -> None:
    sim, gateway = stack["sim1"], stack["gateway"]
    for url in (sim.url + "/metrics", gateway.url + "/metrics"):
        result = subprocess.run(
            seawall_argv("alerts", "check", "--metrics-url", url),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stdout + result.stderr
        assert result.stdout.startswith("ok:")

    def scrape(proc: Proc) -> str:
        with urllib.request.urlopen(proc.url + "/metrics", timeout=5) as resp:
            text: str = resp.read().decode()
            return text

    exported = exposed_sample_names(scrape(sim)) | exposed_sample_names(scrape(gateway))
    for panel in dashboard.build("vllm")["panels"]:
        for target in panel.get("targets", []):
            assert metric_names(target["expr"]) <= exported, panel["title"]


def test_budget_measures_a_live_gateway_through_prometheus(stack: dict[str, Proc]) -> None:
    gateway, prom = stack["gateway"], stack["prometheus"]
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4}).encode()

    def requests(count: int) -> None:
        for _ in range(count):
            req = urllib.request.Request(
                gateway.url + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=30) as resp:
                assert resp.status == 200

    # A labelled series is born at its first observation, so rates need a second
    # batch of requests after Prometheus has seen the first.
    requests(1)
    _wait_until(lambda: _query(prom, "seawall_e2e_seconds_count"), "the gateway's first request")
    requests(3)
    _wait_until(
        lambda: _query(prom, "sum(increase(seawall_e2e_seconds_count[1m])) > 0"),
        "Prometheus to see the gateway's requests",
    )
    result = subprocess.run(
        seawall_argv(
            "budget",
            "--json",
            "--from-prometheus",
            prom.url,
            "--prom-range",
            "1m",
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    assert {"replicas", "workloads"} <= set(doc["measured"])
    assert doc["inputs"]["replicas"] in (1, 2)
    [workload] = doc["inputs"]["workloads"]
    assert workload["name"] == MODEL and workload["stream_s"] > 0


async def test_hang_fault_fires_the_stuck_replica_alert(stack: dict[str, Proc]) -> None:
    sim1, sim2, prom = stack["sim1"], stack["sim2"], stack["prometheus"]
    sim1_instance = f"127.0.0.1:{sim1.port}"
    await asyncio.to_thread(
        _wait_until,
        lambda: len(_query(prom, "up == 1")) == 3,
        "Prometheus to scrape the gateway and both replicas",
    )
    body = {
        "model": MODEL,
        "prompt": "hello",
        "max_tokens": 4000,
        "stream": True,
        "ignore_eos": True,
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(sim1.url + "/v1/completions", json=body) as stream,
    ):
        assert stream.status == 200
        await stream.content.readline()  # the replica is generating
        # Progress visible to Prometheus before the hang: the alert must not be
        # firing merely because generation had not started.
        await asyncio.to_thread(
            _wait_until,
            lambda: _query(
                prom,
                f'increase(vllm:generation_tokens_total{{instance="{sim1_instance}"}}[10s]) > 0',
            ),
            "generation tokens to rise on sim1",
        )
        assert _firing(prom, "SeawallReplicaStuck") == []
        async with session.post(sim1.url + "/sim/fault", json={"kind": "hang"}) as fault:
            assert fault.status == 200

        firing = await asyncio.to_thread(
            _wait_until, lambda: _firing(prom, "SeawallReplicaStuck"), "SeawallReplicaStuck"
        )
    assert [a["instance"] for a in firing] == [sim1_instance]
    assert firing[0]["severity"] == "page"
    assert f"127.0.0.1:{sim2.port}" not in {a["instance"] for a in firing}
