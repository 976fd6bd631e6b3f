"""The one error taxonomy (``embedpool.errors``): one error class per kind and no other error
class anywhere, every kind has a row in the one table (pinned here with literal statuses and
exit codes), and the kinds that are not the caller's fault never pass for bad input
(``ValueError`` & co.)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from embedpool.errors import TABLE, EmbedpoolError, Kind, kind_of

PACKAGES = ("embedpool", "embedpool.app", "embedpool.index", "embedpool.poolers")


def _modules() -> list:
    seen = {}
    for name in PACKAGES:
        pkg = importlib.import_module(name)
        seen[name] = pkg
        for info in pkgutil.walk_packages(pkg.__path__, prefix=name + "."):
            seen.setdefault(info.name, importlib.import_module(info.name))
    return list(seen.values())


def _error_classes() -> list[type[BaseException]]:
    out = []
    for module in _modules():
        for _, obj in inspect.getmembers(module, inspect.isclass):
            if issubclass(obj, BaseException) and obj.__module__ == module.__name__:
                out.append(obj)
    return out


#: The one table, written out: a change of a status or an exit code is a change of the API and
#: of every script that reads the exit code, so it must show up here (not only in TABLE).
EXPECTED = {
    Kind.INVALID: (422, "validation_error", 2),
    Kind.TOO_LARGE: (413, "payload_too_large", 2),
    Kind.UNAUTHORIZED: (401, "unauthorized", 2),
    Kind.NOT_FOUND: (404, "not_found", 2),
    Kind.CONFLICT: (409, "conflict", 2),
    Kind.OVERLOADED: (429, "overloaded", 75),
    Kind.UNAVAILABLE: (503, "not_ready", 69),
    Kind.INTERNAL: (500, "internal_error", 70),
}


def test_the_table_covers_every_kind_once():
    assert {k: (o.status, o.type, o.exit_code) for k, o in TABLE.items()} == EXPECTED


def _per_kind() -> dict[Kind, type]:
    from embedpool import errors

    return {Kind.INVALID: errors.InvalidError, Kind.TOO_LARGE: errors.TooLargeError,
            Kind.UNAUTHORIZED: errors.UnauthorizedError, Kind.NOT_FOUND: errors.NotFoundError,
            Kind.CONFLICT: errors.ConflictError, Kind.OVERLOADED: errors.OverloadedError,
            Kind.UNAVAILABLE: errors.UnavailableError, Kind.INTERNAL: errors.InternalError}


def _extra_classes(classes: list[type]) -> list[str]:
    """The error classes of ``classes`` that are not the root or a kind's one class."""
    allowed = {EmbedpoolError, *_per_kind().values()}
    return [f"{c.__module__}.{c.__qualname__}" for c in classes if c not in allowed]


def test_a_second_class_of_a_kind_is_caught():
    """The check below can fail: a subclass of a kind's class, or of the root, is flagged."""
    from embedpool import errors

    class Mine(errors.InvalidError):
        pass

    class Rooted(EmbedpoolError):
        kind = Kind.CONFLICT

    assert _extra_classes([errors.InvalidError, Mine, Rooted, EmbedpoolError]) == [
        f"{__name__}.{Mine.__qualname__}", f"{__name__}.{Rooted.__qualname__}"]


def test_one_error_class_per_kind():
    """Walks every module of the three layers: every exception class embedpool defines is the
    root or the one class of a kind in ``embedpool.errors``, and each of those has its kind."""
    classes = _error_classes()
    # the walk really reached the three layers and the HTTP layer
    assert {m.__name__ for m in _modules()} >= {"embedpool.app.server.errors", "embedpool.index.backends",
                                                "embedpool.poolers.base", "embedpool.app.batcher"}
    assert not _extra_classes(classes), ("error classes beside the one class per kind of embedpool.errors "
                                         f"(raise the kind's class with param=...): {_extra_classes(classes)}")
    assert {kind: cls.kind for kind, cls in _per_kind().items()} == {k: k for k in Kind}
    assert all(c.__module__ == "embedpool.errors" for c in _per_kind().values())


def test_errors_that_are_not_the_callers_fault_are_never_bad_input():
    user_builtins = (ValueError, TypeError, LookupError, OSError)
    for kind in (Kind.UNAVAILABLE, Kind.INTERNAL, Kind.OVERLOADED):
        c = _per_kind()[kind]
        assert not issubclass(c, user_builtins), f"{c.__qualname__} ({kind.value}) is a {c.__mro__}"
    for kind in (Kind.INVALID, Kind.TOO_LARGE, Kind.CONFLICT):
        assert issubclass(_per_kind()[kind], ValueError)
    assert issubclass(_per_kind()[Kind.NOT_FOUND], LookupError)


def test_foreign_exceptions_are_bugs_unless_their_meaning_is_plain():
    assert kind_of(TypeError("unexpected keyword")) is Kind.INTERNAL
    assert kind_of(KeyError("x")) is Kind.INTERNAL
    assert kind_of(ValueError("x")) is Kind.INTERNAL
    assert kind_of(FileNotFoundError(2, "No such file", "x.txt")) is Kind.NOT_FOUND
    assert kind_of(PermissionError(13, "Permission denied", "out.json")) is Kind.UNAVAILABLE
    with pytest.raises(UnicodeEncodeError) as e:
        "\ud800".encode("utf-8")
    assert kind_of(e.value) is Kind.INVALID


def test_an_error_carries_its_parameter_and_reason():
    from embedpool import errors

    err = errors.InvalidError("bad", param="inputs[0]")
    assert (str(err), err.param, err.code, err.outcome) == ("bad", "inputs[0]", None, TABLE[Kind.INVALID])
    assert isinstance(err, ValueError) and not isinstance(errors.UnavailableError("down"), ValueError)
    busy = errors.OverloadedError("queue full", retry_after=3, code="queue")
    assert (busy.retry_after, busy.code, busy.outcome.status) == (3, "queue", 429)
