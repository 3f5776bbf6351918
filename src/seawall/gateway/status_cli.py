"""`seawall status --admin URL`: the fleet as a table, from a running gateway's admin API."""

from __future__ import annotations

import argparse
import sys
import urllib.error
import urllib.request
from typing import Any

import orjson
from rich.console import Console
from rich.table import Table

from seawall.admin_args import add_admin_arguments


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_admin_arguments(p)
    p.add_argument("--json", action="store_true", help="print the raw state as JSON")


def fetch_state(admin: str, token: str | None) -> dict[str, Any]:
    """GET /admin/state (stdlib HTTP: this command must not need the dev tools)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    req = urllib.request.Request(admin.rstrip("/") + "/admin/state", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            state: dict[str, Any] = orjson.loads(r.read())
            return state
    except urllib.error.HTTPError as e:
        if e.code == 401:
            raise SystemExit(
                "seawall status: the admin API refused the token (--admin-token)"
            ) from None
        raise


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(state: dict[str, Any], console: Console) -> None:
    t = Table(title="replicas")
    for col in (
        "id",
        "node",
        "model",
        "state",
        "routable",
        "score",
        "kv",
        "waiting",
        "running",
        "inflight",
        "restarts",
        "reason",
    ):
        t.add_column(col)
    for r in state.get("replicas", []):
        load = r.get("load") or {}
        state_text = r.get("state", "?") + (" (cordoned)" if r.get("cordoned") else "")
        t.add_row(
            r.get("id", "?"),
            r.get("node", "?"),
            r.get("model") or "-",
            state_text,
            "yes" if r.get("routable") else "no",
            _f(r.get("score")),
            _f(load.get("kv_usage"), "{:.0%}"),
            _f(load.get("waiting"), "{:g}"),
            _f(load.get("running"), "{:g}"),
            str(r.get("inflight", "-")),
            str(r.get("restarts", 0)),
            (r.get("reason") or "")[:60],
        )
    console.print(t)
    nodes = [n for n in state.get("nodes", []) if n.get("cordoned")]
    for n in nodes:
        console.print(f"node {n['node']}: cordoned ({'; '.join(n.get('evidence', []))})")
    budget = state.get("retry_budget", {})
    console.print(
        f"retry budget {_f(budget.get('level'), '{:.1f}')} tokens (ratio {budget.get('ratio')}), "
        f"in flight {state.get('inflight', '-')}, draining {state.get('draining', False)}"
    )


def run(args: argparse.Namespace) -> int:
    try:
        state = fetch_state(args.admin, args.admin_token)
    except OSError as e:
        print(f"seawall status: cannot read {args.admin}: {e}", file=sys.stderr)
        return 2
    if args.json:
        sys.stdout.write(orjson.dumps(state, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    render(state, Console(width=160))
    return 0
