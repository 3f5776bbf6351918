"""JSON logs from a real `seawall serve` (issue 14): one object per line, every record.

The access records carry the request id, tenant, replica, attempts, outcome and timings
as keys; every other record (the fleet monitor's, a refused reload's) is JSON too; and
no line holds a tenant's key, the engine's key or an Authorization value."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest

from seawall.auth import hash_key
from tests.support.fleet import MODEL, running, start_gateway, start_sim, wait_until

pytestmark = pytest.mark.integration

KEY = "sk-sw-logs-tenant-key-00000000000000000000000000000"
ENGINE_KEY = "sk-engine-secret-value-for-the-log-test"


def records(log: str) -> list[dict[str, Any]]:
    out = []
    for line in log.splitlines():
        obj = json.loads(line)  # every line, or the test fails here naming it
        assert isinstance(obj, dict), line
        out.append(obj)
    return out


def test_every_line_is_one_json_object_with_the_request_fields_and_no_secret(
    artifacts: Path,
) -> None:
    sim = start_sim(artifacts)
    config = {
        "replicas": [
            {"url": sim.url, "model": MODEL, "id": "r0", "api_key": "os.environ/ENGINE_KEY"}
        ],
        "tenants": {"acme": {"tier": "default", "api_key_hashes": [hash_key(KEY)]}},
        "logging": {"format": "json"},
    }
    gw = start_gateway(artifacts, [], config, env={"ENGINE_KEY": ENGINE_KEY})
    with running(gw, sim), httpx.Client(base_url=gw.url, timeout=30) as http:
        auth = {"Authorization": f"Bearer {KEY}"}
        body = {"model": MODEL, "prompt": "Sea walls", "max_tokens": 4}
        r = http.post("/v1/completions", json=body, headers={**auth, "X-Request-Id": "req-ok"})
        assert r.status_code == 200
        r = http.post(
            "/v1/completions",
            json={**body, "stream": True},
            headers={**auth, "X-Request-Id": "req-stream"},
        )
        assert r.text.endswith("data: [DONE]\n\n")
        wrong = {"Authorization": "Bearer sk-sw-not-a-key-of-anyone", "X-Request-Id": "req-401"}
        assert http.post("/v1/completions", json=body, headers=wrong).status_code == 401
        r = http.post(
            "/v1/completions",
            json={**body, "model": "nope"},
            headers={**auth, "X-Request-Id": "req-404"},
        )
        assert r.status_code == 404
        # A reload the gateway refuses is logged as a JSON record too.
        config_path = Path(str(gw.extra["config_path"]))
        config_path.write_text("tiers: [this is not a mapping\n")
        gw.signal(signal.SIGHUP)
        wait_until(lambda: "refused" in gw.log(), 10, what="the refused reload's record")
        wait_until(lambda: gw.log().count('"logger":"seawall.access"') >= 4, 10)

    log = gw.log()
    for secret in (KEY, ENGINE_KEY, "Bearer", "sk-sw-not-a-key-of-anyone"):
        assert secret not in log
    recs = records(log)
    for rec in recs:
        assert {"time", "level", "logger", "message"} <= rec.keys(), rec
        assert rec["time"].endswith("Z") and "T" in rec["time"]
    access = {r["request_id"]: r for r in recs if r["logger"] == "seawall.access"}
    ok = access["req-ok"]
    assert ok["tenant"] == "acme" and ok["replica"] == "r0" and ok["attempts"] == 1
    assert ok["status"] == 200 and ok["outcome"] == "ok" and ok["served_model"] == MODEL
    assert 0 < ok["ttft_s"] <= ok["duration_s"] and ok["queued_s"] == 0
    assert access["req-stream"]["outcome"] == "ok" and access["req-stream"]["ttft_s"] > 0
    assert access["req-401"]["status"] == 401 and access["req-401"]["tenant"] == "default"
    assert access["req-401"]["outcome"] not in ("ok", "") and access["req-401"]["attempts"] == 0
    assert access["req-404"]["outcome"] == "model_not_found"
    others = {r["logger"] for r in recs if r["logger"] != "seawall.access"}
    assert "seawall.fleet.monitor" in others  # the monitor's own records
    (refused,) = [r for r in recs if "refused" in r["message"]]
    assert refused["level"] == "ERROR" and "not valid YAML" in refused["message"]
    assert any("listening on http://127.0.0.1:" in r["message"] for r in recs)


def test_the_flag_chooses_json_over_a_text_config(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    gw = start_gateway(
        artifacts, [sim], {"logging": {"format": "text"}}, args=["--log-format", "json"]
    )
    with running(gw, sim):
        assert httpx.post(
            f"{gw.url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 1}
        ).is_success
        wait_until(lambda: "seawall.access" in gw.log(), 10)
    assert records(gw.log())
