"""Errors raised by :mod:`index`: every one an :class:`embedpool.errors.EmbedpoolError`, whose
``kind`` decides the HTTP status and the CLI exit code (``embedpool.errors.TABLE``).

The errors the caller can fix subclass :class:`CollectionError`, a ``ValueError`` (the "not
found" ones are ``KeyError``\\ s too). The two that are not the caller's fault are deliberately
not ``CollectionError``\\ s, so that no ``except ValueError`` takes them for bad input:
:class:`BackendError` (the storage backend is down: unavailable, 503) and
:class:`CorruptCollectionError` (stored files contradict each other: internal, 500). Catch
``EmbedpoolError`` for all of them. Messages say what is wrong and what to do.
"""

from __future__ import annotations

from embedpool import errors
from embedpool.errors import Kind


class CollectionError(errors.EmbedpoolError, ValueError):
    """Base class of the index errors the caller can fix (a ``ValueError``)."""

    kind = Kind.INVALID


class NotFoundError(CollectionError, errors.NotFoundError, KeyError):
    """Something named does not exist (also a ``KeyError``)."""

    kind = Kind.NOT_FOUND


class CollectionNotFoundError(NotFoundError):
    """No collection of that name in the data directory."""


class DocumentNotFoundError(NotFoundError):
    """An id that is not in the collection (``get``, ``delete``)."""


class NotACollectionError(CollectionError, errors.ConflictError):
    """A folder that is not an embedpool collection (no or unreadable manifest/document store):
    the name is taken by something else."""

    kind = Kind.CONFLICT


class FormatVersionError(CollectionError, errors.ConflictError):
    """The collection was written by a newer embedpool (manifest format version too new)."""

    kind = Kind.CONFLICT


class SpecMismatchError(CollectionError, errors.ConflictError):
    """Vectors, queries or a requested spec do not match the collection's manifest
    (dimension, kind, model, pooler, ...)."""

    kind = Kind.CONFLICT


class InvalidInputError(CollectionError, errors.InvalidError):
    """Bad input: NaN/inf values, duplicate ids in a batch, wrong shapes, bad arguments."""


class TrainingError(InvalidInputError):
    """An index that needs training (IVF, PQ) was given too few vectors to train on."""


class CollectionLockedError(CollectionError, errors.ConflictError):
    """Another writer holds the collection, or it changed on disk since it was opened."""

    kind = Kind.CONFLICT


class CorruptCollectionError(errors.InternalError):
    """The files of a collection contradict each other (should never happen after a crash)."""


class BackendError(errors.UnavailableError):
    """The storage backend failed or is unreachable (a Milvus server down, a Milvus error):
    not the caller's fault, an HTTP layer answers 503."""
