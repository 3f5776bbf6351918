"""guidellm 0.8, unchanged, against `seawall serve` and directly against the sims.

guidellm checks `GET /health` before it starts (a 404 makes it refuse the target), then
reads `/v1/models` and streams completions. Each run is short and slow (a few seconds at
2 requests/s) and uses its own data seed: the sims cache prefixes, so a run that
repeated an earlier run's prompts would look faster than it is.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import guidellm
from tests.support.fleet import running, start_gateway, start_sim

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RUN_S = 3.0
RATE = 2.0


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if guidellm.binary() is None:
        import os

        if os.environ.get("CI"):
            pytest.fail(f"guidellm is not installed in {guidellm.venv_dir()}: ./dev setup")
        pytest.skip(f"guidellm is not installed in {guidellm.venv_dir()} (./dev setup)")
    return guidellm.make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.mark.timeout(600)
def test_guidellm_runs_unchanged_through_the_gateway_and_direct(
    artifacts: Path, tokenizer: Path
) -> None:
    sims = [start_sim(artifacts, name=f"sim{i}", faults=False) for i in range(2)]
    gw = start_gateway(artifacts, sims)
    with running(gw, *sims):
        results = {}
        for seed, (name, target) in enumerate(
            [("gateway", gw.url), ("direct", sims[0].url)], start=1
        ):
            results[name] = guidellm.run(
                target,
                artifacts / f"guidellm-{name}.json",
                seed=seed,
                seconds=RUN_S,
                rate=RATE,
                tokenizer=tokenizer,
            )
    for name, result in results.items():
        expected = RUN_S * RATE
        assert result.successful >= expected / 2, (name, result.successful, result.log)
        assert result.errored == 0, (name, result.log)
        assert result.ttft_ms["median"] > 0 and result.itl_ms["median"] > 0, name
