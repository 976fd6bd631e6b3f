"""Collection spec and the ``manifest.json`` that records it."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedpool.errors import ConflictError, InvalidError
from embedpool.precisions import STORAGE_PRECISIONS
from .lexical import DEFAULT as DEFAULT_ANALYZER
from .lexical import NONE as NO_ANALYZER
from .lexical import canonical_analyzer

#: Version of the on-disk layout written by this code. Opening a newer one is refused. Version 2
#: added the companion rows a collection manages (``companion_pooler``); version 3 indexes every
#: document's metadata values for filters and its text for BM25 (``analyzer``) in the same
#: commit, so every collection this code creates is version 3: an embedpool that knows only 2
#: refuses it instead of writing documents that filters and lexical search would not find.
FORMAT_VERSION = 3
#: Version 4: a sparse collection (``kind="sparse"``, :mod:`index.sparse`), written with this
#: version so that an embedpool that knows only version 3 refuses it ("upgrade embedpool") instead
#: of failing on a kind it does not know; dense collections are still written as version 3.
SPARSE_FORMAT_VERSION = 4
NEWEST_FORMAT_VERSION = SPARSE_FORMAT_VERSION
COMPANION_ROWS = ("document", "window")
FORMAT_NAME = "embedpool-collection"
MANIFEST = "manifest.json"

KINDS = ("single", "multi", "sparse")
METRICS = ("ip", "l2")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")

#: Fields compared when a collection is re-created, per kind (the others do not apply).
_FIELDS = {
    "single": ("kind", "model", "pooler", "dim", "metric", "normalized", "factory", "analyzer"),
    "multi": ("kind", "model", "pooler", "dim", "metric", "normalized", "precision",
              "token_factory", "companion_pooler", "companion_dim", "companion_rows",
              "companion_factory", "analyzer"),
    "sparse": ("kind", "model", "pooler", "dim", "metric", "normalized", "factory", "analyzer"),
}


def check_name(name: str) -> str:
    """A collection name is a plain folder name: letters, digits, ``.``, ``_``, ``-``."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or name in (".", ".."):
        raise InvalidError(
            f"invalid collection name {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit", param="name")
    return name


@dataclass(frozen=True)
class CollectionSpec:
    """What a collection stores; recorded in its manifest and checked on every write.

    Args:
        kind: ``single`` (one vector per document, FAISS), ``multi`` (token vectors, MaxSim) or
            ``sparse`` (one sparse row of token ids and weights per document, :mod:`index.sparse`).
        model: id of the model that made the vectors (recorded; ``add(model=...)`` must match).
        pooler: pooler spec string (recorded; ``add(pooler=...)`` must match).
        dim: vector dimension (sparse: the vocabulary's size).
        metric: ``ip`` (inner product; cosine when normalized) or ``l2`` (single only).
        normalized: vectors are L2-normalized; ``add`` refuses vectors whose norm is not ~1.
        factory: single: FAISS index factory string (``IDMap2,Flat``, ``HNSW32``, ``IVF256,PQ32``, ...);
            sparse: ``auto``, ``exact`` or ``seismic[:options]`` (:func:`index.sparse.parse_sparse_factory`).
        precision: multi: storage precision of token vectors, ``float32`` | ``float16`` | ``int8``.
        token_factory: multi: FAISS factory of the token-level ANN index used by ``mode="tokens"``.
        companion_pooler: multi: pooler spec of the companion -- the single vectors the collection
            keeps for ``two_stage`` candidates (``mean``, ``fde:...``), written by every ``add``
            (its ``companion=`` argument) and ``delete`` in the same commit as the documents. (A
            manifest of an older embedpool may name a separate companion collection instead,
            ``companion``: it is not read; ``two_stage`` on such a collection says what to do.)
        companion_dim: their dimension (with ``companion_pooler``).
        companion_rows: ``document`` (one companion vector per document) or ``window`` (one or
            more per document, e.g. one per window of a long document; candidates are the
            distinct documents of the best rows).
        companion_factory: FAISS factory of the companion index (``IDMap2,Flat``, ``HNSW32``, ...).
        encoder_precision: the encoder path the vectors were made with (``fp32``,
            ``openvino-bf16``, ...); recorded only, never compared (paths within the quality bar
            make compatible vectors).
        analyzer: how the lexical (BM25) index analyzes texts and queries
            (:mod:`index.lexical`): a language with its stemmer and stopwords (``english``,
            ``english:stem=false``, ``german:stopwords=false``, ...), or ``none`` for no lexical
            index. Collections made before BM25 read as ``none``.
    """

    kind: str = "single"
    model: str = ""
    pooler: str = ""
    dim: int = 384
    metric: str = "ip"
    normalized: bool = True
    factory: str = "IDMap2,Flat"
    precision: str = "float32"
    token_factory: str = "HNSW32"
    encoder_precision: str | None = None
    companion_pooler: str | None = None
    companion_dim: int = 0
    companion_rows: str = "document"
    companion_factory: str = "IDMap2,Flat"
    analyzer: str = DEFAULT_ANALYZER

    def validate(self) -> "CollectionSpec":
        """Raise :class:`InvalidError` naming the bad field; return self."""
        import faiss

        if self.kind not in KINDS:
            raise InvalidError(f"spec.kind={self.kind!r}: use 'single', 'multi' or 'sparse'", param="kind")
        if not isinstance(self.model, str) or not isinstance(self.pooler, str):
            raise InvalidError("spec.model and spec.pooler must be strings", param="model")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim <= 0:
            raise InvalidError(f"spec.dim={self.dim!r}: must be a positive integer", param="dim")
        if self.metric not in METRICS:
            raise InvalidError(f"spec.metric={self.metric!r}: use 'ip' or 'l2'", param="metric")
        if not isinstance(self.normalized, bool):
            raise InvalidError("spec.normalized must be true or false", param="normalized")
        if canonical_analyzer(self.analyzer) != self.analyzer:
            raise InvalidError(f"spec.analyzer={self.analyzer!r}: write it as "
                               f"{canonical_analyzer(self.analyzer)!r}", param="analyzer")
        if self.kind == "sparse":
            self._validate_sparse()
        elif self.kind == "single":
            _check_factory("factory", self.factory, self.dim, self.metric)
            if self.companion_pooler is not None:
                raise InvalidError("spec.companion_pooler: only multi-vector collections have a companion",
                                   param="companion_pooler")
        else:
            if self.metric != "ip":
                raise InvalidError("multi-vector collections score by MaxSim: spec.metric must be 'ip'", param="metric")
            if self.precision not in STORAGE_PRECISIONS:
                raise InvalidError(
                    f"spec.precision={self.precision!r}: use one of {', '.join(STORAGE_PRECISIONS)}", param="precision")
            try:
                faiss.index_factory(self.dim, self.token_factory, faiss.METRIC_INNER_PRODUCT)
            except Exception as e:
                raise InvalidError(
                    f"spec.token_factory={self.token_factory!r} is not a valid FAISS index factory "
                    f"string: {_first_line(e)}", param="token_factory") from None
            if self.companion_pooler is not None:
                self._validate_companion()
        return self

    def _validate_sparse(self) -> None:
        from .sparse import parse_sparse_factory

        if self.metric != "ip":
            raise InvalidError("sparse collections score by dot product: spec.metric must be 'ip'", param="metric")
        if self.normalized:
            raise InvalidError("sparse collections store their weights as they are: spec.normalized must be false",
                               param="normalized")
        if self.companion_pooler is not None:
            raise InvalidError("spec.companion_pooler: only multi-vector collections have a companion",
                               param="companion_pooler")
        parse_sparse_factory(self.factory, "factory")

    def _validate_companion(self) -> None:
        if not isinstance(self.companion_pooler, str) or not self.companion_pooler:
            raise InvalidError("spec.companion_pooler must be a pooler spec string such as 'mean'",
                               param="companion_pooler")
        if isinstance(self.companion_dim, bool) or not isinstance(self.companion_dim, int) or self.companion_dim <= 0:
            raise InvalidError(f"spec.companion_dim={self.companion_dim!r}: must be a positive integer",
                               param="companion_dim")
        if self.companion_rows not in COMPANION_ROWS:
            raise InvalidError(
                f"spec.companion_rows={self.companion_rows!r}: use one of {', '.join(COMPANION_ROWS)}",
                param="companion_rows")
        _check_factory("companion_factory", self.companion_factory, self.companion_dim, "ip")

    def companion_spec(self) -> "CollectionSpec":
        """The single-vector spec of the companion vectors a collection manages (``companion_pooler``)."""
        return CollectionSpec(kind="single", model=self.model, pooler=self.companion_pooler or "",
                              dim=self.companion_dim, metric="ip", normalized=self.normalized,
                              factory=self.companion_factory)

    @property
    def format_version(self) -> int:
        """The layout version a collection of this spec is written with (see :data:`FORMAT_VERSION`)."""
        return SPARSE_FORMAT_VERSION if self.kind == "sparse" else FORMAT_VERSION

    @property
    def lexical(self) -> bool:
        """The collection keeps a lexical (BM25) index."""
        return self.analyzer != NO_ANALYZER

    def fields(self) -> tuple[str, ...]:
        """The fields that matter for this kind (compared on re-create)."""
        return _FIELDS.get(self.kind, _FIELDS["single"])

    def differences(self, other: "CollectionSpec") -> list[str]:
        """Human-readable list of differing relevant fields (``field: existing X, requested Y``)."""
        names = self.fields() if self.kind == other.kind else ("kind",)
        return [f"{n}: existing {getattr(self, n)!r}, requested {getattr(other, n)!r}"
                for n in names if getattr(self, n) != getattr(other, n)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CollectionSpec":
        names = {f.name for f in dataclasses.fields(cls)}
        # a manifest written before lexical indexes existed has none
        return cls(**{"analyzer": NO_ANALYZER, **{k: v for k, v in d.items() if k in names}})


def _check_factory(field: str, factory: str, dim: int, metric: str) -> None:
    import faiss

    try:
        idx = faiss.index_factory(dim, factory, _faiss_metric(metric))
    except Exception as e:  # faiss raises RuntimeError with a long C++ trace
        raise InvalidError(
            f"spec.{field}={factory!r} is not a valid FAISS index factory string for dim {dim}: "
            f"{_first_line(e)}", param=field) from None
    if type(idx).__name__ == "IndexIDMap":
        raise InvalidError(
            f"spec.{field}={factory!r}: use 'IDMap2,...' (IDMap cannot return stored vectors), or "
            "leave the IDMap prefix out", param=field)


def _faiss_metric(metric: str) -> int:
    import faiss

    return faiss.METRIC_INNER_PRODUCT if metric == "ip" else faiss.METRIC_L2


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:  # faiss: "Error in ... at file:line: Error: 'cond' failed: message"
        if "Error:" in ln:
            return ln.split("Error:", 1)[1].strip()
    return lines[0] if lines else type(e).__name__


def read_manifest(folder: Path) -> dict[str, Any]:
    """Load and check ``manifest.json``; raise NotACollection / FormatVersion errors."""
    path = folder / MANIFEST
    if not path.is_file():
        raise ConflictError(
            f"{folder.name!r} is not an embedpool collection (no {MANIFEST}); pass the data directory "
            "and a collection name, or create the collection first")
    where = f"the manifest of collection {folder.name!r}"  # not the server's folders
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else str(e)
        raise ConflictError(f"{where} is not readable: {reason}") from None
    return parse_manifest(text, where)


def new_manifest(name: str, spec: CollectionSpec, created: str, **extra: Any) -> dict[str, Any]:
    """The manifest of a new collection (``extra``: e.g. ``backend``, ``counts``)."""
    return {"format": FORMAT_NAME, "format_version": spec.format_version, "name": name,
            **spec.to_dict(), **extra, "created": created, "updated": created}


def parse_manifest(text: str, where: str) -> dict[str, Any]:
    """Parse and check a manifest (JSON text from a file or a Milvus collection property);
    raise NotACollection / FormatVersion errors naming ``where``."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConflictError(f"{where} is not a readable collection manifest: {e}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise ConflictError(
            f"{where} is not an embedpool collection manifest (missing \"format\": \"{FORMAT_NAME}\")")
    version = data.get("format_version")
    if not isinstance(version, int) or version < 1:
        raise ConflictError(f"{where}: bad format_version {version!r}")
    if version > NEWEST_FORMAT_VERSION:
        raise ConflictError(
            f"{where} has format version {version}, newer than this embedpool supports "
            f"({NEWEST_FORMAT_VERSION}); upgrade embedpool to open it")
    try:
        CollectionSpec.from_dict(data).validate()
    except InvalidError as e:
        raise ConflictError(f"{where}: invalid spec in manifest: {e}") from None
    return data
