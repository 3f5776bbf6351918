"""The shipped rules and dashboard in a real Prometheus (Debian's 2.42) that scrapes a
gateway and two `seawall sim` replicas on loopback with the shipped scrape config
(discovery swapped for static targets, tests/support/prometheus_config.py).

The replicas answer as vLLM 0.33.0 does: one is scraped at `/metrics` (vLLM's
instrumentator route: text, `vllm:` names whatever Prometheus asks), the other at
`/metrics/` (the prometheus_client mount, which negotiates OpenMetrics and escapes
names to `vllm_` for Prometheus 2.x). A third job scrapes that second endpoint without
the shipped `metric_relabel_configs`, to show what Prometheus would store otherwise.
While traffic flows, every rule evaluates cleanly and every dashboard query returns
data, zero counts included; a `hang` fault fires `SeawallReplicaStuck` for one replica.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
import yaml

from seawall.ops import dashboard
from seawall.ops.promql import exposed_sample_names, metric_names
from tests.support import prometheus_config
from tests.support.procs import (
    Proc,
    free_port,
    module_artifacts,
    require_binary,
    seawall_argv,
    spawn,
    wait_http,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim-model"
FIRE_DEADLINE_S = 60.0
RAW_JOB = "engines-unrelabelled"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    # One stack for the module: starting Prometheus, a gateway and two replicas is the
    # slow part, and the export check does not care whether a replica later hangs.
    prometheus = require_binary("prometheus")
    tmp_path = tmp_path_factory.mktemp("ops-live")
    artifacts = module_artifacts("test_ops_prometheus_live")
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
        address = lambda p: f"127.0.0.1:{p.port}"  # noqa: E731
        doc = prometheus_config.with_static_targets(
            prometheus_config.shipped(),
            {
                "engines": [
                    (address(procs["sim1"]), "/metrics"),
                    (address(procs["sim2"]), "/metrics/"),
                ],
                "seawall": [(address(procs["gateway"]), "/metrics")],
            },
        )
        doc["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        doc["rule_files"] = [str(rules)]
        doc["scrape_configs"].append(
            {
                "job_name": RAW_JOB,
                "metrics_path": "/metrics/",
                "static_configs": [{"targets": [address(procs["sim2"])]}],
            }
        )
        config = tmp_path / "prometheus.yml"
        config.write_text(yaml.safe_dump(doc))
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


def _names_stored(prom: Proc, job: str) -> set[str]:
    url = (
        prom.url
        + "/api/v1/label/__name__/values?"
        + urllib.parse.urlencode({"match[]": f'{{job="{job}"}}'})
    )
    return set(_get_json(url)["data"])


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        seawall_argv("alerts", "check", *args), capture_output=True, text=True, timeout=60
    )


def test_prometheus_stores_the_names_as_measured(stack: dict[str, Proc]) -> None:
    prom, sim1, sim2 = stack["prometheus"], stack["sim1"], stack["sim2"]
    _wait_until(lambda: _names_stored(prom, RAW_JOB), "the unrelabelled job's first scrape")
    # Without the shipped relabel rule, the negotiating endpoint's names are escaped.
    raw = _names_stored(prom, RAW_JOB)
    assert "vllm_kv_cache_usage_perc" in raw and "vllm_num_preemptions_total" in raw
    assert not any(n.startswith("vllm:") for n in raw)
    # With it, both endpoints are stored under vLLM's names, for both instances.
    for instance in (sim1, sim2):
        selector = f'vllm:kv_cache_usage_perc{{job="engines",instance="127.0.0.1:{instance.port}"}}'
        _wait_until(lambda s=selector: _query(prom, s), f"{selector} in Prometheus")
    assert not any(n.startswith("vllm_") for n in _names_stored(prom, "engines"))


def test_drift_check_sees_what_prometheus_stores(stack: dict[str, Proc]) -> None:
    prom, sim2 = stack["prometheus"], stack["sim2"]
    # Each job's first scrape, not only one's: checked before it, a job reads as storing
    # none of the names (CI once ran this test before the engines job was first scraped).
    for job in (RAW_JOB, "engines", "seawall"):
        _wait_until(lambda j=job: _names_stored(prom, j), f"the {job} job's first scrape")
    for job in ("engines", "seawall"):
        ok = _check("--prometheus-url", prom.url, "--job", job)
        assert ok.returncode == 0, ok.stdout + ok.stderr
    raw = _check("--prometheus-url", prom.url, "--job", RAW_JOB)
    assert raw.returncode == 1, raw.stdout + raw.stderr
    assert "stored as vllm_kv_cache_usage_perc" in raw.stdout
    assert "metric_relabel_configs" in raw.stdout
    # The same verdicts straight from the endpoint, asked as each Prometheus asks.
    mount = sim2.url + "/metrics/"
    as_2 = _check("--metrics-url", mount, "--scraper", "prometheus-2")
    assert as_2.returncode == 1 and "stored as vllm_" in as_2.stdout, as_2.stdout
    as_3 = _check("--metrics-url", mount, "--scraper", "prometheus-3")
    assert as_3.returncode == 0, as_3.stdout + as_3.stderr


def _dashboard_queries() -> list[tuple[str, str]]:
    out = []
    for panel in dashboard.build("vllm")["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "15s").replace("$model", ".*")
            out.append((panel["title"], expr))
    return out


def _traffic(gateway: Proc, stop: threading.Event, max_requests: int = 400) -> None:
    """Streaming chat through the gateway until `stop` (bounded in count)."""
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 8,
            "stream": True,
        }
    ).encode()
    for _ in range(max_requests):
        if stop.is_set():
            return
        req = urllib.request.Request(
            gateway.url + "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                resp.read()
        except OSError:
            time.sleep(0.1)


def test_rules_are_healthy_and_every_dashboard_query_has_data_under_traffic(
    stack: dict[str, Proc],
) -> None:
    prom, gateway = stack["prometheus"], stack["gateway"]
    stop = threading.Event()
    worker = threading.Thread(target=_traffic, args=(gateway, stop), daemon=True)
    worker.start()
    try:
        queries = _dashboard_queries()
        assert len(queries) >= 25

        def empty() -> list[str]:
            return [f"{title}: {expr}" for title, expr in queries if not _query(prom, expr)]

        deadline = time.monotonic() + FIRE_DEADLINE_S
        missing = empty()
        while missing and time.monotonic() < deadline:
            time.sleep(0.5)
            missing = empty()
        assert not missing, "dashboard queries without data:\n" + "\n".join(missing)

        def rules() -> list[dict[str, Any]]:
            groups = _get_json(prom.url + "/api/v1/rules")["data"]["groups"]
            return [r for g in groups for r in g["rules"]]

        _wait_until(
            lambda: all(r["health"] != "unknown" for r in rules()), "every rule to be evaluated"
        )
        unhealthy = [(r["name"], r["health"], r.get("lastError")) for r in rules()]
        assert len(unhealthy) >= 11
        assert all(h == "ok" for _, h, _ in unhealthy), unhealthy
    finally:
        stop.set()
        worker.join(timeout=40)


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
        lambda: len(_query(prom, f'up{{job!="{RAW_JOB}"}} == 1')) == 3,
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
