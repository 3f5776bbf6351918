"""Helpers for the adversarial suite (`tests/integration/test_hostile_*.py`).

Each helper observes what a user of the gateway would notice: the status line and the
JSON shape of an answer, whether another tenant's long stream arrives intact, how long
that tenant waits for its first token, and whether the gateway process gives back the
memory and descriptors a hostile client made it take. Raw sockets are used where a
well-behaved client library would refuse to send the bytes a hostile client sends.

Everything talks to 127.0.0.1 only, and every loop is bounded in count and time.
"""

from __future__ import annotations

import contextlib
import json
import resource
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.fleet import MODEL
from tests.support.procs import Proc

# ----------------------------------------------------------------------------- raw HTTP


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]  # lower-cased names; the last value wins
    body: bytes
    closed: bool  # the server closed the connection after this response

    def json(self) -> Any:
        return json.loads(self.body)


def parse_responses(data: bytes) -> list[RawResponse]:
    """Every complete HTTP/1.1 response in `data` (Content-Length framed, or chunked)."""
    out: list[RawResponse] = []
    while data:
        head, sep, rest = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
        if headers.get("transfer-encoding", "").lower() == "chunked":
            body = b""
            while True:
                size_line, _, rest = rest.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                body, rest = body + rest[:size], rest[size + 2 :]
                if size == 0:
                    break
        else:
            length = int(headers.get("content-length", "0"))
            body, rest = rest[:length], rest[length:]
        out.append(RawResponse(status, headers, body, False))
        data = rest
    return out


def raw_exchange(
    port: int, payload: bytes | list[bytes], timeout_s: float = 10.0, pause_s: float = 0.0
) -> tuple[list[RawResponse], bool]:
    """Send `payload` (pieces with `pause_s` between them) and read until the server
    closes or `timeout_s` passes. Returns the parsed responses and whether it closed."""
    pieces = payload if isinstance(payload, list) else [payload]
    data = b""
    closed = False
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        try:
            for i, piece in enumerate(pieces):
                if i and pause_s:
                    time.sleep(pause_s)
                sock.sendall(piece)
        except OSError:
            closed = True  # the server may refuse and close before everything is sent
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            except OSError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            data += chunk
    responses = parse_responses(data)
    if responses and closed:
        responses[-1].closed = True
    return responses, closed


def request_bytes(
    path: str = "/v1/completions",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    method: str = "POST",
) -> bytes:
    head = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    all_headers = {"Content-Type": "application/json", **(headers or {})}
    if body or method == "POST":
        all_headers.setdefault("Content-Length", str(len(body)))
    head += [f"{k}: {v}" for k, v in all_headers.items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def assert_openai_error(r: RawResponse | httpx.Response, status: int) -> dict[str, Any]:
    """The status, a JSON content type and exactly the OpenAI error keys."""
    code = r.status if isinstance(r, RawResponse) else r.status_code
    body = r.body if isinstance(r, RawResponse) else r.content
    ctype = r.headers.get("content-type", "")
    assert code == status, (code, body[:300])
    assert ctype.startswith("application/json"), (ctype, body[:300])
    err: dict[str, Any] = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


# ------------------------------------------------------------------- process resources


def fd_count(pid: int) -> int:
    return len(list(Path(f"/proc/{pid}/fd").iterdir()))


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for {pid}")


def fd_soft_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError(f"no open-files limit for {pid}")


def raise_own_fd_limit(want: int) -> int:
    """Raise this test process's soft descriptor limit toward `want` (up to the hard
    limit), for floods that hold thousands of sockets. Returns the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def wait_for(
    predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.05
) -> float:
    """Poll until `predicate()`; seconds waited. Bounded: fails after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(interval_s)
    return time.monotonic() - start


@contextlib.contextmanager
def resources_return(pid: int, settle_s: float = 20.0, fd_slack: int = 8) -> Iterator[None]:
    """Assert that the process's descriptor count and RSS come back to where they started
    once the block is over (RSS within 10% + 8 MiB: allocators keep some arenas)."""
    fds_before, rss_before = fd_count(pid), rss_kib(pid)
    yield
    wait_for(
        lambda: fd_count(pid) <= fds_before + fd_slack,
        settle_s,
        f"descriptors back to {fds_before} (now {fd_count(pid)})",
    )
    limit_kib = rss_before * 1.10 + 8 * 1024
    wait_for(
        lambda: rss_kib(pid) <= limit_kib,
        settle_s,
        f"RSS back within 10% + 8 MiB of {rss_before} KiB (now {rss_kib(pid)} KiB)",
    )


# ------------------------------------------------------------------------ a bystander


@dataclass
class StreamResult:
    status: int
    ttft_s: float | None
    text_chunks: int
    finish_reason: str | None
    done: bool
    completion_tokens: int | None
    error: str = ""


def stream_completion(
    url: str,
    key: str | None,
    max_tokens: int,
    prompt: str = "the bystander",
    timeout_s: float = 60.0,
) -> StreamResult:
    """One streamed completion; what its user sees: TTFT, every chunk, [DONE], usage."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    ttft: float | None = None
    chunks = 0
    finish: str | None = None
    done = False
    usage: int | None = None
    try:
        with (
            httpx.Client(timeout=timeout_s) as client,
            client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r,
        ):
            if r.status_code != 200:
                r.read()
                return StreamResult(r.status_code, None, 0, None, False, None, r.text[:300])
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    continue
                event = json.loads(data)
                if event.get("usage"):
                    usage = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    if choice.get("text"):
                        if ttft is None:
                            ttft = time.monotonic() - started
                        chunks += 1
                    finish = choice.get("finish_reason") or finish
            return StreamResult(200, ttft, chunks, finish, done, usage)
    except httpx.HTTPError as e:
        return StreamResult(0, ttft, chunks, finish, done, usage, f"{type(e).__name__}: {e}")


def assert_intact(result: StreamResult, max_tokens: int) -> None:
    """A long stream as its user expects it: every token, a clean finish, [DONE]."""
    assert result.status == 200, result
    assert result.done and result.finish_reason == "length", result
    assert result.completion_tokens == max_tokens, result


@dataclass
class Bystander:
    """Another tenant's long stream running in a thread while the attack runs."""

    url: str
    key: str | None
    max_tokens: int = 400
    result: StreamResult | None = None
    _thread: threading.Thread | None = field(default=None, repr=False)

    def start(self) -> Bystander:
        def run() -> None:
            self.result = stream_completion(self.url, self.key, self.max_tokens, timeout_s=90)

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        return self

    def finish(self, timeout_s: float = 90.0) -> StreamResult:
        assert self._thread is not None
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "the bystander's stream never ended"
        assert self.result is not None
        return self.result


def ttft_samples(url: str, key: str | None, count: int = 9) -> list[float]:
    """TTFT of `count` short streams in a row (the bystander's experience). Nine, not
    five: under CI's three workers on two cores, a second of another worker's load made
    three of five samples slow once (a median of 154 ms against the 150 ms bound)."""
    out: list[float] = []
    for _ in range(count):
        r = stream_completion(url, key, max_tokens=4, timeout_s=30)
        assert r.status == 200 and r.ttft_s is not None, r
        out.append(r.ttft_s)
    return out


def assert_ttft_within(baseline: list[float], loaded: list[float], factor: float) -> None:
    """The bystander's median TTFT under attack stays within `factor` of unloaded (with
    a 50 ms floor: loopback TTFTs of a few ms would make any factor meaningless)."""
    base = max(statistics.median(baseline), 0.05)
    assert statistics.median(loaded) <= base * factor, (baseline, loaded)


def log_of(proc: Proc) -> str:
    return proc.log()
