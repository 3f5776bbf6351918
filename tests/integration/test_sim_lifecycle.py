"""`seawall sim` start and stop like vLLM: late bind while loading, SIGTERM abort or drain."""

from __future__ import annotations

import signal
import socket
import time

import openai
import pytest

from tests.integration.test_sim_api import post, start_sim
from tests.integration.test_sim_faults import RawStream
from tests.support.procs import ARTIFACTS, free_port, seawall_argv, spawn, wait_http

pytestmark = pytest.mark.integration


def test_sigterm_aborts_in_flight_streams_by_default() -> None:
    proc = start_sim("test_sim_sigterm_abort", "--step-base-ms", "5")
    try:
        stream = RawStream(proc, {"prompt": "x", "max_tokens": 4000, "ignore_eos": True})
        assert stream.read_until(b'data: {"id"', 3)
        proc.signal(signal.SIGTERM)
        assert stream.read_until(b"[DONE]")
        stream.close()
        assert b'"finish_reason":"abort"' in stream.data
        assert proc.wait(timeout=10) == 0
    finally:
        proc.stop()


def test_sigterm_with_shutdown_timeout_drains_in_flight_requests() -> None:
    proc = start_sim("test_sim_sigterm_drain", "--step-base-ms", "20", "--shutdown-timeout", "30")
    try:
        stream = RawStream(proc, {"prompt": "x", "max_tokens": 30, "ignore_eos": True})
        assert stream.read_until(b'data: {"id"', 2)
        proc.signal(signal.SIGTERM)
        assert stream.read_until(b"[DONE]")
        stream.close()
        assert b'"finish_reason":"length"' in stream.data
        assert stream.tokens() == 30
        assert proc.wait(timeout=10) == 0
    finally:
        proc.stop()


def test_a_drain_that_runs_out_of_time_aborts_what_is_left() -> None:
    proc = start_sim(
        "test_sim_sigterm_drain_timeout", "--step-base-ms", "20", "--shutdown-timeout", "0.3"
    )
    try:
        stream = RawStream(proc, {"prompt": "x", "max_tokens": 4000, "ignore_eos": True})
        assert stream.read_until(b'data: {"id"', 2)
        proc.signal(signal.SIGTERM)
        assert stream.read_until(b"[DONE]")
        stream.close()
        assert b'"finish_reason":"abort"' in stream.data
        assert proc.wait(timeout=10) == 0
    finally:
        proc.stop()


def test_load_time_refuses_connections_until_loaded() -> None:
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--port", str(port), "--load-time", "2"),
        ARTIFACTS / "test_sim_load_time" / "sim.log",
        port=port,
    )
    try:
        deadline = time.monotonic() + 15
        while "loading model" not in proc.log() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert "loading model" in proc.log()
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        wait_http(proc.url + "/health", timeout=20, proc=proc)
        assert post(proc.url + "/v1/completions", {"prompt": "x", "max_tokens": 2})[0] == 200
    finally:
        proc.stop()


def test_openai_sdk_error_classes_match_the_status_codes() -> None:
    proc = start_sim("test_sim_sdk_errors", "--step-base-ms", "1")
    try:
        client = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(
                model="sim-model", messages=[{"role": "user", "content": "x"}], max_tokens=99_999
            )
        assert bad.value.status_code == 400
        post(proc.url + "/sim/fault", {"kind": "errors", "rate": 1.0})
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model="sim-model", prompt="x", max_tokens=2)
        post(proc.url + "/sim/fault", {"kind": "clear"})
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(
                model="missing", messages=[{"role": "user", "content": "x"}]
            )
    finally:
        proc.stop()


def test_a_kv_cache_too_small_for_max_model_len_refuses_to_start() -> None:
    port = free_port()
    proc = spawn(
        seawall_argv("sim", "--port", str(port), "--kv-blocks", "10"),
        ARTIFACTS / "test_sim_kv_too_small" / "sim.log",
        port=port,
    )
    assert proc.wait(timeout=20) == 2
    assert "max seq len (4096)" in proc.log()
