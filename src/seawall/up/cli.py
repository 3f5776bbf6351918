"""`seawall up`: a whole local fleet in one command, with a live view.

    seawall up --demo                  3 sim replicas + gateway + traffic + status page, 60 s
    seawall up --config fleet.yaml     your fleet (see examples/fleet.yaml), until Ctrl-C

Ctrl-C or SIGTERM stops the traffic, lets the gateway drain, stops every replica, and
prints a summary. With stdout not a terminal, one plain line per second replaces the
live table.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
from pathlib import Path

from seawall.auth import hash_key, new_key
from seawall.up.config import UpConfigError, check_gateway_config, demo_config, load_up_config
from seawall.up.runner import Session, run_session


def add_arguments(p: argparse.ArgumentParser) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--config", metavar="FILE", help="fleet config (YAML)")
    which.add_argument(
        "--demo", action="store_true", help="3 sim replicas, the gateway and steady traffic"
    )
    p.add_argument(
        "--demo-seconds", type=float, default=60.0, metavar="S", help="demo length (default 60)"
    )
    p.add_argument(
        "--demo-crash-at",
        type=float,
        default=20.0,
        metavar="S",
        help="crash one replica S seconds into the demo's traffic to show a restart (0: never)",
    )
    p.add_argument(
        "--seconds",
        type=float,
        default=0.0,
        metavar="S",
        help="with --config: stop after S seconds (default: run until Ctrl-C)",
    )
    p.add_argument("--gateway-port", type=int, metavar="PORT", help="default: a free port")
    p.add_argument(
        "--log-dir",
        metavar="DIR",
        help="logs and the restart ledger (default: a new temp dir). Reusing a dir keeps "
        "its restart history, so a node cordoned there stays cordoned",
    )
    p.add_argument("--plain", action="store_true", help="plain lines even on a terminal")


def run(args: argparse.Namespace) -> int:
    # The demo's admin API gets a token of its own, made for this run and shown once with
    # the status page's address (the page reads it from the URL's #token= and drops it).
    admin_token = new_key() if args.demo else None
    try:
        config = (
            demo_config(hash_key(admin_token) if admin_token else None)
            if args.demo
            else load_up_config(args.config)
        )
        check_gateway_config(config, "demo" if args.demo else args.config)
    except UpConfigError as e:
        print(f"seawall up: {e}", file=sys.stderr)
        return 2
    seconds = float(args.demo_seconds if args.demo else args.seconds)
    if seconds < 0 or args.demo_crash_at < 0:
        print(
            "seawall up: --demo-seconds, --seconds and --demo-crash-at must be >= 0",
            file=sys.stderr,
        )
        return 2
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="seawall-up-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    # Our own log (and the in-process gateway's) goes to a file: lines on stderr would
    # tear the live table.
    logging.basicConfig(
        filename=str(log_dir / "seawall-up.log"),
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
    )
    live = sys.stdout.isatty() and not args.plain
    return run_session(
        lambda: Session(
            config,
            log_dir=log_dir,
            seconds=seconds or None,
            crash_at_s=(args.demo_crash_at or None) if args.demo else None,
            gateway_port=args.gateway_port,
            live=live,
            title="seawall up --demo" if args.demo else f"seawall up --config {args.config}",
            admin_token=admin_token,
        )
    )
