"""The real llama.cpp `llama-server` on loopback, serving a tiny random-weight model.

The binary is built once per machine by `tools/llamacpp/build.py` (`./dev llamacpp`; CI
builds it in `./dev check`). Locally a test that needs it skips, saying how to build it;
in CI it fails, because `.ci/run` must have built it. The model is written per test
session by `tools/llamacpp/make_tiny_gguf.py` (a second or so; nothing downloaded).

Every server gets `--metrics` (unless a test asks otherwise) and `--slots` (what the
fleet monitor and the tests read), a few slots, one compute thread (the machine is
shared), and `--ignore-eos`, so that a random model runs every request to `max_tokens`.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import signal
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import openai
import pytest

from tests.support.fleet import metric_sum, scrape, start_gateway
from tests.support.procs import REPO, Proc, bound_port, spawn, wait_http

MODEL = "tiny-llama"  # the alias llama-server serves the tiny model under
TOOLS = REPO / "tools" / "llamacpp"


def _tool(name: str) -> ModuleType:
    """A script under tools/llamacpp, imported by path (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_seawall_llamacpp_{name}", TOOLS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def require_llama_server() -> str:
    """Path of the built `llama-server`: skips locally when absent, fails in CI."""
    build = _tool("build")
    if build.built():
        return str(build.binary_path())
    reason = (
        f"llama-server is not built ({build.binary_path()}); build it once with "
        "`./dev llamacpp` (~5-15 min on 2 cores, cached outside the clone)"
    )
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; .ci/run must build it")
    pytest.skip(reason)


def make_model(path: Path, **shape: int) -> Path:
    pytest.importorskip("gguf", reason="the gguf package is in the dev extras: ./dev setup")
    written: Path = _tool("make_tiny_gguf").write(path, **shape)
    return written


class LlamaServer:
    """One llama-server process. `stop()` is idempotent and resumes a stopped process
    first, so a test that SIGSTOPs it cannot leave it behind."""

    def __init__(self, proc: Proc, slots: int, ctx_per_slot: int) -> None:
        self.proc = proc
        self.slots = slots
        self.ctx_per_slot = ctx_per_slot

    @property
    def url(self) -> str:
        return self.proc.url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def signal(self, sig: int) -> None:
        self.proc.signal(sig)

    def alive(self) -> bool:
        return self.proc.alive()

    def stop(self) -> None:
        if self.proc.alive():
            self.proc.signal(signal.SIGCONT)
        self.proc.stop(timeout=5.0)

    def log(self) -> str:
        return self.proc.log()

    def get_json(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            return json.loads(r.read())

    def post_json(self, path: str, body: dict[str, Any], timeout: float = 10.0) -> Any:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())

    def metrics(self) -> dict[str, float]:
        """`llamacpp:*` samples (llama.cpp's /metrics has no labels)."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.partition(" ")
                out[name] = float(value)
        return out

    def busy_slots(self) -> int:
        return sum(1 for s in self.get_json("/slots") if s.get("is_processing"))

    def tokenize(self, text: str) -> list[int]:
        tokens: list[int] = self.post_json("/tokenize", {"content": text})["tokens"]
        return tokens


_SEQ = itertools.count()


def start_llama_server(
    log_dir: Path,
    model: Path,
    *extra: str,
    name: str = "llama",
    slots: int = 4,
    ctx_per_slot: int = 4096,
    metrics: bool = True,
) -> LlamaServer:
    """A llama-server on 127.0.0.1, ready to serve. It binds port 0 and logs the port it
    got (`llama_server: listening on http://127.0.0.1:PORT`), so no port is raced for."""
    binary = require_llama_server()
    argv = [
        binary,
        "--model",
        str(model),
        "--alias",
        MODEL,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        *(["--metrics"] if metrics else []),
        "--slots",
        "--parallel",
        str(slots),
        "--ctx-size",
        str(slots * ctx_per_slot),
        "--threads",
        "1",
        "--threads-batch",
        "1",
        "--ignore-eos",
        "--no-webui",
        "--no-warmup",
        *extra,
    ]
    proc = spawn(argv, log_dir / f"{name}-{next(_SEQ)}.log")
    server = LlamaServer(proc, slots, ctx_per_slot)
    try:
        bound_port(proc, b"llama_server: listening")
        # /health answers 503 while the model loads, 200 once slots are ready.
        wait_http(server.url + "/health", timeout=60, proc=proc)
    except BaseException:
        server.stop()
        raise
    return server


# Liveness fast enough that a dead or hung replica leaves routing within a second; deep
# probes rare, so that only the behaviour under test moves a replica's state.
FLEET_FAST: dict[str, Any] = {
    "liveness_interval_s": 0.25,
    "liveness_timeout_s": 0.5,
    "scrape_interval_s": 0.25,
    "scrape_timeout_s": 0.5,
    "deep_probe_idle_interval_s": 60,
    "deep_probe_interval_s": 60,
}

PROMPT = "The sea wall at dawn"


@dataclass
class Fleet:
    """llama-server replicas behind one `seawall serve`, and an openai client for it."""

    artifacts: Path
    model: Path
    servers: list[LlamaServer] = field(default_factory=list)
    gateway: Proc | None = None
    _client: openai.OpenAI | None = None

    def start(self, n: int, config: dict[str, Any] | None = None, **server: Any) -> None:
        """`n` replicas `l0..`, then the gateway; `config` may set `engine` for all."""
        for i in range(n):
            self.servers.append(
                start_llama_server(self.artifacts, self.model, name=f"llama{i}", **server)
            )
        cfg = dict(config or {})
        cfg.setdefault("fleet", FLEET_FAST)
        engine = cfg.pop("engine", "llamacpp")
        cfg["replicas"] = [
            {"url": s.url, "id": f"l{i}", "node": f"node-{i}", "model": MODEL, "engine": engine}
            for i, s in enumerate(self.servers)
        ]
        self.gateway = start_gateway(self.artifacts, [], cfg)

    @property
    def client(self) -> openai.OpenAI:
        if self._client is None:
            assert self.gateway is not None
            self._client = openai.OpenAI(
                base_url=f"{self.gateway.url}/v1", api_key="unused", max_retries=0, timeout=120
            )
        return self._client

    def gw_metrics(self) -> dict[str, float]:
        assert self.gateway is not None
        return scrape(self.gateway.url)

    def ready(self, replica: str) -> bool:
        return metric_sum(self.gw_metrics(), "seawall_replica_ready", replica=replica) == 1

    def state(self, replica: str) -> str:
        m = self.gw_metrics()
        for key, value in m.items():
            ours = key.startswith("seawall_replica_state{") and f'replica="{replica}"' in key
            if ours and value == 1:
                return key.split('state="', 1)[1].split('"', 1)[0]
        return "unknown"

    def restarts(self) -> float:
        return metric_sum(self.gw_metrics(), "seawall_replica_restarts_total")

    def stop(self) -> None:
        if self._client is not None:
            self._client.close()
        if self.gateway is not None:
            self.gateway.stop()
        for s in self.servers:
            s.stop()


@dataclass
class Outcome:
    """How one background request ended, as the client saw it."""

    text: str = ""
    chunks: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    usage: Any = None
    error: Exception | None = None
    done: threading.Event = field(default_factory=threading.Event)


def in_background(
    client: openai.OpenAI, n: int, max_tokens: int, *, stream: bool = True, **extra: Any
) -> list[Outcome]:
    """`n` completion requests, each on its own thread; read an Outcome after `done`."""
    outcomes = [Outcome() for _ in range(n)]

    def one(out: Outcome) -> None:
        try:
            if stream:
                for chunk in client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=max_tokens, stream=True, **extra
                ):
                    out.chunks.append(chunk)
                    if chunk.usage is not None:
                        out.usage = chunk.usage
                    if chunk.choices:
                        out.text += chunk.choices[0].text
                        out.finish_reason = chunk.choices[0].finish_reason or out.finish_reason
            else:
                whole = client.completions.create(
                    model=MODEL, prompt=PROMPT, max_tokens=max_tokens, **extra
                )
                out.text, out.usage = whole.choices[0].text, whole.usage
                out.finish_reason = whole.choices[0].finish_reason
        except Exception as e:
            out.error = e
        finally:
            out.done.set()

    for out in outcomes:
        threading.Thread(target=one, args=(out,), daemon=True).start()
    return outcomes


def wait_all(outcomes: list[Outcome], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for out in outcomes:
        assert out.done.wait(max(0.0, deadline - time.monotonic())), "a request never ended"


def tokens_lasting(server: LlamaServer, seconds: float, concurrency: int) -> int:
    """max_tokens that keeps `concurrency` requests on `server` busy for about `seconds`.

    Measured, not assumed: the tiny model's speed depends on the machine and its load, and
    a test about long requests must not pass because its requests happened to be short.
    """
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 64}
    times: list[float] = []

    def one() -> None:
        t0 = time.monotonic()
        server.post_json("/v1/completions", body)
        times.append(time.monotonic() - t0)

    threads = [threading.Thread(target=one) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    per_token_s = max(times) / 64
    wanted = int(seconds / per_token_s)
    # A slot holds the prompt and every generated token; past that llama.cpp stops early.
    room = server.ctx_per_slot - 256
    if wanted > room:
        pytest.fail(f"{seconds}s of tokens is {wanted}, more than a slot holds ({room})")
    return max(64, wanted)
