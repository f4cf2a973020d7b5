"""The ``hybridshard`` command: a thin dispatcher over one module per subcommand.

Each subcommand module exposes ``add_parser(subparsers)`` (which registers its parser and sets
``func`` to a callable ``(args) -> int``).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

_SUBCOMMANDS = (
    "hybridshard.cli.topo",
    "hybridshard.cli.plan",
    "hybridshard.cli.launch",
    "hybridshard.cli.ckpt",
    "hybridshard.cli.bench",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridshard",
        description="Hybrid sharded training: topology discovery, group planning, launching, checkpoints and benchmarks.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMANDS:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "command", None) is None:
        parser.print_help()
        return 2
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        # The reader stopped early (`hybridshard plan ... | head`): not a failure of the command.
        # Point stdout at /dev/null so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
