"""`seawall map`: print the failure-domain map, with live state from `--admin`.

Owns the command line and the one HTTP call to the admin API (`GET /admin/state`,
bearer token). The table and the summaries are `ops.domains`.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

from seawall.admin_args import add_admin_arguments
from seawall.ops.domains import DOMAINS, live_states

FETCH_TIMEOUT_S = 10.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_admin_arguments(parser, required=False)
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")


def fetch_state(admin_url: str, token: str | None) -> Any:
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    req = urllib.request.Request(admin_url.rstrip("/") + "/admin/state", headers=headers)
    with urllib.request.urlopen(req, timeout=FETCH_TIMEOUT_S) as resp:
        return json.loads(resp.read())


def run(args: argparse.Namespace) -> int:
    live: dict[str, str] = {}
    if args.admin:
        try:
            state = fetch_state(args.admin, args.admin_token)
        except urllib.error.HTTPError as e:
            hint = " (set --admin-token or SEAWALL_ADMIN_TOKEN)" if e.code in (401, 403) else ""
            print(f"seawall map: {args.admin}/admin/state answered {e.code}{hint}", file=sys.stderr)
            return 2
        except (OSError, ValueError) as e:
            print(f"seawall map: cannot read {args.admin}/admin/state: {e}", file=sys.stderr)
            return 2
        live = live_states(state if isinstance(state, dict) else {})
    if args.json:
        doc = [
            {
                "domain": d.key,
                "name": d.name,
                "example": d.example,
                "controls": list(d.controls),
                "proof": list(d.proof),
                **({"live": live[d.key]} if d.key in live else {}),
            }
            for d in DOMAINS
        ]
        print(json.dumps(doc, indent=2))
        return 0
    for n, d in enumerate(DOMAINS, 1):
        print(f"{n}. {d.name}: e.g. {d.example}")
        for i, control in enumerate(d.controls):
            print(f"   {'contained by' if i == 0 else '':<13} {control}")
        print(f"   {'proven by':<13} {', '.join(d.proof)}")
        if d.key in live:
            print(f"   {'live':<13} {live[d.key]}")
        print()
    return 0
