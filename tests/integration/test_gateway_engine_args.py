"""`seawall engine-args` and the start-time check of replicas' max_model_len."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.fleet import running, start_gateway, start_sim, wait_until
from tests.support.procs import seawall_argv

pytestmark = pytest.mark.integration

TIERS = {
    "gold": {"max_prompt_tokens": 6000, "max_tokens": 2000},
    "free": {"max_prompt_tokens": 1000, "max_tokens": 256},
}
HASH = "sha256:" + "ab" * 32
TENANTS = {
    "a": {"tier": "gold", "api_key_hashes": [HASH]},
    "b": {"tier": "free", "api_key_hashes": []},
}


def test_engine_args_back_up_the_tier_limits(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "replicas": [{"url": "http://127.0.0.1:1"}],
                "tiers": TIERS,
                "tenants": TENANTS,
                "admission": {"inflight_max": 48},
            }
        )
    )
    out = subprocess.run(
        seawall_argv("engine-args", "--config", str(cfg)),
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    command = out.strip().splitlines()[-1]
    assert "--max-model-len 8000" in command  # gold: 6000 + 2000
    assert "--max-num-seqs 48" in command
    assert "--gpu-memory-utilization <SET-ME>" in command


def test_engine_args_reports_config_errors(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(yaml.safe_dump({"tiers": {"x": {"max_tokens_mode": "truncate"}}}))
    r = subprocess.run(
        seawall_argv("engine-args", "--config", str(cfg)), capture_output=True, text=True
    )
    assert r.returncode == 2
    assert "tiers.x.max_tokens_mode" in r.stderr and "'reject' or 'clamp'" in r.stderr


def test_gateway_warns_when_a_replica_cannot_hold_a_tier(artifacts: Path) -> None:
    sim = start_sim(artifacts, "--max-model-len", "4096")
    gw = start_gateway(artifacts, [sim], {"tiers": TIERS, "tenants": TENANTS})
    with running(gw, sim):
        wait_until(lambda: "cannot hold tier 'gold'" in gw.log(), 10, what="the warning")
        assert "cannot hold tier 'free'" not in gw.log()
