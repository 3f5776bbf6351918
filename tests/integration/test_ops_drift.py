"""`seawall alerts check` against real HTTP servers on loopback serving engine scrapes:
the vLLM 0.33 golden scrape, and the same scrape as an engine from before the KV-cache
rename would print it."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.support.golden import GOLDEN_SCRAPE
from tests.support.procs import free_port, seawall_argv

pytestmark = pytest.mark.integration

GOLDEN = GOLDEN_SCRAPE.read_text()
# An engine that predates the rename exports the old name and not the new one.
LEGACY = GOLDEN.replace("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


@pytest.fixture
async def engines() -> AsyncIterator[str]:
    def serve(text: str) -> web.Handler:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(text=text, content_type="text/plain")

        return handler

    app = web.Application()
    app.router.add_get("/new/metrics", serve(GOLDEN))
    app.router.add_get("/old/metrics", serve(LEGACY))
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _check(*args: str) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        *seawall_argv("alerts", "check", *args),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env=dict(os.environ),
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
    return proc.returncode or 0, out.decode()


async def test_current_engine_shows_no_drift(engines: str) -> None:
    rc, out = await _check("--metrics-url", f"{engines}/new/metrics")
    assert rc == 0, out
    assert out.startswith("ok:")


async def test_old_engine_drift_names_the_rename_and_who_is_affected(engines: str) -> None:
    rc, out = await _check("--metrics-url", f"{engines}/old/metrics")
    assert rc == 1
    assert "vllm:kv_cache_usage_perc" in out
    assert "rule SeawallEngineKvCacheFull" in out and "fleet adapter (vllm)" in out
    assert "old name vllm:gpu_cache_usage_perc" in out


async def test_stale_rule_file_drift_names_the_new_name(engines: str, tmp_path: Path) -> None:
    rules = tmp_path / "old-rules.yml"
    rules.write_text(
        "groups:\n- name: old\n  rules:\n"
        "  - alert: KvFull\n    expr: vllm:gpu_cache_usage_perc > 0.9\n"
        "  - alert: SlowTokens\n"
        "    expr: histogram_quantile(0.9,"
        " rate(vllm:time_per_output_token_seconds_bucket[5m])) > 1\n"
    )
    rc, out = await _check("--metrics-url", f"{engines}/new/metrics", "--rules", str(rules))
    assert rc == 1
    assert "renamed: vllm:gpu_cache_usage_perc -> vllm:kv_cache_usage_perc (exported)" in out
    assert (
        "renamed: vllm:time_per_output_token_seconds_bucket -> "
        "vllm:inter_token_latency_seconds_bucket (exported)"
    ) in out


async def test_unreachable_scrape_is_an_error_not_a_pass() -> None:
    rc, out = await _check("--metrics-url", f"http://127.0.0.1:{free_port()}/metrics")
    assert rc == 2
    assert "cannot read" in out
