"""Each `seawall sim` fault does what it says, seen from outside the process."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_sim_api import get_json, metric, post, start_sim
from tests.support.procs import Proc

pytestmark = pytest.mark.integration


def health_status(proc: Proc) -> int:
    try:
        with urllib.request.urlopen(proc.url + "/health", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def fault(proc: Proc, body: dict[str, Any]) -> None:
    status, answer = post(proc.url + "/sim/fault", body)
    assert status == 200, answer


class RawStream:
    """A streaming completion read off a raw socket, so a reset is visible as such."""

    def __init__(self, proc: Proc, body: dict[str, Any]) -> None:
        payload = json.dumps({**body, "stream": True}).encode()
        self.sock = socket.create_connection(("127.0.0.1", proc.port or 0), timeout=15)
        self.sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        self.data = b""

    def read_until(self, marker: bytes, count: int = 1) -> bool:
        """Read until `marker` was seen `count` times; False if the connection ended first."""
        while self.data.count(marker) < count:
            try:
                chunk = self.sock.recv(65536)
            except (ConnectionResetError, TimeoutError):
                return False
            if not chunk:
                return False
            self.data += chunk
        return True

    def tokens(self) -> int:
        return self.data.count(b'data: {"id"')

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def sim(request: pytest.FixtureRequest) -> Iterator[Proc]:
    proc = start_sim(request.node.name, "--step-base-ms", "5")
    try:
        yield proc
    finally:
        proc.stop()


def test_crash_exits_at_once(sim: Proc) -> None:
    with pytest.raises(OSError):
        post(sim.url + "/sim/fault", {"kind": "crash"}, timeout=5)
    assert sim.wait(timeout=10) == 1


def test_crash_after_tokens_cuts_a_stream_mid_way(sim: Proc) -> None:
    fault(sim, {"kind": "crash", "after_tokens": 5})
    stream = RawStream(sim, {"prompt": "x", "max_tokens": 100, "ignore_eos": True})
    finished = stream.read_until(b"[DONE]")
    stream.close()
    assert not finished
    assert 1 <= stream.tokens() <= 5
    assert sim.wait(timeout=10) == 1


def test_crash_after_seconds_exits_later_not_now(sim: Proc) -> None:
    fault(sim, {"kind": "crash", "after_s": 2.0})
    assert health_status(sim) == 200  # still serving right after the fault is set
    assert sim.wait(timeout=10) == 1


def test_engine_dead_answers_503_and_500_then_exits(sim: Proc) -> None:
    stream = RawStream(sim, {"prompt": "x", "max_tokens": 4000, "ignore_eos": True})
    assert stream.read_until(b"data: ")
    fault(sim, {"kind": "engine_dead", "grace_s": 1.0})
    assert health_status(sim) == 503
    status, body = post(sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert status == 500
    assert body["error"] == {
        "message": "The server had an error while processing your request.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    # the in-flight stream ends with vLLM's mid-stream error event, then [DONE]
    assert stream.read_until(b"[DONE]")
    assert b'data: {"error": {"message": "The server had an error' in stream.data
    stream.close()
    assert sim.wait(timeout=10) == 1  # the watchdog's exit


@pytest.mark.parametrize("running", ["keep", "zero"])
def test_hang_stops_tokens_but_health_stays_up(sim: Proc, running: str) -> None:
    stream = RawStream(sim, {"prompt": "x", "max_tokens": 4000, "ignore_eos": True})
    assert stream.read_until(b"data: ")
    fault(sim, {"kind": "hang", "running": running})
    steps = get_json(sim.url + "/sim/state")["steps"]
    generated = metric(sim, "vllm:generation_tokens_total")
    time.sleep(0.3)  # sixty steps' worth at 5 ms: a live engine would have moved
    assert get_json(sim.url + "/sim/state")["steps"] <= steps + 1
    assert metric(sim, "vllm:generation_tokens_total") <= generated + 1
    assert health_status(sim) == 200
    assert metric(sim, "vllm:num_requests_running") == (1 if running == "keep" else 0)
    fault(sim, {"kind": "clear"})
    before = stream.tokens()
    assert stream.read_until(b'data: {"id"', before + 3)  # tokens flow again
    stream.close()


def test_slow_multiplies_the_step_time(sim: Proc) -> None:
    fault(sim, {"kind": "slow", "factor": 8})
    status, _ = post(
        sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 6, "ignore_eos": True}
    )
    assert status == 200
    state = get_json(sim.url + "/sim/state")
    assert state["slow_factor"] == 8
    assert state["last_step_cost_s"] == pytest.approx(8 * (0.005 + 0.0001))
    # every inter-token gap lasted at least one slowed step
    itl_sum = metric(sim, "vllm:inter_token_latency_seconds_sum")
    itl_count = metric(sim, "vllm:inter_token_latency_seconds_count")
    assert itl_count == 5 and itl_sum / itl_count >= 0.9 * 8 * 0.005


def test_errors_fail_requests_before_the_first_token_or_mid_stream(sim: Proc) -> None:
    fault(sim, {"kind": "errors", "rate": 1.0})
    status, body = post(sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 3})
    assert status == 500 and body["error"]["type"] == "InternalServerError"

    fault(sim, {"kind": "errors", "rate": 1.0, "when": "mid_stream", "after_tokens": 3})
    stream = RawStream(sim, {"prompt": "x", "max_tokens": 50, "ignore_eos": True})
    assert stream.read_until(b"[DONE]")
    stream.close()
    assert stream.tokens() == 3
    assert b'data: {"error": {' in stream.data
    assert metric(sim, "vllm:request_success_total", finished_reason="error") == 2

    fault(sim, {"kind": "errors", "rate": 0.5})
    statuses = [
        post(sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] for _ in range(40)
    ]
    assert 5 <= statuses.count(500) <= 35 and statuses.count(200) + statuses.count(500) == 40

    fault(sim, {"kind": "clear"})
    assert post(sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 1})[0] == 200


def test_dcgm_signals_can_be_set_and_cleared(sim: Proc) -> None:
    def dcgm() -> str:
        with urllib.request.urlopen(sim.url + "/dcgm/metrics", timeout=5) as r:
            return str(r.read().decode())

    text = dcgm()
    assert "# TYPE DCGM_FI_DEV_XID_ERRORS gauge" in text
    assert 'DCGM_FI_DEV_XID_ERRORS{gpu="0",UUID="GPU-' in text
    assert text.split("DCGM_FI_DEV_XID_ERRORS{")[1].split("}")[1].split()[0] == "0"
    fault(sim, {"kind": "dcgm", "xid": 79, "ecc_dbe": 2, "row_remap_failure": 1})
    text = dcgm()
    assert "} 79\n" in text.split("DCGM_FI_DEV_XID_ERRORS{")[1]
    assert "} 2\n" in text.split("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{")[1]
    assert "} 1\n" in text.split("DCGM_FI_DEV_ROW_REMAP_FAILURE{")[1]
    fault(sim, {"kind": "clear"})
    assert "} 0\n" in dcgm().split("DCGM_FI_DEV_XID_ERRORS{")[1]


def test_a_bad_fault_body_is_a_400(sim: Proc) -> None:
    assert post(sim.url + "/sim/fault", {"kind": "meteor"})[0] == 400
    assert post(sim.url + "/sim/fault", {"kind": "slow"})[0] == 400
    assert post(sim.url + "/sim/fault", {"kind": "load_time", "seconds": 1})[0] == 400


def test_faults_given_at_start_are_in_force(request: pytest.FixtureRequest) -> None:
    proc = start_sim(
        request.node.name,
        "--dcgm-gpus",
        "2",
        "--fault",
        '{"kind":"dcgm","gpu":1,"xid":95,"recovery_action":1}',
        "--fault",
        '{"kind":"dcgm","xid":48}',
        "--fault",
        '{"kind":"slow","factor":3}',
    )
    try:
        assert get_json(proc.url + "/sim/state")["slow_factor"] == 3
        with urllib.request.urlopen(proc.url + "/dcgm/metrics", timeout=5) as r:
            text = r.read().decode()
        values = {
            (s.name, s.labels["gpu"]): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }
        assert values["DCGM_FI_DEV_XID_ERRORS", "0"] == 48
        assert values["DCGM_FI_DEV_XID_ERRORS", "1"] == 95
        assert values["DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION", "1"] == 1
        assert values["DCGM_FI_DEV_GET_GPU_RECOVERY_ACTION", "0"] == 0
        assert post(proc.url + "/sim/fault", {"kind": "dcgm", "gpu": 2, "xid": 1})[0] == 400
    finally:
        proc.stop()


def test_in_flight_requests_keep_running_while_faults_change(sim: Proc) -> None:
    """A fault change does not disturb requests it does not target."""
    results: list[tuple[int, Any]] = []
    thread = threading.Thread(
        target=lambda: results.append(
            post(sim.url + "/v1/completions", {"prompt": "x", "max_tokens": 40, "ignore_eos": True})
        )
    )
    thread.start()
    fault(sim, {"kind": "dcgm", "xid": 13})
    fault(sim, {"kind": "slow", "factor": 1.5})
    thread.join(timeout=30)
    assert results and results[0][0] == 200
    assert results[0][1]["usage"]["completion_tokens"] == 40


def test_queue_limits_answer_503_and_count_the_rejection(
    request: pytest.FixtureRequest,
) -> None:
    proc = start_sim(
        request.node.name,
        "--max-num-seqs",
        "1",
        "--max-num-queued-reqs",
        "1",
        "--step-base-ms",
        "20",
    )
    try:
        running = RawStream(proc, {"prompt": "x", "max_tokens": 4000, "ignore_eos": True})
        assert running.read_until(b"data: ")
        waiting = RawStream(proc, {"prompt": "y", "max_tokens": 5})
        deadline = time.monotonic() + 10
        while not get_json(proc.url + "/sim/state")["waiting"] and time.monotonic() < deadline:
            time.sleep(0.01)
        status, body = post(proc.url + "/v1/completions", {"prompt": "z", "max_tokens": 5})
        assert status == 503
        assert body["error"]["message"].startswith("The engine is currently busy")
        rejected = metric(proc, "vllm:admission_rejections_total", reason="max_num_queued_reqs")
        assert rejected == 1
        running.close()
        assert waiting.read_until(b"[DONE]")  # the queued request is served once room frees
        waiting.close()
    finally:
        proc.stop()
