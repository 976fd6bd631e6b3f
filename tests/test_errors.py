"""The one error taxonomy (``embedpool.errors``): every error class embedpool defines has a kind,
every kind has a row in the one table, and the kinds that are not the caller's fault never pass
for bad input (``ValueError`` & co.)."""

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


def _kind_owner(c: type) -> type:
    """The class in ``c``'s MRO whose own body sets ``kind``: ``EmbedpoolError`` itself means
    that ``c`` (and every class between) forgot to choose one."""
    return next(base for base in c.__mro__ if "kind" in vars(base))


def test_a_class_that_forgets_its_kind_is_caught():
    """The check below can fail: a subclass of the root without a kind of its own is flagged,
    one of a kind's class (or with its own ``kind``) is not."""
    from embedpool import errors

    class Forgot(EmbedpoolError):
        pass

    class ForgotTwice(Forgot):
        pass

    class Chose(EmbedpoolError):
        kind = Kind.CONFLICT

    assert _kind_owner(Forgot) is _kind_owner(ForgotTwice) is EmbedpoolError
    assert _kind_owner(Chose) is Chose and _kind_owner(errors.MissingFileError) is errors.NotFoundError


def test_the_table_covers_every_kind_once():
    assert set(TABLE) == set(Kind)
    statuses = [o.status for o in TABLE.values()]
    assert len(set(statuses)) == len(statuses)  # a status names one kind (the HTTP layer maps back)
    assert all(o.exit_code == 2 for k, o in TABLE.items()
               if k in (Kind.INVALID, Kind.TOO_LARGE, Kind.NOT_FOUND, Kind.CONFLICT, Kind.UNAUTHORIZED))
    assert TABLE[Kind.INTERNAL].exit_code == 70 and TABLE[Kind.INTERNAL].status == 500
    assert TABLE[Kind.UNAVAILABLE].status == 503 and TABLE[Kind.TOO_LARGE].status == 413


def test_every_error_class_has_a_mapped_kind():
    """Walks every module of the three layers: an exception class that is not an
    EmbedpoolError, or whose kind is not in the table, fails here."""
    from embedpool.app.server.errors import HTTP_ONLY, APIError

    classes = _error_classes()
    names = {c.__name__ for c in classes}
    # the walk really reached the three layers
    assert {"BackendError", "PoolerSpecError", "IndexJobError", "Overloaded", "APIError", "UsageError"} <= names
    unmapped = [f"{c.__module__}.{c.__qualname__}" for c in classes
                if c not in (EmbedpoolError, APIError)  # the root; APIError(message, kind=...) per instance
                and not (issubclass(c, EmbedpoolError) and _kind_owner(c) is not EmbedpoolError)]
    assert not unmapped, ("error classes that never chose a kind (they inherit the root's default, "
                          f"internal: a silent 500): {unmapped}")
    from embedpool import errors

    per_kind = [errors.InvalidError, errors.TooLargeError, errors.UnauthorizedError, errors.NotFoundError,
                errors.ConflictError, errors.OverloadedError, errors.UnavailableError, errors.InternalError]
    assert {k.kind for k in per_kind} == set(Kind)
    for c in classes:
        for base in per_kind:  # a subclass of the class of a kind has that kind
            if issubclass(c, base):
                assert c.kind is base.kind, (c, base)
        if issubclass(c, APIError) and c not in HTTP_ONLY:
            assert c.http_status is None and c("x").status == TABLE[c.kind].status, c


def test_errors_that_are_not_the_callers_fault_are_never_bad_input():
    user_builtins = (ValueError, TypeError, LookupError, OSError)
    for c in _error_classes():
        if issubclass(c, EmbedpoolError) and c.kind in (Kind.UNAVAILABLE, Kind.INTERNAL, Kind.OVERLOADED):
            assert not issubclass(c, user_builtins), f"{c.__qualname__} ({c.kind.value}) is a {c.__mro__}"


def test_backend_error_is_unavailable_not_invalid():
    from embedpool.index import BackendError, CollectionError

    assert BackendError.kind is Kind.UNAVAILABLE and TABLE[BackendError.kind].status == 503
    assert not issubclass(BackendError, (ValueError, CollectionError))


def test_foreign_exceptions_are_bugs_unless_their_meaning_is_plain():
    assert kind_of(TypeError("unexpected keyword")) is Kind.INTERNAL
    assert kind_of(KeyError("x")) is Kind.INTERNAL
    assert kind_of(ValueError("x")) is Kind.INTERNAL
    assert kind_of(FileNotFoundError(2, "No such file", "x.txt")) is Kind.NOT_FOUND
    assert kind_of(PermissionError(13, "Permission denied", "out.json")) is Kind.UNAVAILABLE
    with pytest.raises(UnicodeEncodeError) as e:
        "\ud800".encode("utf-8")
    assert kind_of(e.value) is Kind.INVALID


def test_mixins_keep_except_clauses_working():
    from embedpool import errors

    assert isinstance(errors.InvalidTypeError("x"), TypeError) and isinstance(errors.InvalidTypeError("x"), ValueError)
    missing = errors.MissingFileError("no such head")
    assert isinstance(missing, FileNotFoundError) and missing.kind is Kind.NOT_FOUND and str(missing) == "no such head"
    err = errors.InvalidError("bad", param="inputs[0]")
    assert (str(err), err.param, err.outcome) == ("bad", "inputs[0]", TABLE[Kind.INVALID])
