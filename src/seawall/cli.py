"""The `seawall` command.

Each subcommand lives in its own module, which exposes `add_arguments(parser)` and
`run(args) -> int`. Modules are imported only when their subcommand runs, so that
`seawall sim` does not pay for the gateway's imports and the reverse.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# name -> (module, one-line help). Keep sorted by the order a newcomer meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("seawall.up.cli", "start a local fleet (replicas + gateway) with a live view"),
    "serve": ("seawall.gateway.serve_cli", "run the gateway in front of engine replicas"),
    "engine-args": (
        "seawall.gateway.engine_args",
        "print the vLLM flags that back the gateway's limits up inside the engine",
    ),
    "rollout": ("seawall.gateway.rollout_cli", "surge-first rolling restart of every replica"),
    "status": ("seawall.gateway.status_cli", "print a running gateway's fleet as a table"),
    "sim": ("seawall.sim.cli", "run a CPU-only engine emulator faithful to vLLM 0.33"),
    "keys": ("seawall.keys_cli", "mint a tenant's API key (printed once; only its hash is kept)"),
    "alerts": (
        "seawall.ops.alerts_cli",
        "write Prometheus alert rules; `check` finds metric drift",
    ),
    "budget": ("seawall.ops.budget_cli", "error-budget calculator for crashes and restarts"),
    "map": ("seawall.ops.map_cli", "failure domains, their controls and their live state"),
    "drill": ("seawall.ops.drill_cli", "run a bounded fault drill and report what users saw"),
}


def build_parser(wanted: str | None = None) -> argparse.ArgumentParser:
    """The parser; only the `wanted` subcommand's module is imported to add its arguments."""
    from seawall import __version__

    parser = argparse.ArgumentParser(prog="seawall", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"seawall {__version__}")
    # `dest` is unlikely to clash with a subcommand's own option names (`--command`).
    sub = parser.add_subparsers(dest="seawall_command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if wanted == name:
            importlib.import_module(module_name).add_arguments(p)
    return parser


def _wanted_command(argv: Sequence[str]) -> str | None:
    return next((a for a in argv if not a.startswith("-")), None)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(_wanted_command(args_list)).parse_args(args_list)
    module = importlib.import_module(COMMANDS[args.seawall_command][0])
    result: int = module.run(args)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
