"""The load generator's pure parts: stream reading, outcomes and the summary."""

from __future__ import annotations

from seawall.loadgen import (
    RequestResult,
    _StreamState,
    percentile,
    request_body,
    summarise,
)


def result(outcome: str, ttft_s: float | None = 0.1, tokens: int = 10) -> RequestResult:
    return RequestResult(outcome, 200, ttft_s, 1.0, tokens, outcome == "ok")  # type: ignore[arg-type]


def test_percentiles_are_nearest_rank() -> None:
    values = [float(v) for v in range(1, 101)]
    assert percentile(values, 50) == 50.0
    assert percentile(values, 99) == 99.0
    assert percentile([3.0], 99) == 3.0
    assert percentile([], 50) is None


def test_summary_counts_each_outcome_and_rates_tokens_over_the_run() -> None:
    results = [result("ok")] * 6 + [result("failed", None, 0)] + [result("dropped", 0.3, 4)]
    report = summarise(results, duration_s=2.0)
    assert (report.requests, report.ok, report.failed, report.dropped) == (8, 6, 1, 1)
    assert report.tokens == 64 and report.tokens_per_s == 32.0
    assert report.ttft_p50_s == 0.1 and report.ttft_p99_s == 0.3
    assert "dropped 1" in report.line() and "TTFT p50 100ms" in report.line()


def test_a_completion_stream_counts_text_chunks_and_prefers_reported_usage() -> None:
    s = _StreamState()
    assert s.feed(b'{"choices":[{"text":""}]}') is False  # role/empty chunk: no token yet
    assert s.feed(b'{"choices":[{"text":"Hel"}]}') is True
    assert s.feed(b'{"choices":[{"text":"lo"}]}') is False
    assert s.chunks_with_text == 2 and s.usage_tokens is None
    s.feed(b'{"choices":[],"usage":{"completion_tokens":3}}')
    s.feed(b"[DONE]")
    assert s.done and not s.error and s.usage_tokens == 3


def test_a_chat_stream_reads_delta_content() -> None:
    s = _StreamState()
    assert s.feed(b'{"choices":[{"delta":{"role":"assistant"}}]}') is False
    assert s.feed(b'{"choices":[{"delta":{"content":"Hi"}}]}') is True


def test_an_error_event_marks_the_stream_unclean_even_if_done_follows() -> None:
    s = _StreamState()
    s.feed(b'{"choices":[{"text":"a"}]}')
    s.feed(b'{"error":{"message":"engine died","type":"server_error"}}')
    s.feed(b"[DONE]")
    assert s.done and s.error == "error event: engine died"


def test_request_bodies_are_openai_shaped() -> None:
    chat = request_body("m", "p", 8, stream=True, chat=True)
    assert chat["messages"] == [{"role": "user", "content": "p"}]
    assert chat["stream_options"] == {"include_usage": True}
    plain = request_body("m", "p", 8, stream=False, chat=False)
    assert plain == {"model": "m", "max_tokens": 8, "stream": False, "prompt": "p"}
