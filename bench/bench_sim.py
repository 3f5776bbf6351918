"""How many streamed tokens per second one `seawall sim` process serves, and at what CPU cost.

    python bench/bench_sim.py [--streams 200] [--seconds 10] [--max-tokens 256]

Starts the emulator (step costs set to zero, so the figure is the emulator's own overhead)
and, as a baseline in the same run, a bare aiohttp SSE server that writes chunks of the
same size with no engine behind them. A load client in a separate process keeps
`--streams` completions streams open for `--seconds` seconds (bounded: it stops opening
streams at the deadline and gives up on any stream 10 s after it). Server CPU comes from
/proc/<pid>/stat, so the client's CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "src"))

from tests.support.procs import free_port  # noqa: E402

CHUNK = (
    b'data: {"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
    b'"created":1796000000,"model":"sim-model","choices":[{"index":0,"text":" word",'
    b'"logprobs":null,"finish_reason":null,"stop_reason":null,"prompt_token_ids":null,'
    b'"token_ids":null,"weight_versions":null}],"kv_transfer_params":null}\n\n'
)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- baseline


def run_baseline_server(port: int) -> None:
    """The floor: aiohttp streaming pre-built chunks on a timer-free loop, no engine."""
    import uvloop
    from aiohttp import web

    async def handler(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens", 16))
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for _ in range(n):
            await response.write(CHUNK)
            await asyncio.sleep(0)
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_get("/health", health)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        await asyncio.Event().wait()  # until terminated

    uvloop.run(serve())


# ----------------------------------------------------------------------------- client


async def client_main(url: str, streams: int, seconds: float, max_tokens: int) -> dict[str, float]:
    import aiohttp

    deadline = time.monotonic() + seconds
    hard_stop = deadline + 10.0
    tokens = 0
    completed = 0
    failed = 0
    payload = {
        "model": "sim-model",
        "prompt": "Benchmark prompt with a few words in it",
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    async def one_stream(session: aiohttp.ClientSession) -> None:
        nonlocal tokens, completed, failed
        while time.monotonic() < deadline:
            try:
                async with session.post(url + "/v1/completions", json=payload) as r:
                    async for data in r.content.iter_any():
                        tokens += data.count(b"data: {")
                        if time.monotonic() > hard_stop:
                            break
                completed += 1
            except aiohttp.ClientError:
                failed += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        await asyncio.wait_for(
            asyncio.gather(*(one_stream(session) for _ in range(streams))), timeout=seconds + 15
        )
        elapsed = time.monotonic() - started
    return {"tokens": tokens, "completed": completed, "failed": failed, "elapsed_s": elapsed}


def measure(
    server_argv: list[str], port: int, streams: int, seconds: float, max_tokens: int
) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    server = subprocess.Popen(
        server_argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(200):
            try:
                urllib.request.urlopen(url + "/health", timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        cpu_before = cpu_seconds(server.pid)
        out = subprocess.run(
            [
                sys.executable,
                __file__,
                "--client",
                url,
                "--streams",
                str(streams),
                "--seconds",
                str(seconds),
                "--max-tokens",
                str(max_tokens),
            ],
            env=env,
            capture_output=True,
            timeout=seconds + 60,
            check=False,
        )
        if out.returncode != 0:
            raise SystemExit(f"load client failed:\n{out.stderr.decode()[-3000:]}")
        cpu_used = cpu_seconds(server.pid) - cpu_before
        result: dict[str, float] = json.loads(out.stdout)
        result["cpu_s"] = cpu_used
        return result
    finally:
        server.terminate()
        server.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--streams", type=int, default=200)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--client", metavar="URL")
    parser.add_argument("--baseline-server", type=int, metavar="PORT")
    args = parser.parse_args()
    if args.baseline_server:
        run_baseline_server(args.baseline_server)
        return
    if args.client:
        try:
            import uvloop

            uvloop.install()
        except ImportError:
            pass
        stats = asyncio.run(client_main(args.client, args.streams, args.seconds, args.max_tokens))
        print(json.dumps(stats))
        return

    rows: list[tuple[str, dict[str, float]]] = []
    port = free_port()
    rows.append(
        (
            "baseline: bare aiohttp SSE",
            measure(
                [sys.executable, __file__, "--baseline-server", str(port)],
                port,
                args.streams,
                args.seconds,
                args.max_tokens,
            ),
        )
    )
    port = free_port()
    sim_argv = [
        sys.executable, "-m", "seawall", "sim", "--port", str(port),
        "--step-base-ms", "0", "--step-per-seq-ms", "0", "--step-per-prefill-token-ms", "0",
        "--max-num-seqs", str(max(256, args.streams)), "--kv-blocks", "65536",
    ]  # fmt: skip
    rows.append(
        ("seawall sim", measure(sim_argv, port, args.streams, args.seconds, args.max_tokens))
    )

    print(f"\n{args.streams} concurrent streams, {args.seconds:g} s, max_tokens={args.max_tokens}")
    header = f"{'server':<28}{'streams done':>14}{'failed':>8}{'tokens/s':>12}"
    header += f"{'server CPU s':>14}{'CPU s/1k tok':>14}{'tok/s per core':>16}"
    print(header)
    for name, r in rows:
        rate = r["tokens"] / r["elapsed_s"]
        per_k = r["cpu_s"] / (r["tokens"] / 1000) if r["tokens"] else float("nan")
        per_core = r["tokens"] / r["cpu_s"] if r["cpu_s"] else float("nan")
        print(
            f"{name:<28}{int(r['completed']):>14}{int(r['failed']):>8}{rate:>12,.0f}"
            f"{r['cpu_s']:>14.2f}{per_k:>14.4f}{per_core:>16,.0f}"
        )


if __name__ == "__main__":
    main()
