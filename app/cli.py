"""The one command-line tool, ``embedpool``, with a subcommand per job.

Each subcommand lives in ``app/commands/<name>.py`` and exposes
``register(subparsers)``, which adds its parser and sets ``func`` to the
function that runs it.  Modules are imported lazily by name so that
``embedpool --help`` stays fast and a broken optional dependency of one
command does not take down the others.

Errors end a command with the exit code of their kind (``embedpool.errors.TABLE``, the table
the HTTP API answers from too): 2 for what the user can fix (bad arguments or input, unknown
collection, conflicting settings), 69 when a dependency is unavailable, 75 when it is busy, and
70 for an internal error. An exception that embedpool did not raise on purpose is a bug: its
traceback is printed with the message.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from embedpool.errors import TABLE, EmbedpoolError, Kind, kind_of

COMMANDS = ["embed", "index", "search", "serve", "eval", "train_pooler", "bench"]


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
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - every error ends here, with its kind's exit code
        return report(args.command, exc)


def report(command: str, exc: Exception) -> int:
    """Print ``exc`` for the user and return its exit code (from the one table)."""
    kind = kind_of(exc)
    prog = f"embedpool {command}"
    if kind is Kind.INTERNAL and not isinstance(exc, EmbedpoolError):
        traceback.print_exception(exc, file=sys.stderr)
        print(f"{prog}: internal error (a bug in embedpool, please report it with the traceback "
              f"above): {type(exc).__name__}: {exc}", file=sys.stderr)
    else:
        hint = f" (retry in {exc.retry_after} s)" if getattr(exc, "retry_after", None) else ""
        print(f"{prog}: error: {exc}{hint}", file=sys.stderr)
    return TABLE[kind].exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
