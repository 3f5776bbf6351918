"""Admission before preemption: a small-KV `seawall sim` fleet under overload.

Without admission the engines accept everything and preempt (recompute) as the KV cache
fills; with admission the gateway holds requests at the door until a replica's KV cache
can take them, so the engines never preempt and every request still completes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from seawall.auth import hash_key
from tests.support.counting_proxy import counting_proxy
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


# ----------------------------------------------------------------------------- adaptive (issue 17)

# 63 usable blocks of 16 tokens; requests of ~40 prompt tokens with max_tokens 300 reserve
# 22 blocks at full length (2 fit), but stop at EOS after 8-30 tokens (4-5 blocks: 12 fit).
EOS_SIM_ARGS = ("--kv-blocks", "64", "--max-model-len", "512", "--step-base-ms", "25")
EOS_MAX_TOKENS = 300


def natural_length(prompt: str, max_tokens: int) -> int:
    """Completion tokens `seawall sim --seed 0` samples for `prompt` at temperature 0 (its
    next token is a pure function of the context), so the test can pick short outputs."""
    from seawall.sim import textgen

    key = textgen.sampling_key(0, 0.0, None)
    h = textgen.hash_tokens(textgen.tokenize(prompt))
    for n in range(1, max_tokens + 1):
        token = textgen.next_token(key, h)
        if token == textgen.EOS_ID:
            return n
        h = textgen.extend_hash(h, token)
    return max_tokens


def short_prompts(count: int) -> list[tuple[str, int]]:
    """Distinct prompts (no prefix-cache sharing) whose outputs stop at EOS in 8-30 tokens."""
    import random

    from seawall.sim import textgen

    rng = random.Random(17)
    words = [w for w in textgen.WORDS if len(w) <= 2]
    out: list[tuple[str, int]] = []
    for _ in range(100_000):
        prompt = "".join(" " + rng.choice(words) for _ in range(40))
        n = natural_length(prompt, EOS_MAX_TOKENS)
        if 8 <= n <= 30:
            out.append((prompt, n))
            if len(out) == count:
                return out
    raise AssertionError("no short prompts found")


def wave(url: str, prompts: list[tuple[str, int]], sim: Proc) -> tuple[list[int], int]:
    """Send every prompt at once (streamed, EOS sampled); return the statuses and the most
    requests the engine ran at once, sampled every 20 ms while the wave lasts."""
    statuses: list[int] = []
    lock = threading.Lock()
    done = threading.Event()
    peak = [0]

    def one(prompt: str) -> None:
        body = {
            "model": MODEL,
            "prompt": prompt,
            "max_tokens": EOS_MAX_TOKENS,
            "temperature": 0,
            "stream": True,
        }
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        ok = r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
        with lock:
            statuses.append(r.status_code if ok else -1)

    def sample() -> None:
        for _ in range(6000):  # bounded: 120 s at 20 ms
            if done.is_set():
                return
            peak[0] = max(peak[0], int(metric_sum(scrape(sim.url), "vllm:num_requests_running")))
            done.wait(0.02)

    sampler = threading.Thread(target=sample)
    sampler.start()
    threads = [threading.Thread(target=one, args=(p,)) for p, _ in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    done.set()
    sampler.join(timeout=10)
    return statuses, peak[0]


def test_adaptive_admission_lets_short_outputs_run_without_preempting(artifacts: Path) -> None:
    """The bug of issue 17: with outputs that stop at EOS far below max_tokens, reserving
    prompt + max_tokens holds the engine to 2 requests at once. The default admission learns
    the lengths from the first completions and then lets the engine run what fits."""
    sim = start_sim(artifacts, *EOS_SIM_ARGS, name="eos")
    gw, admin = gateway(artifacts, [sim], {})
    prompts = short_prompts(24)
    with running(gw, sim):
        # A cold start: the worst case until a few completions, then trusted gradually.
        learn, _ = wave(gw.url, prompts[:12], sim)
        statuses, peak = wave(gw.url, prompts[12:], sim)
        preemptions = metric_sum(scrape(sim.url), "vllm:num_preemptions_total")
        state = httpx.get(
            admin + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()
        metrics = scrape(gw.url)
    assert learn == [200] * 12 and statuses == [200] * 12
    assert preemptions == 0
    assert peak >= 6, f"the engine ran at most {peak} at once"
    # What it learned is the completions' real length (counted from the relayed stream).
    learned = state["limits"]["output_lengths"]
    key = next(k for k in learned if k.startswith(f"{MODEL}/default/default/"))
    mean = sum(n for _, n in prompts) / len(prompts)
    assert abs(learned[key]["expected_tokens"] - mean) < 0.35 * mean
    assert learned[key]["samples"] == 24
    # The controller's state is visible: admin API per replica, and one metric family.
    control = state["replicas"][0]["admission"]
    assert control["mode"] == "adaptive" and control["cause"] and control["why"]
    assert 0.0 <= control["reserve_level"] <= 1.0
    assert metric_sum(metrics, "seawall_admission_reserve_level", replica="r0") >= 0.0
    assert any(k.startswith("seawall_admission_reserve_level{") for k in metrics)


def test_reserve_mode_keeps_todays_worst_case_rule(artifacts: Path) -> None:
    """`admission.mode: reserve` is still there: prompt + max_tokens, 2 at once."""
    sim = start_sim(artifacts, *EOS_SIM_ARGS, name="eos")
    gw, admin = gateway(artifacts, [sim], {"mode": "reserve"})
    prompts = short_prompts(12)
    with running(gw, sim):
        wave(gw.url, prompts[:4], sim)
        statuses, peak = wave(gw.url, prompts[4:], sim)
        state = httpx.get(
            admin + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}
        ).json()
    assert statuses == [200] * 8  # queued at the door (queue_timeout 90), then served
    assert peak <= 2
    assert state["replicas"][0]["admission"] is None


def test_n_choices_count_as_that_many_sequences_against_inflight_max(artifacts: Path) -> None:
    """Issue 13: `n > 1` is served and counted as n sequences. With `inflight_max` at the
    engine's `--max-num-seqs` (what `seawall engine-args` writes), three requests of two
    choices each are 6 sequences for 4 batch slots: the third waits at the gateway, not in
    the engine's queue. Counting requests instead let all three in, and two sequences
    waited in the engine for a whole generation (40 steps of 25 ms)."""
    sim = start_sim(artifacts, "--max-num-seqs", "4", "--step-base-ms", "25", name="n")
    gw, _ = gateway(artifacts, [sim], {"mode": "reserve", "inflight_max": 4})
    body = {"model": MODEL, "prompt": "Tell a long story.", "max_tokens": 40,
            "ignore_eos": True, "stream": True, "n": 2}  # fmt: skip
    statuses: list[int] = []

    def one() -> None:
        r = httpx.post(gw.url + "/v1/completions", json=body, timeout=60)
        ok = r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
        statuses.append(r.status_code if ok else -1)

    with running(gw, sim):
        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        engine = scrape(sim.url)
    assert statuses == [200] * 3  # the third was queued at the door, then served
    sequences = metric_sum(engine, "vllm:request_queue_time_seconds_count")
    queued_s = metric_sum(engine, "vllm:request_queue_time_seconds_sum")
    assert sequences == 6
    # each sequence waited in the engine at most a step or two for its batch slot
    assert queued_s < 6 * 0.1, queued_s


def test_under_overload_clients_take_turns_without_waiting_in_the_gateway(
    artifacts: Path,
) -> None:
    """Issue 17's TTFT goal with taking turns (`admission.turns: hold`, the default): a
    shed tier's clients that were refused twice are owed a turn, and the room a completion
    frees is held for them, so every closed-loop client is served, nothing waits in the
    gateway's queue (a wait there is time to first token), and no engine preempts."""
    sim = start_sim(artifacts, *SIM_ARGS, name="s0")
    port = free_port()
    gw = start_gateway(
        artifacts,
        [sim],
        {
            "tiers": {"default": {"priority": 1}},  # above lowest_priority_to_queue: shed
            "admin": {"enabled": True, "port": port, "token_hash": hash_key(TOKEN)},
            "fleet": {"scrape_interval_s": 0.25, "deep_probe_idle_interval_s": 30},
        },
    )
    clients, seconds = 9, 8.0  # three times what the cache holds
    served = [0] * clients
    held: list[str] = []
    depth = [0.0]
    stop = threading.Event()

    def client(i: int) -> None:
        deadline = time.monotonic() + seconds
        with httpx.Client(timeout=60) as http:
            for _ in range(1000):
                if time.monotonic() >= deadline:
                    return
                r = http.post(gw.url + "/v1/completions", json={**BODY, "prompt": f"{i} " * 40})
                if r.status_code == 429:
                    message = r.json()["error"]["message"]
                    if "held for requests refused before" in message:
                        held.append(message)
                    time.sleep(min(float(r.headers["Retry-After"]), 0.2))
                    continue
                assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
                served[i] += 1

    def sample() -> None:
        while not stop.is_set():
            depth[0] = max(depth[0], metric_sum(scrape(gw.url), "seawall_admission_queue_depth"))
            stop.wait(0.05)

    with running(gw, sim):
        sampler = threading.Thread(target=sample)
        sampler.start()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=seconds + 60)
        stop.set()
        sampler.join(timeout=10)
        preemptions = metric_sum(scrape(sim.url), "vllm:num_preemptions_total")
    assert all(n >= 1 for n in served), f"clients never served: {served}"
    assert depth[0] == 0, "a request waited in the gateway's queue"
    assert held, "no fresh request was refused for a turn held for another"
    assert preemptions == 0


# ------------------------------------------------------------- before the first scrape


@pytest.mark.parametrize("mode", ["adaptive", "reserve"])
def test_a_replica_whose_metrics_have_not_answered_yet_takes_no_more_than_its_cache(
    mode: str, artifacts: Path
) -> None:
    """A burst that arrives before the engine's first scrape has answered (a gateway just
    started, a new leader, an engine whose /metrics is slow under load) waits for it, then
    goes in as the cache allows. Before: a replica without a load yet counted as one
    without /metrics, so the whole burst went to the engine, which preempted."""
    sim = start_sim(artifacts, *SIM_ARGS, name="slowmetrics")
    with counting_proxy(sim.port or 0) as proxy:
        proxy.hold("/metrics")
        port = free_port()
        gw = start_gateway(
            artifacts,
            [],
            {
                "replicas": [{"url": f"http://127.0.0.1:{proxy.port}", "id": "r0", "model": MODEL}],
                "admission": {"mode": mode, "queue_timeout_s": 90, "queue_max": 64},
                "admin": {"enabled": True, "port": port, "token_hash": hash_key(TOKEN)},
                "fleet": {"scrape_interval_s": 0.25, "scrape_timeout_s": 0.5},
            },
            wait_ready=False,
        )
        admin = f"http://127.0.0.1:{port}"

        def replica() -> dict[str, Any]:
            state = httpx.get(
                admin + "/admin/state", headers={"Authorization": f"Bearer {TOKEN}"}
            ).json()
            r: dict[str, Any] = state["replicas"][0]
            return r

        with running(gw, sim):
            wait_until(lambda: replica()["routable"], 20, what="the replica routable")
            assert not (replica().get("load") or {}).get("kv_capacity_tokens")
            statuses: list[int] = []
            burst = threading.Thread(target=lambda: statuses.extend(overload(gw.url, 9)))
            burst.start()  # three times what the cache holds at full length
            # Every request has reached a decision: waiting at the door, or admitted.
            wait_until(
                lambda: (
                    metric_sum(scrape(gw.url), "seawall_admission_queue_depth")
                    + replica()["inflight"]
                    == 9
                ),
                20,
                what="the burst at the gateway",
            )
            reserved = replica()["reserved_kv_blocks"]
            proxy.release()
            burst.join(120)
            preemptions = metric_sum(scrape(sim.url), "vllm:num_preemptions_total")
    assert reserved <= 63, reserved  # the cache's 63 usable blocks
    assert statuses == [200] * 9
    assert preemptions == 0
