"""The lexical side of a collection: an analyzer (the collection setting ``analyzer``) and the
BM25 index it feeds, kept in the same commit as the vectors.

**Analyzer.** ``english`` (the default), ``english:stem=false``, ``german:stopwords=false``,
... or ``none`` (no lexical index): the text is split into words of two or more word characters,
lowercased, stopwords of the language dropped, and the rest stemmed by the language's Snowball
stemmer -- ``bm25s.tokenize`` with PyStemmer, the tokenization of the issue's reference BM25
numbers, from the libraries themselves. Queries go through the same analyzer.

**Index (FAISS backend).** An SQLite FTS5 table in the collection's document store
(``docs.sqlite``): one row per document (``rowid`` = its internal id) holding its analyzed terms,
written, replaced and deleted in the same SQLite transaction as the document rows and the names
of the vector files -- so the lexical and the vector side of a collection are one commit, and a
crash between commits loses neither. Scores are FTS5's ``bm25()``: BM25 with k1 = 1.2, b = 0.75
and the Robertson--Sparck Jones idf ``log((N - n + 0.5) / (n + 0.5))`` (floored at 1e-6 where it
would be negative); the query is the OR of its terms, so a document scores when it shares any;
a metadata filter is a condition of the same SQL query, so ``k`` hits come back whenever ``k``
matching documents contain a query term.

Why FTS5, measured against the two libraries the issue names (``bench/lexical.py``, numbers in
docs/storage.md): bm25s 0.3.16 scores SciFact queries faster (a sparse matrix product) but
builds its index in one pass over the whole corpus and cannot add or delete a document -- every
commit would re-index the collection; tantivy 0.27 updates incrementally but keeps its own
files with their own commit point, so an upsert would be two commits that a crash can separate.
FTS5 is in the standard library's SQLite, updates per document, and commits with the vectors.
Its terms are the analyzer's, joined by spaces, under FTS5's ``ascii`` tokenizer with ``_`` as
a token character: that splits them back exactly as the analyzer made them.

**Milvus** computes BM25 itself where the server has full-text search (Milvus 2.5+: a BM25
function from the ``text`` field to a sparse vector field, with the analyzer mapped by
:func:`milvus_analyzer`); a server without it says so when a lexical search is asked for.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from functools import lru_cache

from embedpool.errors import InvalidError

#: language -> (Snowball stemmer name, bm25s stopword list)
LANGUAGES = {
    "english": ("english", "en"), "german": ("german", "de"), "dutch": ("dutch", "nl"),
    "french": ("french", "fr"), "spanish": ("spanish", "es"), "portuguese": ("portuguese", "pt"),
    "italian": ("italian", "it"), "russian": ("russian", "ru"), "swedish": ("swedish", "sv"),
    "norwegian": ("norwegian", "no"), "danish": ("danish", "da"), "turkish": ("turkish", "tr"),
}
NONE = "none"
DEFAULT = "english"
#: the FTS5 table of the document store and its tokenizer (see the module docstring)
FTS_TABLE = "lex"
#: (``detail=full``, FTS5's default: bm25() ran 4x faster with it than with ``detail=none`` on
#: SciFact queries, both in one probe run -- without positions FTS5 recounts each row's tf)
FTS_SCHEMA = f"CREATE VIRTUAL TABLE {FTS_TABLE} USING fts5(terms, tokenize=\"ascii tokenchars '_'\")"
#: most distinct terms of one query (longer queries keep their first ones)
MAX_QUERY_TERMS = 256


@dataclass(frozen=True)
class Analyzer:
    """How text becomes terms: ``language`` (:data:`LANGUAGES`), ``stem``, ``stopwords``."""

    language: str = DEFAULT
    stem: bool = True
    stopwords: bool = True

    @property
    def spec(self) -> str:
        opts = [f"{k}=false" for k in ("stem", "stopwords") if not getattr(self, k)]
        return self.language + (":" + ",".join(opts) if opts else "")

    def terms(self, texts: list[str | None]) -> list[list[str]]:
        """The terms of each text (``None`` has none)."""
        import bm25s

        present = [t for t in texts if t]
        if not present:
            return [[] for _ in texts]
        stemmer_name, stop = LANGUAGES[self.language]
        out = bm25s.tokenize(present, lower=True, stopwords=stop if self.stopwords else None,
                             stemmer=_stemmer(stemmer_name) if self.stem else None,
                             return_ids=False, show_progress=False)
        it = iter(out)
        return [next(it) if t else [] for t in texts]

    def document_terms(self, texts: list[str | None]) -> list[str]:
        """What the FTS5 table stores per document: its terms joined by spaces."""
        return [" ".join(t) for t in self.terms(texts)]

    def match(self, text: str) -> str | None:
        """The FTS5 MATCH expression of a query (its terms OR-ed), or None when it has none."""
        terms = list(dict.fromkeys(self.terms([text])[0]))[:MAX_QUERY_TERMS]
        return " OR ".join(f'"{t}"' for t in terms) if terms else None


class _Stemmers(threading.local):
    """PyStemmer stemmers are not thread-safe: one per thread and language."""

    def __init__(self) -> None:
        self.by_name: dict[str, object] = {}


_STEMMERS = _Stemmers()


def _stemmer(name: str):
    s = _STEMMERS.by_name.get(name)
    if s is None:
        import Stemmer

        s = _STEMMERS.by_name[name] = Stemmer.Stemmer(name).stemWords
    return s


@lru_cache(maxsize=64)
def parse_analyzer(spec: str | None) -> Analyzer | None:
    """The analyzer of a spec string (``None`` for ``none``); :class:`InvalidError` naming
    what is wrong."""
    if spec is None or spec == NONE:
        return None
    if not isinstance(spec, str):
        raise InvalidError(f"spec.analyzer must be a string such as {DEFAULT!r} or {NONE!r}", param="analyzer")
    lang, _, rest = spec.partition(":")
    if lang not in LANGUAGES:
        raise InvalidError(f"spec.analyzer={spec!r}: unknown language {lang!r}; use one of "
                           f"{', '.join(LANGUAGES)}, or {NONE!r} for no lexical index", param="analyzer")
    opts = {}
    for part in filter(None, rest.split(",")):
        k, eq, v = part.partition("=")
        if k not in ("stem", "stopwords") or not eq or v not in ("true", "false"):
            raise InvalidError(f"spec.analyzer={spec!r}: options are stem=true|false and "
                               "stopwords=true|false", param="analyzer")
        opts[k] = v == "true"
    return Analyzer(lang, **opts)


def canonical_analyzer(spec: str | None) -> str:
    a = parse_analyzer(spec)
    return NONE if a is None else a.spec


def milvus_analyzer(a: Analyzer) -> dict:
    """Milvus' analyzer parameters closest to ``a`` (its standard tokenizer, lowercase, the
    language's stopwords and Snowball stemmer)."""
    filters: list = ["lowercase"]
    if a.stopwords:
        filters.append({"type": "stop", "stop_words": [f"_{a.language}_"]})
    if a.stem:
        filters.append({"type": "stemmer", "language": a.language})
    return {"tokenizer": "standard", "filter": filters}
