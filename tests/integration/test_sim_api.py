"""`seawall sim` over HTTP: vLLM's errors, token accounting, continuation, preemption and
disconnects, seen the way a client or a gateway sees them."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.procs import ARTIFACTS, Proc, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration


def start_sim(name: str, *flags: str) -> Proc:
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--port", str(port), "--enable-faults", *flags),
        ARTIFACTS / name / "sim.log",
        port=port,
    )
    wait_http(proc.url + "/health", proc=proc)
    return proc


def post(url: str, body: dict[str, Any], timeout: float = 30.0) -> tuple[int, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.loads(r.read())


def metric(proc: Proc, name: str, **labels: str) -> float:
    with urllib.request.urlopen(proc.url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(name)


@pytest.fixture(scope="module")
def sim() -> Iterator[Proc]:
    proc = start_sim("test_sim_api", "--step-base-ms", "1", "--max-model-len", "1024")
    try:
        yield proc
    finally:
        proc.stop()


def test_context_length_errors_and_clamping_match_vllm(sim: Proc) -> None:
    url = sim.url + "/v1/completions"
    status, body = post(url, {"prompt": "hi", "max_tokens": 2000})
    assert status == 400
    assert body["error"]["message"] == (
        "max_tokens=2000 cannot be greater than max_model_len=1024. Please request fewer "
        "output tokens. (parameter=max_tokens, value=2000)"
    )
    assert body["error"]["type"] == "BadRequestError" and body["error"]["param"] == "max_tokens"

    long_prompt = list(range(100_000, 100_000 + 1100))  # 1,100 token ids
    status, body = post(url, {"prompt": long_prompt, "max_tokens": 1})
    assert status == 400 and body["error"]["param"] == "input_tokens"
    assert "your prompt contains 1100 input tokens" in body["error"]["message"]

    # prompt + max_tokens over the limit: silently clamped to what the context leaves
    prompt = list(range(100_000, 100_000 + 1000))
    status, body = post(url, {"prompt": prompt, "max_tokens": 500, "ignore_eos": True})
    assert status == 200
    assert body["usage"]["completion_tokens"] == 24
    assert body["choices"][0]["finish_reason"] == "length"

    status, body = post(url, {"model": "other", "prompt": "x"})
    assert status == 404 and body["error"]["param"] == "model"
    assert body["error"]["message"].startswith("The model `other` does not exist.")


def test_token_counts_agree_between_tokenize_usage_and_metrics(sim: Proc) -> None:
    prompt = "Count these tokens, exactly: 12345 and ünïcödé."
    _, tok = post(sim.url + "/tokenize", {"prompt": prompt})
    assert tok["max_model_len"] == 1024 and tok["count"] == len(tok["tokens"])
    _, detok = post(sim.url + "/detokenize", {"tokens": tok["tokens"]})
    assert detok["prompt"] == prompt

    before = metric(sim, "vllm:prompt_tokens_total")
    status, body = post(
        sim.url + "/v1/completions", {"prompt": prompt, "max_tokens": 5, "temperature": 0}
    )
    assert status == 200
    assert body["usage"]["prompt_tokens"] == tok["count"]
    assert metric(sim, "vllm:prompt_tokens_total") - before == tok["count"]

    _, chat_tok = post(sim.url + "/tokenize", {"messages": [{"role": "user", "content": "yo"}]})
    status, chat = post(
        sim.url + "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "yo"}], "max_tokens": 3},
    )
    assert chat["usage"]["prompt_tokens"] == chat_tok["count"]


def test_greedy_completion_and_chat_continue_from_a_partial_output(sim: Proc) -> None:
    url = sim.url + "/v1/completions"
    prompt = "Once upon a time"
    _, full = post(url, {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True})
    text = full["choices"][0]["text"]
    _, head = post(url, {"prompt": prompt, "max_tokens": 15, "temperature": 0, "ignore_eos": True})
    partial = head["choices"][0]["text"]
    assert text.startswith(partial)
    _, rest = post(
        url, {"prompt": prompt + partial, "max_tokens": 25, "temperature": 0, "ignore_eos": True}
    )
    assert partial + rest["choices"][0]["text"] == text

    chat_url = sim.url + "/v1/chat/completions"
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    common = {"temperature": 0, "ignore_eos": True}
    _, full_chat = post(chat_url, {"messages": messages, "max_tokens": 30, **common})
    full_text = full_chat["choices"][0]["message"]["content"]
    _, head_chat = post(chat_url, {"messages": messages, "max_tokens": 11, **common})
    partial = head_chat["choices"][0]["message"]["content"]
    _, rest_chat = post(
        chat_url,
        {
            "messages": [*messages, {"role": "assistant", "content": partial}],
            "continue_final_message": True,
            "add_generation_prompt": False,
            "max_tokens": 19,
            **common,
        },
    )
    assert partial + rest_chat["choices"][0]["message"]["content"] == full_text

    # sampling with a seed is reproducible, and differs from another seed
    a = post(url, {"prompt": prompt, "max_tokens": 20, "temperature": 1, "seed": 5})[1]
    b = post(url, {"prompt": prompt, "max_tokens": 20, "temperature": 1, "seed": 5})[1]
    c = post(url, {"prompt": prompt, "max_tokens": 20, "temperature": 1, "seed": 6})[1]
    assert a["choices"][0]["text"] == b["choices"][0]["text"] != c["choices"][0]["text"]


def test_stop_strings_end_the_output_before_the_stop_text(sim: Proc) -> None:
    url = sim.url + "/v1/completions"
    base = {"prompt": "Stop test", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    _, full = post(url, base)
    text = full["choices"][0]["text"]
    stop = text[10:14]
    _, stopped = post(url, {**base, "stop": [stop]})
    choice = stopped["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["text"] == text[: text.index(stop)]


def test_sim_routes_are_404_without_enable_faults() -> None:
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--port", str(port)), ARTIFACTS / "sim_nofaults" / "sim.log", port
    )
    try:
        wait_http(proc.url + "/health", proc=proc)
        status, _ = post(proc.url + "/sim/fault", {"kind": "hang"})
        assert status == 404
        assert get_json(proc.url + "/version") == {"version": "0.33.0"}
        assert get_json(proc.url + "/load") == {"server_load": 0}
    finally:
        proc.stop()


def test_small_kv_cache_preempts_counts_it_and_every_request_completes() -> None:
    # 33 blocks of 16 = 512 usable tokens; 12 requests of 60 + 120 tokens need ~2,160
    proc = start_sim(
        "test_sim_preempt",
        "--kv-blocks", "33", "--max-model-len", "512",
        "--step-base-ms", "1", "--step-per-seq-ms", "0", "--step-per-prefill-token-ms", "0",
    )  # fmt: skip
    try:
        body = {"prompt": list(range(100_000, 100_060)), "max_tokens": 120, "ignore_eos": True}
        with ThreadPoolExecutor(12) as pool:
            results = list(pool.map(lambda _: post(proc.url + "/v1/completions", body), range(12)))
        assert all(status == 200 for status, _ in results)
        assert all(r["usage"]["completion_tokens"] == 120 for _, r in results)
        preemptions = metric(proc, "vllm:num_preemptions_total")
        assert preemptions > 0
        assert get_json(proc.url + "/sim/state")["num_preemptions_total"] == preemptions
        assert metric(proc, "vllm:request_num_preemptions_sum") == preemptions
        assert metric(proc, "vllm:request_success_total", finished_reason="length") == 12
        assert metric(proc, "vllm:kv_cache_usage_perc") == 0
    finally:
        proc.stop()


def test_a_disconnected_stream_frees_its_blocks_within_one_step() -> None:
    # slow steps, so that "within one step" is a strong statement
    proc = start_sim("test_sim_disconnect", "--step-base-ms", "300")
    try:
        body = json.dumps(
            {"prompt": "a long story", "max_tokens": 1000, "stream": True, "ignore_eos": True}
        ).encode()
        sock = socket.create_connection(("127.0.0.1", proc.port or 0), timeout=10)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        received = b""
        while received.count(b"data: ") < 2:
            received += sock.recv(65536)
        state = get_json(proc.url + "/sim/state")
        assert len(state["running"]) == 1 and state["free_blocks"] < state["usable_blocks"]
        assert metric(proc, "vllm:num_requests_running") == 1
        steps_at_close = state["steps"]
        sock.close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            state = get_json(proc.url + "/sim/state")
            if not state["running"]:
                break
            time.sleep(0.01)
        assert state["running"] == [] and state["free_blocks"] == state["usable_blocks"]
        assert state["steps"] - steps_at_close <= 1
        assert metric(proc, "vllm:num_requests_running") == 0
        assert metric(proc, "vllm:kv_cache_usage_perc") == 0
        # a client abort is not a finished request
        assert metric(proc, "vllm:request_success_total", finished_reason="abort") == 0
    finally:
        proc.stop()


def test_streamed_text_with_a_stop_string_never_shows_the_stop_text(sim: Proc) -> None:
    url = sim.url + "/v1/completions"
    base = {"prompt": "Stream stop", "max_tokens": 60, "temperature": 0, "ignore_eos": True}
    text = post(url, base)[1]["choices"][0]["text"]
    stop = text[20:27]  # may span tokens
    req = urllib.request.Request(
        url,
        data=json.dumps({**base, "stop": stop, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": "my-id-1"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        events = [
            json.loads(line[6:])
            for line in r.read().decode().split("\n\n")
            if line.startswith("data: {")
        ]
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert streamed == text[: text.index(stop)]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["choices"][0]["stop_reason"] == stop
    # vLLM names the response after the X-Request-Id header
    assert {e["id"] for e in events} == {"cmpl-my-id-1"}


def test_n_choices_each_sample_their_own_sequence(sim: Proc) -> None:
    import openai

    client = openai.OpenAI(base_url=sim.url + "/v1", api_key="x", max_retries=0)
    done = client.completions.create(
        model="sim-model", prompt="Many", max_tokens=10, n=3, temperature=1, seed=9
    )
    assert sorted(c.index for c in done.choices) == [0, 1, 2]
    texts = [c.text for c in sorted(done.choices, key=lambda c: c.index)]
    assert len(set(texts)) == 3
    assert done.usage is not None and done.usage.completion_tokens == sum(
        len(post(sim.url + "/tokenize", {"prompt": t})[1]["tokens"]) for t in texts
    )
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(
        model="sim-model", prompt="Many", max_tokens=10, n=3, temperature=1, seed=9, stream=True
    ):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert [streamed[i] for i in range(3)] == texts


def test_orca_load_report_header_on_request(sim: Proc) -> None:
    for stream in (False, True):
        req = urllib.request.Request(
            sim.url + "/v1/completions",
            data=json.dumps({"prompt": "x", "max_tokens": 2, "stream": stream}).encode(),
            headers={"Content-Type": "application/json", "endpoint-load-metrics-format": "TEXT"},
        )
        with urllib.request.urlopen(req, timeout=30) as r:
            header = r.headers["endpoint-load-metrics"]
            r.read()
        assert header.startswith("TEXT named_metrics.kv_cache_usage_perc=")
        assert "named_metrics.num_requests_waiting=" in header
    with urllib.request.urlopen(
        urllib.request.Request(
            sim.url + "/v1/completions",
            data=json.dumps({"prompt": "x", "max_tokens": 2}).encode(),
            headers={"Content-Type": "application/json"},
        ),
        timeout=30,
    ) as r:
        assert "endpoint-load-metrics" not in r.headers


def test_a_batch_of_prompts_numbers_choices_prompt_by_prompt(sim: Proc) -> None:
    url = sim.url + "/v1/completions"
    common = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    alone = [post(url, {"prompt": p, **common})[1]["choices"][0]["text"] for p in ("A b", "C d")]
    status, body = post(url, {"prompt": ["A b", "C d"], "n": 2, **common})
    assert status == 200
    texts = [c["text"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == [alone[0], alone[0], alone[1], alone[1]]  # greedy: n copies agree
    counts = [post(sim.url + "/tokenize", {"prompt": p})[1]["count"] for p in ("A b", "C d")]
    assert body["usage"]["prompt_tokens"] == sum(counts)
    assert body["usage"]["completion_tokens"] == 4 * 6


def test_continuous_usage_stats_put_running_usage_in_every_chunk(sim: Proc) -> None:
    req = urllib.request.Request(
        sim.url + "/v1/completions",
        data=json.dumps(
            {
                "prompt": "x",
                "max_tokens": 5,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True},
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        events = [
            json.loads(line[6:])
            for line in r.read().decode().split("\n\n")
            if line.startswith("data: {")
        ]
    content = [e for e in events if e["choices"]]
    assert [e["usage"]["completion_tokens"] for e in content][-1] == 5
    counts = [e["usage"]["completion_tokens"] for e in content]
    assert counts == sorted(counts) and counts[0] >= 1
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5


def test_a_repeated_prompt_shows_prefix_cache_hits_in_the_metrics(sim: Proc) -> None:
    prompt = list(range(100_500, 100_700))  # 200 tokens: 12 full blocks of 16
    before = metric(sim, "vllm:prefix_cache_hits_total")
    for _ in range(2):
        status, _ = post(sim.url + "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        assert status == 200
    assert metric(sim, "vllm:prefix_cache_hits_total") - before == 12 * 16
    assert metric(sim, "vllm:prompt_tokens_by_source_total", source="local_cache_hit") >= 192
    assert metric(sim, "vllm:cache_config_info", enable_prefix_caching="True") == 1
