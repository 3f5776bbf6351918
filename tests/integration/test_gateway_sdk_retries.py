"""The openai SDK's own retries through the gateway (issue 14): the gateway says, with
`x-should-retry`, whether a client retry can help, and with `retry-after-ms` how long to
wait when whole seconds would round a short wait up.

The SDK used to retry twice more after the gateway had already tried both replicas: six
engine attempts and an error after 13.4 s instead of two attempts and 4 s."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest

from seawall.auth import hash_key
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    set_fault,
    start_gateway,
    start_sim,
)

pytestmark = pytest.mark.integration

KEY = "sk-sw-sdk-retries-0000000000000000000000000000000"


def test_the_sdk_does_not_retry_what_the_gateway_already_retried(artifacts: Path) -> None:
    sims = [start_sim(artifacts, name=f"s{i}") for i in range(2)]
    for sim in sims:
        set_fault(sim, {"kind": "errors", "rate": 1.0, "when": "before_first_token"})
    gw = start_gateway(artifacts, sims)
    with running(gw, *sims):
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=2)
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4)
        assert e.value.response.headers["x-should-retry"] == "false"
        m = scrape(gw.url)
        assert metric_sum(m, "seawall_requests_total") == 1  # the SDK sent it once
        assert metric_sum(m, "seawall_upstream_attempts_total") == 2  # one per replica


def test_the_sdk_retries_a_rate_limit_after_the_wait_the_gateway_names(artifacts: Path) -> None:
    sim = start_sim(artifacts)
    config = {
        "tiers": {"t": {"requests_per_min": 40}},  # one request every 1.5 s after a burst
        "tenants": {"acme": {"tier": "t", "api_key_hashes": [hash_key(KEY)]}},
        "metrics": {"access": "public"},  # this test reads the shed counters
    }
    gw = start_gateway(artifacts, [sim], config)
    with running(gw, sim):
        headers = {"Authorization": f"Bearer {KEY}"}
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
        with httpx.Client(timeout=10) as h:
            while (r := h.post(gw.url + "/v1/completions", json=body, headers=headers)).is_success:
                pass  # spend the burst
        assert r.status_code == 429
        assert r.headers["x-should-retry"] == "true"
        # The exact wait in milliseconds; whole seconds round it up.
        wait_ms = int(r.headers["retry-after-ms"])
        assert 0 < wait_ms <= 1500 and wait_ms <= 1000 * int(r.headers["retry-after"])
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=KEY, max_retries=3)
        out = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
        assert out.choices[0].text is not None
        assert metric_sum(scrape(gw.url), "seawall_shed_total", reason="requests_per_min") >= 2


def test_the_sdk_does_not_retry_a_timeout_or_its_own_bad_request(artifacts: Path) -> None:
    """A first-token timeout after the gateway's own retries (504), and a request the
    client got wrong (400, 404): `x-should-retry: false`, so the SDK sends each once."""
    sim = start_sim(artifacts)
    set_fault(sim, {"kind": "hang", "when": "before_first_token"})
    gw = start_gateway(artifacts, [sim], {"timeouts": {"ttft_s": 1}}, wait_ready=False)
    with running(gw, sim):
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=2)
        with pytest.raises(openai.APIStatusError) as e:  # held until its first token
            client.completions.create(model=MODEL, prompt="hi", max_tokens=4, stream=True)
        assert e.value.status_code == 504
        assert e.value.response.headers["x-should-retry"] == "false"
        with pytest.raises(openai.BadRequestError) as bad:
            client.completions.create(model=MODEL, prompt=[], max_tokens=1)
        assert bad.value.response.headers["x-should-retry"] == "false"
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=1)
        assert missing.value.response.headers["x-should-retry"] == "false"
        assert metric_sum(scrape(gw.url), "seawall_requests_total") == 3  # each sent once
