"""`seawall serve`: run the gateway in front of engine replicas.

    seawall serve --config gateway.yaml
    seawall serve --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --port 8080

On SIGTERM (or Ctrl-C) the gateway drains: `/readyz` fails at once, new requests get
503 + Retry-After, in-flight streams get `drain.timeout_s` to finish, then it exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from seawall.config import ConfigError, GatewayConfig, load_config, parse_config

log = logging.getLogger("seawall.gateway")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="gateway configuration file (YAML)")
    p.add_argument(
        "--replica",
        action="append",
        default=[],
        metavar="URL",
        help="an engine replica's base URL (repeatable); its model is discovered",
    )
    p.add_argument("--host", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="listen port (default 8080)")
    p.add_argument("--ttft-timeout", type=float, metavar="S", help="time to first token timeout")
    p.add_argument("--itl-timeout", type=float, metavar="S", help="inter-token idle timeout")
    p.add_argument("--total-timeout", type=float, metavar="S", help="total request deadline")
    p.add_argument("--no-access-log", action="store_true", help="do not log one line per request")
    p.add_argument("--log-level", default="INFO")


def build_config(args: argparse.Namespace) -> GatewayConfig:
    base = load_config(args.config) if args.config else GatewayConfig()
    data = base.model_dump(exclude_unset=True)
    if args.replica:
        data["replicas"] = [*data.get("replicas", []), *({"url": u} for u in args.replica)]
    listen = dict(data.get("listen", {}))
    if args.host:
        listen["host"] = args.host
    if args.port is not None:
        listen["port"] = args.port
    data["listen"] = listen
    timeouts = dict(data.get("timeouts", {}))
    for flag, key in (
        ("ttft_timeout", "ttft_s"),
        ("itl_timeout", "itl_s"),
        ("total_timeout", "total_s"),
    ):
        value = getattr(args, flag)
        if value is not None:
            timeouts[key] = value
    data["timeouts"] = timeouts
    config = parse_config(data, args.config or "command line")
    if not config.replicas and config.fleet.discovery is None:
        raise ConfigError(
            "no replicas: pass --replica URL, list them under `replicas:` in --config, "
            "or configure fleet.discovery"
        )
    return config


async def serve(config: GatewayConfig, access_log: bool = True) -> int:
    from seawall.gateway.app import Gateway

    gw = Gateway(config, access_log=access_log)
    port = await gw.start()
    # On stdout whatever the log level: with `port: 0`, this line is how a supervisor
    # (or a test) learns the address.
    print(f"seawall gateway listening on http://{config.listen.host}:{port}", flush=True)
    if gw.admin is not None and gw.admin.port is not None:
        print(
            f"seawall admin API listening on http://{config.admin.host}:{gw.admin.port}",
            flush=True,
        )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("draining: %d request(s) in flight, up to %.0fs", gw.inflight, config.drain.timeout_s)
    await gw.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )
    try:
        config = build_config(args)
    except ConfigError as e:
        print(f"seawall serve: {e}", file=sys.stderr)
        return 2
    try:
        import uvloop

        return uvloop.run(serve(config, access_log=not args.no_access_log))
    except ImportError:
        return asyncio.run(serve(config, access_log=not args.no_access_log))
