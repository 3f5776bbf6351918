"""Admission before preemption: a small-KV `seawall sim` fleet under overload.

Without admission the engines accept everything and preempt (recompute) as the KV cache
fills; with admission the gateway holds requests at the door until a replica's KV cache
can take them, so the engines never preempt and every request still completes.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from seawall.auth import hash_key
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    start_gateway,
    start_sim,
    wait_until,
)
from tests.support.procs import Proc, free_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "sk-sw-admin-admission-test-000000000000000000000"
# 63 usable blocks of 16 tokens = 1008 KV tokens per replica; each request may grow to
# about 40 + 300 tokens, so about three fit at once.
SIM_ARGS = ("--kv-blocks", "64", "--max-model-len", "512", "--step-base-ms", "2")
BODY = {
    "model": MODEL,
    "prompt": "Write about the tide. " * 6,
    "max_tokens": 300,
    "ignore_eos": True,
    "stream": True,
}


def overload(url: str, n: int) -> list[int]:
    statuses: list[int] = []
    lock = threading.Lock()

    def one() -> None:
        r = httpx.post(url + "/v1/completions", json=BODY, timeout=120)
        ok = (
            r.status_code == 200
            and r.content.endswith(b"data: [DONE]\n\n")
            and (b'"error"' not in r.content)
        )
        with lock:
            statuses.append(r.status_code if ok else -1)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return statuses


def gateway(artifacts: Path, sims: list[Proc], admission: dict[str, Any]) -> tuple[Proc, str]:
    port = free_port()
    gw = start_gateway(
        artifacts,
        sims,
        {
            "admission": {"queue_timeout_s": 90, "queue_max": 64, **admission},
            "admin": {"enabled": True, "port": port, "token_hash": hash_key(TOKEN)},
            "fleet": {
                "scrape_interval_s": 0.25,
                "deep_probe_idle_interval_s": 30,
                "deep_probe_interval_s": 30,
            },
        },
    )
    admin = f"http://127.0.0.1:{port}"

    def capacity_known() -> bool:
        state = httpx.get(
            admin + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()
        return all((r.get("load") or {}).get("kv_capacity_tokens") for r in state["replicas"])

    wait_until(capacity_known, 10, what="KV capacity scraped")
    return gw, admin


@pytest.mark.parametrize("admission", [False, True])
def test_admission_keeps_a_small_kv_fleet_from_preempting(admission: bool, artifacts: Path) -> None:
    sims = [start_sim(artifacts, *SIM_ARGS, name=f"s{i}") for i in range(2)]
    gw, _ = gateway(artifacts, sims, {"enabled": admission})
    with running(gw, *sims):
        statuses = overload(gw.url, 16)  # about three times what the two caches hold
        preemptions = sum(metric_sum(scrape(s.url), "vllm:num_preemptions_total") for s in sims)
        if admission:
            assert preemptions == 0
            assert statuses == [200] * 16  # held at the door, then served: none lost
            assert metric_sum(scrape(gw.url), "seawall_admission_queue_depth") == 0
        else:
            assert preemptions > 0  # the unprotected fleet thrashes
            assert statuses.count(200) == 16  # vLLM still completes them, only later
