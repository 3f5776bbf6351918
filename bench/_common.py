"""Shared helpers for the benchmarks in bench/: processes, CPU time, percentiles, tables,
and a streaming load driver that runs in its own process.

    python bench/_common.py drive --url http://127.0.0.1:8080 --model sim-model \\
        --concurrency 100 --requests 2000 --max-tokens 64 [--route chat] [--time-limit 120]

The driver prints one JSON object on stdout: per-request TTFT and completion times (of
the requests that finished), counts of ok / failed requests, streamed token chunks and a
sample of errors. It is bounded: it sends at most `--requests` requests, stops opening
new ones at `--time-limit`, and gives every request `--request-timeout` seconds.

TTFT is measured in the client from just before the request is sent to the arrival of
the first chunk that carries content text (a role-only or empty first chunk, as chat
streams and some proxies send, does not count).
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- processes


def seawall_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a `seawall` child: this checkout's code, unbuffered logs."""
    return {**os.environ, "PYTHONPATH": str(REPO / "src"), "PYTHONUNBUFFERED": "1", **(extra or {})}


def sim_argv(port: int | str, model: str, *extra: str) -> list[str]:
    """`seawall sim` on 127.0.0.1:`port` serving `model` (a "{port}" template is kept)."""
    return [
        sys.executable, "-m", "seawall", "sim", "--host", "127.0.0.1", "--port", str(port),
        "--model", model, *extra,
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


_LIVE: dict[int, Proc] = {}  # by pid: stopped at exit, and on SIGTERM or SIGHUP


def _stop_live() -> None:
    for p in list(_LIVE.values()):
        p.stop(timeout=5.0)


def _exit_on_signal(signum: int, _frame: object) -> None:
    # SystemExit unwinds the benchmark (its `finally` blocks stop what they started) and
    # then runs `atexit`, which stops anything still alive. Without it a benchmark killed
    # with SIGTERM left its sims and gateways running: each Proc is in its own session, so
    # the signal never reaches them.
    raise SystemExit(128 + signum)


_exit_hooked = False


def _stop_children_on_exit() -> None:
    """Once, at the first child started (a benchmark's own helper processes, such as the
    load driver, keep the default handlers)."""
    global _exit_hooked
    if _exit_hooked:
        return
    _exit_hooked = True
    atexit.register(_stop_live)
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) is signal.SIG_DFL:
            signal.signal(sig, _exit_on_signal)


class Proc:
    """A child process in its own session, logging to a file; `stop()` is idempotent.
    Stopped when the benchmark exits, however it exits short of SIGKILL."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        port: int | None = None,
    ) -> None:
        self.name = name
        self.port = port
        self.argv = list(argv)
        self.log_path = log_path
        _stop_children_on_exit()
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = log_path.open("wb")
        self.popen = subprocess.Popen(
            self.argv,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
        _LIVE[self.popen.pid] = self

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM this process's own group (it was started in a new session), then KILL."""
        if self.alive():
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)  # stragglers in the group
        except (ProcessLookupError, PermissionError):
            pass
        if self.alive():
            self.popen.wait(timeout=5)
        self._log.close()
        _LIVE.pop(self.popen.pid, None)

    def tail(self, n: int = 20) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


PEERS = REPO / "bench" / ".peers"  # throwaway venvs of the peers benchmarks run beside


def peer_venv(name: str, spec: str, binary: str) -> Path:
    """bench/.peers/<name>/bin/<binary>, creating the venv and installing `spec` once."""
    venv = PEERS / name
    exe = venv / "bin" / binary
    if exe.exists():
        return exe
    print(f"installing {spec} into {venv} ...", flush=True)
    PEERS.mkdir(parents=True, exist_ok=True)
    ignore = PEERS / ".gitignore"
    if not ignore.exists():  # keep the venvs out of git and out of ruff's reach
        ignore.write_text("# throwaway peer venvs of bench/bench_gateway.py; never committed\n*\n")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", spec], check=True, timeout=1800)
    return exe


def peer_version(name: str, dist: str) -> str:
    found = sorted((PEERS / name).glob(f"lib/python*/site-packages/{dist}-*.dist-info"))
    return found[-1].name.removeprefix(f"{dist}-").removesuffix(".dist-info") if found else "?"


def start_vllm_router(
    upstreams: list[str], port: int, log: Path, policy: str = "round_robin"
) -> tuple[Proc, str]:
    """vllm-router (PyPI, its own venv under bench/.peers) on 127.0.0.1:`port` in front of
    `upstreams`, ready; and its version."""
    exe = peer_venv("vllm-router", "vllm-router", "vllm-router")
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--worker-urls", *upstreams, "--policy", policy]
    argv += ["--log-level", "warning", "--prometheus-port", str(free_port())]
    proc = Proc("vllm-router", argv, log, seawall_env({"RUST_LOG": "warn"}), PEERS, port)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 120, proc)
    except BaseException:
        proc.stop()  # not left behind when it does not come up
        raise
    return proc, peer_version("vllm-router", "vllm_router")


def start_plain_gateway(
    upstreams: list[str],
    log: Path,
    src: Path | None = None,
    name: str = "gateway",
    python: str = sys.executable,
    launcher: Sequence[str] = ("-m", "seawall"),
    env: dict[str, str] | None = None,
    config: Path | None = None,
) -> Proc:
    """`seawall serve` on a free 127.0.0.1 port in front of `upstreams`, with nothing but
    `--replica` (no access log), ready with a usable replica. `config`: a config file for
    `--config`. `src`: another version's `src/` to run (see `baseline_src`), instead of
    this checkout's.
    `python`: the interpreter (another one needs Seawall's dependencies installed).
    `launcher`: what `python` runs in place of `-m seawall` (a script taking Seawall's
    command line, such as `stage_gateway.py`); `env`: more environment for it."""
    port = free_port()
    argv = [python, *launcher, "serve", "--port", str(port), "--no-access-log"]
    if config is not None:
        argv += ["--config", str(config)]
    for u in upstreams:
        argv += ["--replica", u]
    extra = {**(env or {}), **({"PYTHONPATH": str(src)} if src is not None else {})}
    proc = Proc(name, argv, log, seawall_env(extra), REPO, port)
    wait_http(f"http://127.0.0.1:{port}/readyz?fleet=1", 30, proc)
    return proc


def baseline_src(rev: str) -> Path:
    """Seawall's source at `rev`, exported once under bench/.peers/ (git archive), so an
    earlier version runs beside this one in the same run (a benchmark's `--baseline`)."""
    full = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", rev],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dest = PEERS / f"seawall-{full}"
    if not (dest / "src" / "seawall").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(
            ["git", "-C", str(REPO), "archive", full, "src"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    return dest / "src"


# The floors under a proxy's hop (bench_hop.py, bench_guidellm.py --floor), each a script
# taking LISTEN_PORT UPSTREAM_PORT: `tcp_relay.py` relays bytes and parses nothing (what
# one more process costs); `py_proxy.py` parses HTTP and JSON and does nothing else (the
# floor under a gateway written in Python); `aio_proxy.py` does the same on aiohttp's
# server (the floor under a gateway on aiohttp, as Seawall is).
FLOORS = ("tcp_relay", "py_proxy", "aio_proxy")


def start_floor(script: str, upstream_port: int, log: Path) -> Proc:
    """`bench/<script>.py` (one of `FLOORS`) on a free 127.0.0.1 port in front of
    127.0.0.1:`upstream_port`, ready; its process is named as its script, with a dash."""
    port = free_port()
    argv = [sys.executable, str(REPO / "bench" / f"{script}.py"), str(port), str(upstream_port)]
    proc = Proc(script.replace("_", "-"), argv, log, seawall_env(), REPO, port)
    wait_http(f"http://127.0.0.1:{port}/health", 30, proc)
    return proc


def wait_http(url: str, timeout: float, proc: Proc | None = None, ok: int = 200) -> None:
    """Poll `url` until it answers `ok`, or raise after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{proc.name} exited early:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == ok:
                    return
                last = f"status {r.status}"
        except urllib.error.HTTPError as e:
            last = f"status {e.code}"
        except OSError as e:
            last = str(e)
        time.sleep(0.1)
    tail = f"\n{proc.tail()}" if proc is not None else ""
    raise RuntimeError(f"{url} not ready after {timeout:g}s ({last}){tail}")


# ----------------------------------------------------------------------------- CPU


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # fields after the ")" that closes the command name: [0]=state [1]=ppid ...
    return raw.rsplit(")", 1)[1].split()


def descendants(pid: int) -> list[int]:
    """Live descendants of `pid` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def cpu_seconds(pid: int, tree: bool = True) -> float:
    """utime + stime of `pid`, plus its reaped children's (cutime + cstime), plus, with
    `tree`, the same for every live descendant (worker processes a proxy forks)."""
    total = 0
    for p in [pid, *(descendants(pid) if tree else [])]:
        fields = _stat(p)
        if fields is None:
            continue
        total += int(fields[11]) + int(fields[12]) + int(fields[13]) + int(fields[14])
    return total / CLK_TCK


def peak_rss_mib(pid: int) -> float:
    """The peak resident memory (VmHWM) of `pid` and its live descendants, summed, in MiB:
    an upper bound on the tree's peak when its processes peak at different moments."""
    total_kib = 0
    for p in [pid, *descendants(pid)]:
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                total_kib += int(line.split()[1])
    return total_kib / 1024.0


def machine_context() -> str:
    load1, load5, load15 = os.getloadavg()
    cores = os.cpu_count()
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cores={cores} ({model}) load average={load1:.2f} {load5:.2f} {load15:.2f}"


# ----------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], p: float) -> float:
    """Linear-interpolated percentile (p in 0..100); NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    k = (len(s) - 1) * p / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain aligned table: first column left-aligned, the rest right-aligned."""
    cells = [[str(h) for h in headers], *([_cell(v) for v in row] for row in rows)]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    for n, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])]
        parts += [c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)]
        print("  ".join(parts))
        if n == 0:
            print("  ".join("-" * w for w in widths))


def _cell(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return "-"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:,.0f}"
    return str(v)


# ----------------------------------------------------------------------------- load driver


def _first_text(data: bytes) -> bool:
    """Whether an SSE `data:` payload carries non-empty content text."""
    try:
        obj = json.loads(data)
    except ValueError:
        return False
    for choice in obj.get("choices") or ():
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            return True
    return False


def _content_chunks(data: bytes) -> int:
    """Streamed tokens in a piece of SSE: chunks with non-empty content or text (one token
    each in vLLM's and the proxies' shapes; role-only and usage chunks do not count)."""
    return (
        data.count(b'"content":"')
        - data.count(b'"content":""')
        + data.count(b'"text":"')
        - data.count(b'"text":""')
    )


async def drive(
    urls: Sequence[str],
    model: str,
    route: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    time_limit: float,
    request_timeout: float,
) -> dict[str, Any]:
    import aiohttp

    path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if route == "chat":
        body["messages"] = [{"role": "user", "content": "Benchmark prompt with a few words."}]
    else:
        body["prompt"] = "Benchmark prompt with a few words."
    payload = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer sk-bench"}

    deadline = time.monotonic() + time_limit
    next_index = 0
    ttfts: list[float] = []
    totals: list[float] = []
    chunks = 0
    ok = 0
    failed = 0
    errors: dict[str, int] = {}

    def fail(reason: str) -> None:
        nonlocal failed
        failed += 1
        errors[reason] = errors.get(reason, 0) + 1

    async def one(session: aiohttp.ClientSession, url: str) -> None:
        nonlocal chunks, ok
        started = time.perf_counter()
        ttft: float | None = None
        n = 0
        done = False
        buf = b""
        try:
            async with asyncio.timeout(request_timeout):
                async with session.post(url + path, data=payload, headers=headers) as r:
                    if r.status != 200:
                        text = (await r.read())[:120].decode(errors="replace")
                        fail(f"http {r.status}: {text}")
                        return
                    async for data in r.content.iter_any():
                        if ttft is None:
                            buf += data
                            while ttft is None and b"\n\n" in buf:
                                event, buf = buf.split(b"\n\n", 1)
                                line = event.strip()
                                if line.startswith(b"data: {") and _first_text(line[6:]):
                                    ttft = time.perf_counter() - started
                        n += _content_chunks(data)
                        if b"data: [DONE]" in data:
                            done = True
        except TimeoutError:
            fail("timeout")
            return
        except (aiohttp.ClientError, ConnectionError) as e:
            fail(f"{type(e).__name__}")
            return
        if ttft is None or not done:
            fail("no token" if ttft is None else "no [DONE]")
            return
        ok += 1
        chunks += n
        ttfts.append(ttft)
        totals.append(time.perf_counter() - started)

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal next_index
        while next_index < requests and time.monotonic() < deadline:
            i = next_index
            next_index += 1
            await one(session, urls[i % len(urls)])

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        started = time.monotonic()
        await asyncio.gather(*(worker(session) for _ in range(concurrency)))
        elapsed = time.monotonic() - started
    return {
        "ok": ok,
        "failed": failed,
        "chunks": chunks,
        "elapsed_s": elapsed,
        "ttft_s": ttfts,
        "total_s": totals,
        "errors": errors,
        "sent": next_index,
    }


def run_driver(
    urls: Sequence[str],
    model: str,
    route: str,
    concurrency: int,
    requests: int,
    max_tokens: int,
    time_limit: float,
    request_timeout: float = 60.0,
) -> dict[str, Any]:
    """Run `drive` in a separate Python process (its CPU and GIL are not the proxy's).

    The result comes back through a temporary file, not a pipe: a large JSON written to a
    pipe by a process that was running an event loop has come back cut at 64 KiB."""
    fd, out_path = tempfile.mkstemp(prefix="bench-drive-", suffix=".json")
    os.close(fd)
    argv = [sys.executable, __file__, "drive", "--model", model, "--route", route]
    for url in urls:
        argv += ["--url", url]
    argv += [
        "--concurrency", str(concurrency), "--requests", str(requests),
        "--max-tokens", str(max_tokens), "--time-limit", str(time_limit),
        "--request-timeout", str(request_timeout), "--out", out_path,
    ]  # fmt: skip
    try:
        out = subprocess.run(
            argv, capture_output=True, timeout=time_limit + request_timeout + 30, check=False
        )
        if out.returncode != 0:
            err = out.stderr.decode(errors="replace")[-2000:]
            raise RuntimeError(f"load driver failed ({out.returncode}):\n{err}")
        result: dict[str, Any] = json.loads(Path(out_path).read_bytes())
        return result
    finally:
        Path(out_path).unlink(missing_ok=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("drive", help="drive a bounded streaming load; print JSON")
    d.add_argument("--url", action="append", required=True, help="base URL (repeatable)")
    d.add_argument("--model", default="sim-model")
    d.add_argument("--route", choices=("chat", "completions"), default="chat")
    d.add_argument("--concurrency", type=int, default=100)
    d.add_argument("--requests", type=int, default=1000)
    d.add_argument("--max-tokens", type=int, default=64)
    d.add_argument("--time-limit", type=float, default=120.0)
    d.add_argument("--request-timeout", type=float, default=60.0)
    d.add_argument("--out", help="write the JSON here instead of stdout")
    args = parser.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    result = asyncio.run(
        drive(
            args.url,
            args.model,
            args.route,
            args.concurrency,
            args.requests,
            args.max_tokens,
            args.time_limit,
            args.request_timeout,
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps(result))
    else:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())


# ----------------------------------------------------------------------------- output lengths


def exact_prompt(rng: Any, n: int) -> str:
    """n tokens for the sim's tokenizer that the gateway's estimate (no tokenizer configured:
    ceil(bytes/3) per word, plus 1) also counts exactly: two-letter vocabulary words, each
    one token. Random, so distinct prompts share no prefix-cache blocks."""
    from seawall.sim import textgen

    pool = [w for w in textgen.WORDS if len(w) <= 2]
    return "".join(" " + rng.choice(pool) for _ in range(n))


def natural_length(prompt: str, max_tokens: int, server_seed: int = 0) -> int:
    """The completion tokens `seawall sim --seed server_seed` generates for `prompt` at
    temperature 0 without `ignore_eos`: the first EOS (counted) or `max_tokens`.

    The emulator's next token is a pure function of (seed, context), so a benchmark can pick
    prompts by the length the engine will sample for them: EOS is still sampled by the
    engine, and the gateway sees nothing but ordinary requests with `max_tokens` far above
    their use."""
    from seawall.sim import textgen

    key = textgen.sampling_key(server_seed, 0.0, None)
    h = textgen.hash_tokens(textgen.tokenize(prompt))
    for n in range(1, max_tokens + 1):
        token = textgen.next_token(key, h)
        if token == textgen.EOS_ID:
            return n
        h = textgen.extend_hash(h, token)
    return max_tokens


class LengthPool:
    """Prompts bucketed by the output length the sim will give them: `take(lo, hi)` returns
    an unused prompt whose natural length is in [lo, hi], generating more as needed (each
    candidate costs about 0.5 ms), so every request of a run is distinct."""

    def __init__(self, seed: int, prompt_tokens: int, max_tokens: int) -> None:
        import random

        self.rng = random.Random(seed)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self._spare: list[tuple[int, str]] = []

    def take(self, lo: int, hi: int, tries: int = 20_000) -> tuple[str, int]:
        for i, (length, prompt) in enumerate(self._spare):
            if lo <= length <= hi:
                del self._spare[i]
                return prompt, length
        for _ in range(tries):
            prompt = exact_prompt(self.rng, self.prompt_tokens)
            length = natural_length(prompt, self.max_tokens)
            if lo <= length <= hi:
                return prompt, length
            if len(self._spare) < 5000:
                self._spare.append((length, prompt))
        raise RuntimeError(f"no prompt of natural length in [{lo}, {hi}] after {tries} tries")
