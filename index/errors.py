"""Errors raised by :mod:`index`.

Every error subclasses :class:`CollectionError`, itself a :class:`ValueError`, so callers (the
CLI, the HTTP layer) can treat them all as user errors. Messages say what is wrong and what to do.
"""

from __future__ import annotations


class CollectionError(ValueError):
    """Base class of every index error (a ``ValueError``: a user error, not a bug)."""


#: Alias kept for callers that name the base error after the package.
IndexError_ = CollectionError


class NotFoundError(CollectionError, KeyError):
    """Something named does not exist (also a ``KeyError``)."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class CollectionNotFoundError(NotFoundError):
    """No collection of that name in the data directory."""


class DocumentNotFoundError(NotFoundError):
    """An id that is not in the collection (``get``, ``delete``)."""


class NotACollectionError(CollectionError):
    """A folder that is not an embedpool collection (no or unreadable manifest/document store)."""


class FormatVersionError(CollectionError):
    """The collection was written by a newer embedpool (manifest format version too new)."""


class SpecMismatchError(CollectionError):
    """Vectors, queries or a requested spec do not match the collection's manifest
    (dimension, kind, model, pooler, ...)."""


class InvalidInputError(CollectionError):
    """Bad input: NaN/inf values, duplicate ids in a batch, wrong shapes, bad arguments."""


class TrainingError(InvalidInputError):
    """An index that needs training (IVF, PQ) was given too few vectors to train on."""


class CollectionLockedError(CollectionError):
    """Another writer holds the collection, or it changed on disk since it was opened."""


class CorruptCollectionError(CollectionError):
    """The files of a collection contradict each other (should never happen after a crash)."""


class BackendError(CollectionError):
    """The storage backend failed or is unreachable (a Milvus server down, a Milvus error);
    not the caller's fault -- an HTTP layer should answer 503."""
