"""Record engine traces for the admission controller's unit tests.

    python bench/record_admission_traces.py [--workloads full,eos,mix,shift] [--seconds S]
        [--clients N] [--out tests/data/traces]

Runs real `seawall sim` replicas under the admission benchmark's workloads (the same
definitions: `bench_admission.WORKLOADS`), with closed-loop clients sending straight to the
sims (no gateway, so nothing is shed and the trace shows what the engines do unprotected),
and records, every `--interval` seconds, each engine's scrape as the gateway's vLLM adapter
reads it (KV usage, waiting, running, preemptions, generation tokens) plus one event per
request (sent, first token, end, replica, prompt, max_tokens and completion tokens from the
engine's usage). One compact JSON file per workload goes to `--out`; the tests replay them
into the controller with the recorded times as `now`.

Client i sends to replica i mod replicas (an even split, as a balancer would make it).
Bounded: each client stops opening requests after `--seconds`, streams get `--grace`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import REPO, machine_context
from bench_admission import LOGS, MODEL, WORKLOADS, Prompts, Workload, start_sims

SCRAPE_FIELDS = [
    "t", "replica", "kv_usage", "waiting", "running", "preemptions_total",
    "generation_tokens_total",
]  # fmt: skip
REQUEST_FIELDS = [
    "sent", "first_token", "end", "replica", "prompt_tokens", "max_tokens",
    "completion_tokens",
]  # fmt: skip


async def record(w: Workload, args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp

    from seawall.fleet.adapters import ADAPTERS, EngineKind

    adapter = ADAPTERS[EngineKind.VLLM]
    seconds = args.seconds or w.seconds
    worst = -(-(args.prompt_tokens + w.max_tokens) // args.block_size)
    clients = args.clients or args.factor * ((w.kv_blocks - 1) // worst) * args.replicas
    prompts = Prompts(w, args, seed=4242)
    if w.classes is not None:
        want: dict[tuple[int, int], int] = {}
        for classes in (w.classes, w.after_shift or ()):
            for share, lo, hi in classes:
                per_s = 4.0 if hi <= 200 else 0.3
                want[(lo, hi)] = want.get((lo, hi), 0) + int(clients * share * per_s * seconds)
        prompts.prepare({k: min(v, 3000) for k, v in want.items()})
    sims = start_sims(w, args)
    urls = [f"http://127.0.0.1:{p.port}" for p in sims]
    scrapes: list[list[Any]] = []
    requests: list[list[Any]] = []
    capacity: dict[str, Any] = {}
    try:
        async with aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=seconds + args.grace + 30),
        ) as session:
            started = time.monotonic()
            deadline = started + seconds
            shift_at = started + w.shift_at * seconds

            def rel(t: float) -> float:
                return round(t - started, 3)

            async def client(i: int) -> None:
                replica = i % len(urls)
                for _ in range(100_000):
                    if time.monotonic() >= deadline:
                        return
                    prompt, _ = prompts.next(shifted=time.monotonic() >= shift_at)
                    body: dict[str, Any] = {
                        "model": MODEL,
                        "prompt": prompt,
                        "max_tokens": w.max_tokens,
                        "temperature": 0,
                        "stream": True,
                        "stream_options": {"include_usage": True},
                    }
                    if w.ignore_eos:
                        body["ignore_eos"] = True
                    sent = time.monotonic()
                    first = None
                    usage: dict[str, Any] = {}
                    url = urls[replica] + "/v1/completions"
                    async with session.post(url, json=body) as r:
                        async for line in r.content:
                            if not line.startswith(b"data: {"):
                                continue
                            if first is None and b'"text":"' in line and b'"text":""' not in line:
                                first = time.monotonic()
                            if b'"usage":{' in line:
                                usage = json.loads(line[6:]).get("usage") or {}
                    requests.append(
                        [
                            rel(sent),
                            None if first is None else rel(first),
                            rel(time.monotonic()),
                            replica,
                            usage.get("prompt_tokens"),
                            w.max_tokens,
                            usage.get("completion_tokens"),
                        ]
                    )

            async def scraper(until: asyncio.Future[Any]) -> None:
                while not until.done():
                    now = time.monotonic()
                    texts = await asyncio.gather(
                        *(_get(session, u + "/metrics") for u in urls), return_exceptions=True
                    )
                    for i, text in enumerate(texts):
                        if isinstance(text, BaseException):
                            continue
                        load = adapter.parse(text, now)
                        if not capacity and load.kv_capacity_tokens:
                            capacity["kv_capacity_tokens"] = load.kv_capacity_tokens
                            capacity["block_size"] = load.kv_block_size
                        scrapes.append(
                            [
                                rel(now), i, _r(load.kv_usage, 4), load.waiting, load.running,
                                load.preemptions_total, load.generation_tokens_total,
                            ]
                        )  # fmt: skip
                    await asyncio.sleep(max(0.0, now + args.interval - time.monotonic()))

            tasks = asyncio.gather(*(client(i) for i in range(clients)))
            scraping = asyncio.ensure_future(scraper(tasks))
            try:
                await asyncio.wait_for(tasks, timeout=seconds + args.grace)
            except TimeoutError:
                pass
            await scraping
    finally:
        for p in sims:
            p.stop()
    requests.sort()
    return {
        "workload": w.name,
        "about": (
            f"seawall sim x{args.replicas}, {w.kv_blocks} KV blocks, max_tokens {w.max_tokens}"
            f"{', ignore_eos' if w.ignore_eos else ', EOS sampled'}; {clients} closed-loop "
            f"clients straight to the sims (no admission) for {seconds:g}s"
            + (f"; shift to long outputs at {w.shift_at * seconds:g}s" if w.after_shift else "")
        ),
        "recorded_with": " ".join(["bench/record_admission_traces.py", *sys.argv[1:]]),
        "replicas": args.replicas,
        "clients": clients,
        "seconds": seconds,
        "shift_at_s": w.shift_at * seconds if w.after_shift else None,
        "max_tokens": w.max_tokens,
        "scrape_interval_s": args.interval,
        **capacity,
        "scrape_fields": SCRAPE_FIELDS,
        "scrapes": scrapes,
        "request_fields": REQUEST_FIELDS,
        "requests": requests,
    }


async def _get(session: Any, url: str) -> str:
    async with session.get(url) as r:
        text: str = await r.text()
        return text


def _r(v: float | None, digits: int) -> float | None:
    return None if v is None else round(v, digits)


def write_trace(trace: dict[str, Any], path: Path) -> None:
    """JSON with one scrape or request per line: small, and diffs read."""
    head = {k: v for k, v in trace.items() if k not in ("scrapes", "requests")}
    lines = ["{"]
    for k, v in head.items():
        lines.append(f"  {json.dumps(k)}: {json.dumps(v)},")
    for name in ("scrapes", "requests"):
        rows = trace[name]
        lines.append(f"  {json.dumps(name)}: [")
        lines += [f"    {json.dumps(row)}," for row in rows[:-1]]
        if rows:
            lines.append(f"    {json.dumps(rows[-1])}")
        lines.append("  ]," if name == "scrapes" else "  ]")
    lines.append("}")
    path.write_text("\n".join(lines) + "\n")


async def amain(args: argparse.Namespace) -> int:
    LOGS.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {machine_context()}")
    for name in args.workloads:
        w = WORKLOADS[name]
        trace = await record(w, args)
        path = args.out / f"{name}.json"
        write_trace(trace, path)
        preempt = sum(
            max((s[5] or 0) for s in trace["scrapes"] if s[1] == i)
            - min((s[5] or 0) for s in trace["scrapes"] if s[1] == i)
            for i in range(args.replicas)
        )
        print(
            f"{name}: {len(trace['scrapes'])} scrapes, {len(trace['requests'])} requests, "
            f"{preempt:g} preemptions -> {path}"
        )
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=0.0, help="0: the workload's")
    parser.add_argument("--grace", type=float, default=15.0)
    parser.add_argument("--factor", type=int, default=3)
    parser.add_argument("--clients", type=int, default=0, help="override factor x capacity")
    parser.add_argument("--interval", type=float, default=0.2, help="seconds between scrapes")
    parser.add_argument("--out", type=Path, default=REPO / "tests" / "data" / "traces")
    args = parser.parse_args()
    args.workloads = [x for x in args.workloads.split(",") if x]
    bad = [x for x in args.workloads if x not in WORKLOADS]
    if bad:
        parser.error(f"unknown workloads {bad}; choose from {', '.join(WORKLOADS)}")
    return asyncio.run(amain(args))


if __name__ == "__main__":
    sys.exit(main())
