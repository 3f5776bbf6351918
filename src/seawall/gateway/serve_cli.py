"""`seawall serve`: run the gateway in front of engine replicas.

    seawall serve --config gateway.yaml
    seawall serve --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 --port 8080

On SIGTERM (or Ctrl-C) the gateway drains: `/readyz` fails at once, new requests get
503 + Retry-After, in-flight streams get `drain.timeout_s` to finish, then it exits 0.

On SIGHUP it reloads `--config` (as nginx and Prometheus do), and with `--watch-config`
also whenever the file changes (its modification time, size or inode, polled; a
Kubernetes ConfigMap volume swaps a symlink, which this sees). Tenants, keys, tiers and
replicas take effect at once and as one change (`Gateway.reload`); a file that does not
load or validate is refused with one log line naming the problem, and the running
configuration stays. Sections that need a restart are named and not applied.

Logs go to stderr, as text or one JSON object per line (`--log-format`, or `logging:`
in the file; the flag wins; see seawall/logs.py).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from seawall import logs
from seawall.config import ConfigError, GatewayConfig, load_config, parse_config

if TYPE_CHECKING:
    from seawall.gateway.app import Gateway

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
    p.add_argument("--log-level", help="DEBUG, INFO, WARNING or ERROR (default: logging.level)")
    p.add_argument(
        "--log-format",
        choices=("text", "json"),
        help="text lines, or one JSON object per line (default: logging.format, text)",
    )
    p.add_argument(
        "--watch-config",
        type=float,
        nargs="?",
        const=2.0,
        metavar="S",
        help="reload --config when the file changes, checking every S seconds (default 2); "
        "SIGHUP reloads it in any case",
    )


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


class Reloader:
    """Reads the configuration again and hands it to the gateway; refuses a bad file."""

    def __init__(self, args: argparse.Namespace, gw: Gateway) -> None:
        self.args = args
        self.gw = gw
        self.path = Path(args.config) if args.config else None
        self.seen = _file_identity(self.path)

    def reload(self, why: str) -> bool:
        if self.path is None:
            log.warning("reload (%s): there is no --config file to reload", why)
            return False
        if self.gw.draining:
            log.warning("reload (%s) ignored: the gateway is draining", why)
            return False
        self.seen = _file_identity(self.path)
        try:
            config = build_config(self.args)
            report = self.gw.reload(config)
        except ConfigError as e:
            message = " ".join(line.strip() for line in str(e).splitlines())
            log.error("reload (%s) refused; the running configuration stays: %s", why, message)
            return False
        log.info("reload (%s) applied from %s: %s", why, self.path, report)
        if report.not_applied:
            log.warning(
                "reload: changed but not applied (restart the gateway to apply): %s",
                ", ".join(report.not_applied),
            )
        return True

    def changed(self) -> bool:
        return _file_identity(self.path) != self.seen

    async def watch(self, interval_s: float) -> None:
        # A poll by design: the file may be a symlink swapped by a ConfigMap update,
        # which inotify on the path would miss; one stat per interval costs nothing.
        while True:
            await asyncio.sleep(interval_s)
            if self.changed():
                self.reload("the file changed")


def _file_identity(path: Path | None) -> tuple[int, int, int] | None:
    if path is None:
        return None
    try:
        st = path.stat()  # follows symlinks: the file the link points at now
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _say_text(line: str) -> None:
    print(line, flush=True)


def _say_json(line: str) -> None:
    # An INFO record handed to the handlers directly: shown whatever the log level.
    log.handle(log.makeRecord(log.name, logging.INFO, __file__, 0, line, (), None))


async def serve(
    config: GatewayConfig,
    access_log: bool = True,
    args: argparse.Namespace | None = None,
    json_logs: bool = False,
) -> int:
    from seawall.gateway.app import Gateway

    gw = Gateway(config, access_log=access_log)
    port = await gw.start()
    # Whatever the log level: with `port: 0`, this line is how a supervisor (or a test)
    # learns the address. On stdout as text; as a record (so every line is one JSON
    # object) with JSON logs.
    say = _say_json if json_logs else _say_text
    say(f"seawall gateway listening on http://{config.listen.host}:{port}")
    if gw.admin is not None and gw.admin.port is not None:
        say(f"seawall admin API listening on http://{config.admin.host}:{gw.admin.port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher: asyncio.Task[None] | None = None
    if args is not None:
        reloader = Reloader(args, gw)
        loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
        if args.watch_config:
            watcher = asyncio.create_task(reloader.watch(args.watch_config))
    await stop.wait()
    if watcher is not None:
        watcher.cancel()
    log.info("draining: %d request(s) in flight, up to %.0fs", gw.inflight, config.drain.timeout_s)
    await gw.shutdown()
    return 0


def run(args: argparse.Namespace) -> int:
    # Logging as the flags say until the file is read (its errors are logged too).
    logs.setup(args.log_format or "text", args.log_level or "INFO")
    try:
        config = build_config(args)
    except ConfigError as e:
        if args.log_format == "json":
            log.error("seawall serve: %s", e)
        else:
            print(f"seawall serve: {e}", file=sys.stderr)
        return 2
    log_format = args.log_format or config.logging.format
    logs.setup(log_format, args.log_level or config.logging.level)
    if args.watch_config is not None and args.watch_config <= 0:
        print("seawall serve: --watch-config needs a positive interval", file=sys.stderr)
        return 2
    access_log = config.logging.access_log and not args.no_access_log
    try:
        import uvloop

        return uvloop.run(serve(config, access_log, args, log_format == "json"))
    except ImportError:
        return asyncio.run(serve(config, access_log, args, log_format == "json"))
