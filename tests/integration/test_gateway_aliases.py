"""Model aliases through a real gateway (issue 14): clients ask for `qwen3-8b`, the
engines serve `Qwen/Qwen3-8B`, and the gateway is configured with LiteLLM's `model_list`.

The openai SDK is the client; `seawall sim` replicas are the engines. What a client sees
is the public name everywhere (`/v1/models`, every response and stream chunk); what the
engines see is their served name, on retries and mid-stream migrations too."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.chop import ChoppingRelay
from tests.support.fleet import (
    MODEL,
    metric_sum,
    running,
    scrape,
    set_fault,
    start_gateway,
    start_sim,
)
from tests.support.procs import Proc

pytestmark = pytest.mark.integration

SERVED, PUBLIC = "Qwen/Qwen3-8B", "qwen3-8b"


def model_list(sims: list[Proc]) -> list[dict[str, Any]]:
    return [
        {
            "model_name": PUBLIC,
            "litellm_params": {"model": f"hosted_vllm/{SERVED}", "api_base": f"{s.url}/v1"},
            "model_info": {"id": f"q{i}", "node": f"node-q{i}"},
        }
        for i, s in enumerate(sims)
    ]


def test_clients_use_the_public_name_and_engines_get_their_served_name(artifacts: Path) -> None:
    qwen = [start_sim(artifacts, model=SERVED, name=f"q{i}") for i in range(2)]
    plain = start_sim(artifacts, name="plain")  # serves sim-model under its own name
    gw = start_gateway(artifacts, [plain], {"model_list": model_list(qwen)})
    with running(gw, plain, *qwen):
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)

        cards = {m.id: m for m in client.models.list().data}
        assert sorted(cards) == [PUBLIC, MODEL]
        assert cards[PUBLIC].model_dump()["max_model_len"] > 0  # the engine's own card...
        assert cards[PUBLIC].model_dump()["root"] == SERVED  # ...naming what it serves

        done = client.completions.create(model=PUBLIC, prompt="Sea walls", max_tokens=5)
        assert done.model == PUBLIC and done.choices[0].text
        chunks = list(
            client.chat.completions.create(
                model=PUBLIC,
                messages=[{"role": "user", "content": "Tell me about sea walls."}],
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
        )
        assert len(chunks) > 3 and {c.model for c in chunks} == {PUBLIC}
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

        # The served name is not a public one: the catalogue is what /v1/models lists.
        with pytest.raises(openai.NotFoundError) as e:
            client.completions.create(model=SERVED, prompt="hi", max_tokens=2)
        assert "qwen3-8b" in str(e.value) and e.value.code == "model_not_found"

        # The unaliased replica is untouched by all this.
        assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).model == MODEL

        m = scrape(gw.url)
        assert metric_sum(m, "seawall_requests_total", model=PUBLIC, status="200") == 2
        assert metric_sum(m, "seawall_requests_total", model=SERVED) == 0
        assert metric_sum(m, "seawall_ttft_seconds_count", model=PUBLIC) == 2
        # Both engines were asked under their own name (a 404 there would be a 404 here).
        served = sum(metric_sum(scrape(s.url), "vllm:request_success_total") for s in qwen)
        assert served == 2


def test_a_migrated_stream_keeps_the_public_name_from_a_second_engine(artifacts: Path) -> None:
    qwen = [
        start_sim(artifacts, "--step-base-ms", "20", model=SERVED, name=f"q{i}") for i in range(2)
    ]
    config = {
        "model_list": model_list(qwen),
        "tiers": {"default": {"migrate": True}},
        "fleet": {"liveness_interval_s": 0.25, "deep_probe_interval_s": 30},
    }
    gw = start_gateway(artifacts, [], config)
    with running(gw, *qwen):
        client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        stream = client.completions.create(
            model=PUBLIC, prompt="The sea wall at dawn", max_tokens=100, stream=True,
            temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = []
        for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 10:
                running_on = [
                    s for s in qwen if metric_sum(scrape(s.url), "vllm:num_requests_running") > 0
                ]
                assert len(running_on) == 1
                set_fault(running_on[0], {"kind": "crash"})
        assert {c.model for c in chunks} == {PUBLIC}
        assert chunks[-1].choices[0].finish_reason == "length"
        assert metric_sum(scrape(gw.url), "seawall_migrations_total", outcome="ok") == 1
        with httpx.Client() as h:
            assert h.get(f"{gw.url}/v1/models").json()["data"][0]["id"] == PUBLIC


def test_the_restamp_holds_when_every_field_arrives_split_across_reads(artifacts: Path) -> None:
    """The network may cut `"model":"Qwen/Qwen3-8B"` anywhere; the relay in between
    delivers the engine's bytes 7 at a time, so nearly every field is split."""
    sim = start_sim(artifacts, model=SERVED)
    with ChoppingRelay(sim.port or 0, piece=7) as relay, running(sim):
        entry = {"model_name": PUBLIC, "litellm_params": {"model": SERVED, "api_base": relay.url}}
        gw = start_gateway(artifacts, [], {"model_list": [entry]})
        with running(gw):
            client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
            chunks = list(
                client.completions.create(
                    model=PUBLIC,
                    prompt="Sea",
                    max_tokens=30,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
            assert len(chunks) >= 30 and {c.model for c in chunks} == {PUBLIC}
            done = client.completions.create(model=PUBLIC, prompt="Sea", max_tokens=30)
            assert done.model == PUBLIC
