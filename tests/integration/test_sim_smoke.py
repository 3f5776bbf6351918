"""`seawall sim` answers like vLLM: health, models, completions and chat, metrics."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import Proc, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration


@pytest.fixture
def sim(artifacts: Path) -> Iterator[Proc]:
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--port", str(port), "--model", "m1", "--step-base-ms", "2"),
        artifacts / "sim.log",
        port=port,
    )
    try:
        wait_http(proc.url + "/health", proc=proc)
        yield proc
    finally:
        proc.stop()


def _samples(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + (
                "{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}"
                if s.labels
                else ""
            )
            out[key] = s.value
    return out


def test_openai_sdk_streams_and_non_streams_with_consistent_usage_and_metrics(sim: Proc) -> None:
    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
    models = client.models.list()
    assert [m.id for m in models.data] == ["m1"]

    done = client.completions.create(model="m1", prompt="Hello world", max_tokens=8, temperature=0)
    assert done.usage is not None and done.usage.completion_tokens == 8
    assert done.choices[0].finish_reason == "length"

    pieces: list[str] = []
    usage = None
    for chunk in client.completions.create(
        model="m1",
        prompt="Hello world",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    # greedy: the stream says exactly what the non-streamed call said
    assert "".join(pieces) == done.choices[0].text
    assert usage is not None and usage.completion_tokens == 8

    chat = client.chat.completions.create(
        model="m1", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.choices[0].message.content
    deltas = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="m1",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        if c.choices
    ]
    assert "".join(deltas) == chat.choices[0].message.content

    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m1", prompt="x", max_tokens=5000)

    import urllib.request

    with urllib.request.urlopen(sim.url + "/metrics") as r:
        assert r.headers["Content-Type"].startswith(
            "text/plain; version=1.0.0"
        )  # vLLM 0.33 with prometheus_client 0.26
        samples = _samples(r.read().decode())
    labels = "{engine=0,model_name=m1}"
    assert samples["vllm:generation_tokens_total" + labels] == 8 + 8 + 4 + 4
    assert samples["vllm:request_success_total{engine=0,finished_reason=length,model_name=m1}"] >= 4
    assert samples["vllm:num_requests_running" + labels] == 0
    assert samples["vllm:kv_cache_usage_perc" + labels] == 0
    assert samples["vllm:time_to_first_token_seconds_count" + labels] == 4


def test_metric_counts_follow_vllms_invariants_for_sequential_requests(artifacts: Path) -> None:
    """vLLM's own test_metrics invariants: for N requests of T tokens, TTFT count N, ITL
    count N*(T-1), iteration count N*T, N successes; idle afterwards."""
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--port", str(port), "--step-base-ms", "1"),
        artifacts / "sim.log",
        port=port,
    )
    try:
        wait_http(proc.url + "/health", proc=proc)
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        n, t = 3, 7
        for _ in range(n):
            client.completions.create(
                model="sim-model", prompt="abc", max_tokens=t, extra_body={"ignore_eos": True}
            )
        import urllib.request

        with urllib.request.urlopen(proc.url + "/metrics") as r:
            samples = _samples(r.read().decode())
        labels = "{engine=0,model_name=sim-model}"
        assert samples["vllm:time_to_first_token_seconds_count" + labels] == n
        assert samples["vllm:inter_token_latency_seconds_count" + labels] == n * (t - 1)
        assert samples["vllm:iteration_tokens_total_count" + labels] == n * t
        assert samples["vllm:request_time_per_output_token_seconds_count" + labels] == n
        assert samples["vllm:e2e_request_latency_seconds_count" + labels] == n
        assert samples["vllm:request_queue_time_seconds_count" + labels] == n
        assert samples["vllm:request_generation_tokens_sum" + labels] == n * t
        assert (
            samples[
                "vllm:request_success_total{engine=0,finished_reason=length,model_name=sim-model}"
            ]
            == n
        )
        assert samples["vllm:num_requests_running" + labels] == 0
        assert samples["vllm:num_requests_waiting" + labels] == 0
        assert samples["vllm:kv_cache_usage_perc" + labels] == 0
    finally:
        proc.stop()
