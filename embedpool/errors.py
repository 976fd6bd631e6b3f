"""The one error taxonomy of embedpool, shared by ``poolers``, ``index`` and ``app``.

Every error embedpool raises on purpose is an :class:`EmbedpoolError` with a :class:`Kind`. The
kind alone decides what a caller sees: :data:`TABLE` maps each kind, in one place, to the HTTP
status of the API and the exit code of the CLI (as TEI maps its one error enum in one match).
Messages are written for the person who has to fix the problem: what is wrong and what to do.

There is exactly one class per kind (:class:`InvalidError`, :class:`NotFoundError`, ...), and
every layer raises those, with the parameter at fault (``param``): the kind is what callers
catch and what the surfaces render, so there are no per-module subclasses to learn (as TEI
has one error enum; ``tests/test_errors.py`` pins that no module defines another). The kinds
the caller can fix keep the matching built-in as a second base (``ValueError`` for invalid, too
large and conflict, ``LookupError`` for not found) so that ``except ValueError`` keeps working for bad
arguments; unavailable and internal errors never do, so that a backend outage is never
mistaken for bad input.

An exception that is not an :class:`EmbedpoolError` was not raised on purpose: :func:`kind_of`
files it as internal (a bug), except for the few built-ins whose meaning does not depend on who
raised them (a missing file, another OS failure, text that is not valid Unicode).

This module imports nothing from embedpool, so every layer may import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import ClassVar


class Kind(str, Enum):
    """What went wrong, from the caller's point of view."""

    INVALID = "invalid"            # bad input: fix the request or the arguments
    TOO_LARGE = "too_large"        # over a configured limit: send less
    UNAUTHORIZED = "unauthorized"  # missing or wrong credentials
    NOT_FOUND = "not_found"        # a named collection, document, model or file does not exist
    CONFLICT = "conflict"          # exists with other settings, or locked by another writer
    OVERLOADED = "overloaded"      # busy: retry later
    UNAVAILABLE = "unavailable"    # a dependency is down or not ready (backend, model loading)
    INTERNAL = "internal"          # a bug, or stored data that contradicts itself


@dataclass(frozen=True)
class Outcome:
    """How one kind is reported: HTTP status, the API's ``type`` string, CLI exit code."""

    status: int
    type: str
    exit_code: int


# Exit codes: 2 for anything the user can fix by changing the command (argparse's own code for
# usage errors); the rest follow sysexits.h (69 unavailable, 70 software, 75 temporary failure).
TABLE: dict[Kind, Outcome] = {
    Kind.INVALID: Outcome(422, "validation_error", 2),
    Kind.TOO_LARGE: Outcome(413, "payload_too_large", 2),
    Kind.UNAUTHORIZED: Outcome(401, "unauthorized", 2),
    Kind.NOT_FOUND: Outcome(404, "not_found", 2),
    Kind.CONFLICT: Outcome(409, "conflict", 2),
    Kind.OVERLOADED: Outcome(429, "overloaded", 75),
    Kind.UNAVAILABLE: Outcome(503, "not_ready", 69),
    Kind.INTERNAL: Outcome(500, "internal_error", 70),
}


class EmbedpoolError(Exception):
    """Root of every error embedpool raises on purpose. Subclasses set :attr:`kind`.

    Args:
        message: what is wrong and what to do about it.
        param: the request field or CLI option at fault, if there is one.
        retry_after: seconds after which trying again may succeed (overloaded, unavailable).
        code: a short machine-readable reason within the kind, for the few answers a surface
            tells apart (the HTTP layer's ``HTTP_ONLY``: TEI's ``empty``, ``client_closed``).
    """

    kind: ClassVar[Kind] = Kind.INTERNAL

    def __init__(self, message: str = "", *, param: str | None = None,
                 retry_after: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.code = code

    def __str__(self) -> str:
        return self.message

    @property
    def outcome(self) -> Outcome:
        return TABLE[self.kind]


# ---------------------------------------------------------------------- one class per kind
class InvalidError(EmbedpoolError, ValueError):
    """Bad input: a value the caller must change."""

    kind = Kind.INVALID


class TooLargeError(EmbedpoolError, ValueError):
    """Over a configured limit (inputs, tokens, bytes): send less."""

    kind = Kind.TOO_LARGE


class UnauthorizedError(EmbedpoolError):
    """Missing or wrong credentials."""

    kind = Kind.UNAUTHORIZED


class NotFoundError(EmbedpoolError, LookupError):
    """Something named does not exist."""

    kind = Kind.NOT_FOUND


class ConflictError(EmbedpoolError, ValueError):
    """It exists with other settings, or another writer holds it."""

    kind = Kind.CONFLICT


class OverloadedError(EmbedpoolError):
    """Busy: retry after ``retry_after`` seconds."""

    kind = Kind.OVERLOADED


class UnavailableError(EmbedpoolError):
    """A dependency is down or not ready yet (a storage backend, the model loading)."""

    kind = Kind.UNAVAILABLE


class InternalError(EmbedpoolError):
    """A bug, or stored data that contradicts itself."""

    kind = Kind.INTERNAL


def import_extra(module: str, extra: str, what: str) -> object:
    """``module`` imported, or an :class:`UnavailableError` naming the extra that installs it.

    The HTTP API over FAISS needs none of the extras (they stay out of its image); the commands
    and backends that do call this where they first import one."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UnavailableError(
            f"{what} needs {module.split('.')[0]}, which is not installed: "
            f"pip install 'embedpool[{extra}]'") from e


# ---------------------------------------------------------------------- classification
def kind_of(exc: BaseException) -> Kind:
    """The kind of any exception: an :class:`EmbedpoolError`'s own; for the rest, a missing
    file is not found, another OS error (disk full, permission denied, connection refused) is
    unavailable, text that cannot be encoded or decoded is invalid, and anything else is a bug."""
    if isinstance(exc, EmbedpoolError):
        return exc.kind
    if isinstance(exc, FileNotFoundError):
        return Kind.NOT_FOUND
    if isinstance(exc, OSError):
        return Kind.UNAVAILABLE
    if isinstance(exc, UnicodeError):
        return Kind.INVALID
    return Kind.INTERNAL


def outcome(kind: Kind) -> Outcome:
    """The status, type and exit code of ``kind`` (a ``KeyError`` for an unmapped kind)."""
    return TABLE[kind]
