"""The one command-line tool, ``embedpool``, with a subcommand per job.

Each subcommand lives in ``app/commands/<name>.py`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to the
function that runs it.  Modules are imported lazily by name so that
``embedpool --help`` stays fast and a broken optional dependency of one
command does not take down the others.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = ["embed", "index", "search", "serve", "eval", "train_attention", "bench"]


class UsageError(Exception):
    """A user mistake: printed as ``embedpool: error: ...`` with exit code 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedpool",
        description="Embed text with a frozen encoder and configurable token poolers.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"embedpool.app.commands.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"embedpool.app.commands.{name}":
                continue  # not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UsageError, ValueError, TypeError, FileNotFoundError) as exc:
        # Errors raised for bad input carry a message meant for the user.
        print(f"embedpool {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
