"""`seawall rollout --admin URL`: a surge-first rolling restart of every replica."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
import urllib.error
import urllib.request
from typing import Any

from seawall import clock
from seawall.admin_args import add_admin_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_admin_arguments(p)
    p.add_argument("--max-surge", type=int, default=1, help="new replicas started at once")
    p.add_argument("--warmup-requests", type=int, default=3)
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S")
    p.add_argument(
        "--command",
        dest="new_command",
        help="the new version's command template, e.g. "
        "'vllm serve {model} --port {port}' (default: the current one)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=3600.0,
        metavar="S",
        help="give up waiting for the report after S seconds",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


def _call(url: str, token: str | None, body: dict[str, Any] | None = None) -> Any:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url, data=data, headers=headers, method="GET" if body is None else "POST"
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def run(args: argparse.Namespace) -> int:
    base = args.admin.rstrip("/") + "/admin/rollout"
    body: dict[str, Any] = {
        "max_surge": args.max_surge,
        "warmup_requests": args.warmup_requests,
        "drain_timeout_s": args.drain_timeout,
    }
    if args.new_command:
        body["command"] = shlex.split(args.new_command)
    try:
        _call(base, args.admin_token, body)
        deadline = clock.monotonic() + args.timeout
        while True:  # bounded by --timeout
            report = _call(base, args.admin_token)
            if report["state"] != "running" or clock.monotonic() > deadline:
                break
            time.sleep(0.5)
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        print(f"seawall rollout: {e.code}: {detail}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"seawall rollout: cannot reach {args.admin}: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for step in report["steps"]:
            print(f"  {step}")
        ttft_b, ttft_d = report["ttft_mean_before_s"], report["ttft_mean_during_s"]
        print(
            f"rollout {report['state']} in {report['duration_s']:.1f}s: "
            f"{len(report['replaced'])} replaced, {report['streams_dropped']} stream(s) "
            f"dropped, {report['requests_failed']} request(s) failed, "
            f"{report['streams_cut_by_drains']} cut by drain deadlines; ready replicas "
            f"{report['ready_before']} before, at least {report['ready_min_during']} during"
        )
        if ttft_b is not None and ttft_d is not None:
            print(
                f"mean time to first token: {ttft_b * 1000:.1f} ms before, "
                f"{ttft_d * 1000:.1f} ms during"
            )
        if report["failure"]:
            print(f"stopped: {report['failure']}")
    return 0 if report["state"] == "done" else 1
