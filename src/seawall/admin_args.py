"""The `--admin` and `--admin-token` options every command that talks to a gateway's admin
API takes (`status`, `rollout`, `map`, `drill`), spelled once."""

from __future__ import annotations

import argparse
import os


def add_admin_arguments(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument("--admin", required=required, metavar="URL", help="the gateway's admin API URL")
    p.add_argument(
        "--admin-token",
        default=os.environ.get("SEAWALL_ADMIN_TOKEN"),
        help="admin bearer token (default: $SEAWALL_ADMIN_TOKEN)",
    )
