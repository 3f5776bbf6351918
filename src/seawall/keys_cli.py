"""`seawall keys new --tenant T`: mint an API key for a tenant.

Prints the key once (Seawall never stores it, so this is the only time anyone sees it),
its hash, and a YAML snippet to paste under the tenant in the config. It must not write
the key anywhere: no file, no log.
"""

from __future__ import annotations

import argparse
import sys

import yaml

from seawall.auth import hash_key, new_key

# The config field under a tenant that lists its keys' hashes.
CONFIG_FIELD = "api_key_hashes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    new = sub.add_parser("new", help="mint a key for a tenant and print it once")
    new.add_argument("--tenant", required=True, help="tenant name, as in the config")


def snippet(tenant: str, key_hash: str) -> str:
    """The YAML to paste into the config (yaml.safe_dump quotes odd tenant names)."""
    text: str = yaml.safe_dump(
        {"tenants": {tenant: {CONFIG_FIELD: [key_hash]}}}, default_flow_style=False
    )
    return text


def run(args: argparse.Namespace) -> int:
    if args.keys_command != "new":  # argparse already restricts this; kept for mypy
        return 2
    tenant: str = args.tenant.strip()
    if not tenant:
        print("seawall keys new: --tenant must not be empty", file=sys.stderr)
        return 2
    key = new_key()
    key_hash = hash_key(key)
    out = sys.stdout
    out.write(f"key:  {key}\n")
    out.write(f"hash: {key_hash}\n\n")
    out.write("The key is shown only this once: Seawall keeps only its hash.\n")
    out.write(f"Give the key to the tenant; add the hash under tenant {tenant!r}:\n\n")
    out.write(snippet(tenant, key_hash))
    return 0
