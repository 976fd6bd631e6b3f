"""Every dataset embedpool reads, in one module: corpora streamed record by record (BEIR
``corpus.jsonl``, JSON lines with chosen fields, Parquet, plain text lines, stdin), BEIR
retrieval sets (corpus, queries, qrels) and STS TSVs. The index job, ``embedpool eval``,
``embedpool train-pooler`` and the benchmarks in ``bench/`` all read through it, so they
agree on what a document is.

One set of rules for every reader (pinned by ``tests/app/test_datasets.py``):

* **Documents** are ``title + " " + text``, stripped, when they have a title (BEIR); a ``null``
  title or text is empty text. A record without an id (missing or ``null``) or without its text
  field is an error naming the line; so is a text that is not a string, and an id or a
  ``metadata`` object that not every backend can store (:func:`index.check_document`, with the
  source's ``max_metadata_depth`` / ``max_metadata_bytes``): the error names the line, the id
  and the value's path (``metadata.v``), and is raised as the record is read, so nothing of the
  batch it would have joined is written.
* **JSON lines**: blank lines are skipped; a line that is not a JSON object is an error naming it.
* **Queries** (``queries.jsonl``): ``_id`` and ``text`` (``null`` text is empty).
* **Qrels**: a first line whose last column is not an integer is a header (BEIR writes
  ``query-id corpus-id score``; files without one are read too); three columns (BEIR) or four
  (TREC: query, iteration, document, relevance); judgments with relevance <= 0 are dropped; a
  line with too few columns or a non-integer relevance is an error naming it.
* **STS** (``<split>.tsv``): a header naming ``sentence1``, ``sentence2`` and ``score`` (in any
  order; other columns are ignored); empty sentences are kept (an empty string is a valid
  input); a row without all three or with a non-numeric score is an error naming the line.

Hand-written rather than the ``beir`` package's ``GenericDataLoader``: that loader reads a
whole corpus into memory (the index job streams it), reports no line numbers, and would pull
its own dependencies into the project; the formats themselves are a few lines of ``json`` and
``csv``. Parquet is read with pyarrow, in record batches.
"""

from __future__ import annotations

import csv
import io
import json
import random
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from embedpool.errors import InvalidError, NotFoundError, import_extra
from embedpool.index import MAX_METADATA_BYTES, MAX_METADATA_DEPTH, check_document

FORMATS = ("auto", "beir", "jsonl", "parquet", "text")


@dataclass
class Record:
    id: str
    text: str
    metadata: dict | None = None


def document_text(title: Any, text: Any) -> str:
    """The text of a document with a title: ``title + " " + text``, stripped (``None`` is empty)."""
    return ((title or "") + " " + (text or "")).strip()


# ---------------------------------------------------------------------------------- corpora
@dataclass(frozen=True)
class CorpusSource:
    """Where the documents come from and how to read them.

    Args:
        path: a file, or ``-`` for stdin.
        format: ``auto`` (by suffix and content), ``beir`` (``_id``, ``title`` + ``text``),
            ``jsonl`` (``id_field``/``text_field``), ``parquet`` or ``text`` (one document per
            line, the id is the line number starting at 0).
        id_field / text_field: JSON / Parquet field names (default ``_id`` or ``id``, and ``text``).
        title_field: prepended to the text with a space (BEIR: ``title``).
        max_metadata_depth / max_metadata_bytes: the limits on a record's metadata (the settings
            of the same names; not part of :meth:`describe`: a rerun may change them).
    """

    path: str
    format: str = "auto"
    id_field: str | None = None
    text_field: str | None = None
    title_field: str | None = None
    max_metadata_depth: int = MAX_METADATA_DEPTH
    max_metadata_bytes: int = MAX_METADATA_BYTES

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise InvalidError(f"unknown corpus format {self.format!r}; use one of {', '.join(FORMATS)}",
                               param="--format")
        if self.path != "-" and not Path(self.path).is_file():
            raise NotFoundError(f"corpus file {self.path} does not exist", param="CORPUS")

    @property
    def is_stdin(self) -> bool:
        return self.path == "-"

    def resolved_format(self) -> str:
        if self.format != "auto":
            return self.format
        if self.is_stdin:
            return "jsonl"  # JSON lines; plain lines are read as text records (see _read_lines)
        name = Path(self.path).name.lower()
        if name.endswith((".parquet", ".pq")):
            return "parquet"
        if name.endswith(".txt"):
            return "text"
        return "jsonl"

    def describe(self) -> dict[str, Any]:
        """What the job state pins about the source."""
        return {"path": "-" if self.is_stdin else str(Path(self.path).resolve()),
                "format": self.resolved_format(), "id_field": self.id_field,
                "text_field": self.text_field, "title_field": self.title_field}

    def count(self) -> int | None:
        """Number of records (for the ETA), or ``None`` for stdin."""
        fmt = self.resolved_format()
        if self.is_stdin:
            return None
        if fmt == "parquet":
            pq = _parquet()

            return pq.ParquetFile(self.path).metadata.num_rows
        n, last = 0, b"\n"
        with open(self.path, "rb") as f:
            while chunk := f.read(1 << 20):
                n += chunk.count(b"\n")
                last = chunk[-1:]
        if last != b"\n":
            n += 1
        return n

    def records(self) -> Iterator[Record]:
        fmt = self.resolved_format()
        if fmt == "parquet":
            yield from self._read_parquet()
            return
        if self.is_stdin:
            stream = sys.stdin
            yield from self._read_lines(stream, fmt)
            return
        with open(self.path, encoding="utf-8") as f:
            yield from self._read_lines(f, fmt)

    # -- slices: the same records, read in parts that can be read anywhere
    def slices(self, size: int, max_bytes: int | None = None) -> list["CorpusSlice"]:
        """The corpus cut into slices of at most ``size`` records and, with ``max_bytes``, at most
        that many bytes of the file (a record larger than ``max_bytes`` is a slice of its own):
        record positions ``[start, stop)`` and where they are in the file. The bytes of a record
        stand for its tokens (an indexing job sizes its work in tokens; a read task cannot
        tokenize before it reads). JSON lines and text are scanned once for line starts (blank
        lines stay in the slice before them); Parquet needs only its footer, and sizes a slice
        by its row groups' bytes per row. Not for stdin."""
        if self.is_stdin:
            raise InvalidError("stdin cannot be read in slices; give the corpus as a file", param="CORPUS")
        size = max(1, int(size))
        limit = None if max_bytes is None else max(1, int(max_bytes))
        fmt = self.resolved_format()
        if fmt == "parquet":
            return self._parquet_slices(size, limit)
        starts: list[tuple[int, int, int]] = []  # (record position, byte offset, line number) of each slice
        n, offset = 0, 0
        with open(self.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if fmt == "text" or not _blank(line):
                    if not starts or n - starts[-1][0] >= size or (
                            limit is not None and offset - starts[-1][1] + len(line) > limit and n > starts[-1][0]):
                        starts.append((n, offset, lineno))
                    n += 1
                offset += len(line)
        bounds = [(p, o) for p, o, _ in starts[1:]] + [(n, offset)]
        return [CorpusSlice(k, p, stop, o, e, line)
                for k, ((p, o, line), (stop, e)) in enumerate(zip(starts, bounds))]

    def _parquet_slices(self, size: int, limit: int | None) -> list["CorpusSlice"]:
        """Slices of ``size`` rows of a Parquet file, fewer where ``limit`` bytes hold fewer rows
        of its largest rows per row group (uncompressed bytes per row, from the footer)."""
        pq = _parquet()

        meta = pq.ParquetFile(self.path).metadata
        n = meta.num_rows
        if limit is not None and n:
            per_row = max(meta.row_group(g).total_byte_size / max(meta.row_group(g).num_rows, 1)
                          for g in range(meta.num_row_groups))
            size = max(1, min(size, int(limit // max(per_row, 1.0))))
        return [CorpusSlice(k, a, min(a + size, n)) for k, a in enumerate(range(0, n, size))]

    def read_slice(self, s: "CorpusSlice") -> Iterator[Record]:
        """The records of slice ``s`` (from :meth:`slices`), the same as :meth:`records` gives at
        those positions, with the same errors naming the same lines; a file that no longer
        matches the slice is an error."""
        fmt = self.resolved_format()
        if fmt == "parquet":
            recs: Iterator[Record] = self._read_parquet(s.start, s.stop)
        else:
            with open(self.path, "rb") as f:
                f.seek(s.offset)
                data = f.read(s.end - s.offset)
            stream = io.TextIOWrapper(io.BytesIO(data), encoding="utf-8")
            recs = self._read_lines(stream, fmt, first_line=s.first_line, first_record=s.start)
        n = 0
        for n, rec in enumerate(recs, 1):
            yield rec
        if n != s.stop - s.start:
            raise InvalidError(f"{self.path}: records {s.start}-{s.stop - 1} are no longer where they "
                               "were (the file changed while it was read); rerun the command")

    # -- JSON lines / text
    def _read_lines(self, stream, fmt: str, first_line: int = 1, first_record: int = 0) -> Iterator[Record]:
        where = "stdin" if self.is_stdin else self.path
        n_rec = first_record
        for lineno, line in enumerate(stream, first_line):
            if fmt == "text":
                yield Record(str(n_rec), line.rstrip("\n"))
                n_rec += 1
                continue
            if not line.strip():
                continue
            if not line.lstrip().startswith("{") and self.is_stdin and self.format == "auto":
                yield Record(str(n_rec), line.rstrip("\n"))  # plain lines on stdin
                n_rec += 1
                continue
            obj = _json_object(line, f"{where}, line {lineno}",
                               hint="; use --format text for one document per line")
            yield self._from_mapping(obj, fmt, f"{where}, line {lineno}")
            n_rec += 1

    def _fields(self, keys, fmt: str) -> tuple[str, str, str | None]:
        id_field = self.id_field or ("_id" if "_id" in keys or fmt == "beir" else "id")
        text_field = self.text_field or "text"
        title_field = self.title_field
        if title_field is None and (fmt == "beir" or (fmt in ("jsonl", "parquet") and self.id_field is None
                                                      and "_id" in keys and "title" in keys)):
            title_field = "title"  # BEIR layout: documents are title + " " + text
        return id_field, text_field, title_field

    def _from_mapping(self, obj: dict, fmt: str, where: str) -> Record:
        id_field, text_field, title_field = self._fields(obj.keys(), fmt)
        if id_field not in obj or obj[id_field] is None:
            raise InvalidError(f"{where}: no id field {id_field!r}; choose one with --id-field", param="--id-field")
        if text_field not in obj:
            raise InvalidError(f"{where}: no text field {text_field!r}; choose one with --text-field",
                               param="--text-field")
        text = obj[text_field]
        text = "" if text is None else text
        if not isinstance(text, str):
            raise InvalidError(f"{where}: field {text_field!r} is {type(text).__name__}, expected a string",
                               param="--text-field")
        if title_field:
            title = obj.get(title_field) or ""
            if not isinstance(title, str):
                raise InvalidError(f"{where}: field {title_field!r} is not a string", param="--title-field")
            text = document_text(title, text)
        meta = obj.get("metadata")
        return self._record(str(obj[id_field]), text, meta if isinstance(meta, dict) and meta else None, where)

    def _record(self, doc_id: str, text: str, metadata: dict | None, where: str) -> Record:
        """The record, if every backend can store its id and metadata (else an error naming
        ``where``, the id and the value at fault)."""
        shown = f" (id {doc_id!r})" if doc_id and len(doc_id) <= 80 else ""
        check_document(doc_id, metadata, context=f"{where}{shown}: ", max_metadata_depth=self.max_metadata_depth,
                       max_metadata_bytes=self.max_metadata_bytes)
        return Record(doc_id, text, metadata)

    # -- Parquet (streamed by record batches)
    def _read_parquet(self, start: int = 0, stop: int | None = None) -> Iterator[Record]:
        """Rows ``[start, stop)`` (default: all), reading only the row groups that hold them."""
        pq = _parquet()

        pf = pq.ParquetFile(self.path)
        names = pf.schema_arrow.names
        id_field, text_field, title_field = self._fields(names, "parquet")
        for f, flag in ((id_field, "--id-field"), (text_field, "--text-field")):
            if f not in names:
                raise InvalidError(f"{self.path}: no column {f!r} (columns: {', '.join(names)}); "
                                   f"choose one with {flag}", param=flag)
        cols = [id_field, text_field] + ([title_field] if title_field and title_field in names else [])
        stop = pf.metadata.num_rows if stop is None else stop
        groups, row, first = [], 0, None  # the row groups that overlap [start, stop)
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if n and row + n > start and row < stop:
                groups.append(g)
                first = row if first is None else first
            row += n
        if not groups:
            return
        row = first
        for batch in pf.iter_batches(batch_size=1024, columns=cols, row_groups=groups):
            d = batch.to_pydict()
            titles = d.get(title_field) if title_field else None
            for j, (i, t) in enumerate(zip(d[id_field], d[text_field])):
                if row >= stop:
                    return
                if row >= start:
                    yield self._from_row(i, t, titles[j] if titles is not None else None, row, text_field)
                row += 1

    def _from_row(self, id_: Any, text: Any, title: Any, row: int, text_field: str) -> Record:
        if id_ is None:
            raise InvalidError(f"{self.path}, row {row}: null id")
        text = text or ""
        if not isinstance(text, str):
            raise InvalidError(f"{self.path}, row {row}: column {text_field!r} is {type(text).__name__}, "
                               "expected a string")
        if title is not None:
            text = document_text(title, text)
        return self._record(str(id_), text, None, f"{self.path}, row {row}")


@dataclass(frozen=True)
class CorpusSlice:
    """Records ``[start, stop)`` of a corpus (from :meth:`CorpusSource.slices`): for JSON lines
    and text, the bytes ``[offset, end)`` of the file, starting at line ``first_line``."""

    index: int
    start: int
    stop: int
    offset: int = 0
    end: int = 0
    first_line: int = 1


def _parquet():
    """``pyarrow.parquet``, or the error naming the extra that installs it."""
    return import_extra("pyarrow.parquet", "parquet", "Reading a Parquet corpus")


def _blank(line: bytes) -> bool:
    """Whether :meth:`CorpusSource._read_lines` skips this line as blank (``str.strip()``
    also strips Unicode spaces, so decode what ASCII stripping leaves unless it is JSON)."""
    s = line.strip()
    return not s or (not s.startswith(b"{") and not s.decode("utf-8", "replace").strip())


def _json_object(line: str, where: str, hint: str = "") -> dict:
    s = line.lstrip()
    if not s.startswith("{"):
        raise InvalidError(f"{where}: not a JSON object{hint}")
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise InvalidError(f"{where}: invalid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise InvalidError(f"{where}: expected a JSON object")
    return obj


def read_texts(stream, where: str) -> list[str]:
    """Texts of ``embedpool embed --input``: one per line (a blank line is an empty text), or a
    JSON object with a string ``text`` field. As in every corpus reader here, a line that starts
    with ``{`` is JSON: if it does not parse, that is an error naming the line, not a text."""
    texts = []
    for lineno, line in enumerate(stream, 1):
        line = line.rstrip("\n")
        if not line.lstrip().startswith("{"):
            texts.append(line)
            continue
        obj = _json_object(line, f"{where}, line {lineno}")
        if not isinstance(obj.get("text"), str):
            raise InvalidError(f"{where}, line {lineno}: a JSON line needs a string 'text' field")
        texts.append(obj["text"])
    return texts


def read_jsonl(path: str | Path) -> Iterator[tuple[str, dict]]:
    """``(where, object)`` for every non-blank line of a JSON-lines file (``where`` names the
    file and line for messages)."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                where = f"{path}, line {lineno}"
                yield where, _json_object(line, where)


# ---------------------------------------------------------------------------------- BEIR
@dataclass
class BeirData:
    corpus: list[Record]
    queries: dict[str, str]  # only queries with at least one relevant document
    qrels: dict[str, dict[str, int]]
    name: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    def pairs(self) -> list[tuple[str, str]]:
        """``(query text, relevant document text)`` for every judgment whose document is in the
        corpus, in qrels order (training pairs)."""
        docs = {r.id: r.text for r in self.corpus}
        return [(self.queries[q], docs[d]) for q, rel in self.qrels.items() for d in rel if d in docs]


def load_qrels(path: str | Path) -> dict[str, dict[str, int]]:
    """``{query id: {document id: relevance}}`` of the judgments with relevance > 0."""
    qrels: dict[str, dict[str, int]] = {}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            parts = line.rstrip("\n").split("\t") if "\t" in line else line.split()
            if not parts or not "".join(parts).strip():
                continue
            if n == 0 and not parts[-1].strip().lstrip("-").isdigit():
                continue  # header
            if len(parts) not in (3, 4) or not parts[-1].strip().lstrip("-").isdigit():
                raise InvalidError(f"{path}, line {n + 1}: expected 'query-id<TAB>corpus-id<TAB>score' "
                                   f"(or TREC's four columns) with an integer score, got {line.strip()!r}")
            qid, did, score = parts[0].strip(), parts[-2].strip(), int(parts[-1])
            if score > 0:
                qrels.setdefault(qid, {})[did] = score
    return qrels


def load_queries(path: str | Path, keep: Iterable[str] | None = None) -> dict[str, str]:
    """``{id: text}`` of ``queries.jsonl`` (only the ids in ``keep``, if given), in file order."""
    wanted = None if keep is None else set(keep)
    out = {}
    for where, obj in read_jsonl(path):
        if obj.get("_id") is None:
            raise InvalidError(f"{where}: no '_id' field")
        qid = str(obj["_id"])
        if wanted is None or qid in wanted:
            text = obj.get("text")
            if text is not None and not isinstance(text, str):
                raise InvalidError(f"{where}: field 'text' is {type(text).__name__}, expected a string")
            out[qid] = text or ""
    return out


def load_corpus(path: str | Path) -> list[Record]:
    """Every document of a BEIR ``corpus.jsonl``, in file order (``title + " " + text``)."""
    return list(CorpusSource(str(path), "beir").records())


def load_beir(folder: str | Path, split: str = "test") -> BeirData:
    """``corpus.jsonl`` (documents as ``title + " " + text``), ``queries.jsonl`` and
    ``qrels/<split>.tsv``; keeps the queries that have a relevant (score > 0) document."""
    folder = Path(folder)
    for need in ("corpus.jsonl", "queries.jsonl", f"qrels/{split}.tsv"):
        if not (folder / need).is_file():
            raise NotFoundError(f"{folder / need} not found: --data expects a BEIR folder with "
                                    f"corpus.jsonl, queries.jsonl and qrels/{split}.tsv", param="--data")
    qrels = load_qrels(folder / "qrels" / f"{split}.tsv")
    queries = load_queries(folder / "queries.jsonl", keep=qrels)
    qrels = {q: r for q, r in qrels.items() if q in queries}
    return BeirData(load_corpus(folder / "corpus.jsonl"), queries, qrels, name=folder.name,
                    info={"dataset": folder.name, "path": str(folder.resolve()), "split": split})


def slice_beir(data: BeirData, max_docs: int | None = None, max_queries: int | None = None,
               seed: int = 0) -> BeirData:
    """A small, self-consistent slice: queries (in a seeded random order) whose relevant
    documents all fit in half of ``max_docs``, plus random other documents up to ``max_docs``."""
    if not max_docs and not max_queries:
        return data
    rng = random.Random(seed)
    qids = list(data.qrels)
    rng.shuffle(qids)
    by_id = {r.id: r for r in data.corpus}
    budget = max_docs // 2 if max_docs else len(data.corpus)
    chosen, rel_docs = [], set()
    for q in qids:
        if max_queries and len(chosen) >= max_queries:
            break
        rel = {d for d in data.qrels[q] if d in by_id}
        if not rel or len(rel_docs | rel) > budget:
            continue
        chosen.append(q)
        rel_docs |= rel
    keep = set(rel_docs)
    if max_docs:
        others = [r.id for r in data.corpus if r.id not in keep]
        keep |= set(rng.sample(others, min(len(others), max_docs - len(keep))))
    else:
        keep = set(by_id)
    corpus = [r for r in data.corpus if r.id in keep]
    chosen_set = set(chosen)
    qrels = {q: {d: s for d, s in data.qrels[q].items() if d in keep} for q in data.qrels if q in chosen_set}
    info = {**data.info, "slice": {"max_docs": max_docs, "max_queries": max_queries, "seed": seed}}
    return BeirData(corpus, {q: data.queries[q] for q in qrels}, qrels, data.name, info)


def dev_split(dev: BeirData, data: BeirData) -> BeirData:
    """``dev``'s queries and judgments over ``data``'s corpus (a slice of it): the judgments of
    documents not in it dropped, then the queries left with none; queries ``data`` reports on are
    left out too (a labelled dev split for choosing a setting, never the reported queries)."""
    ids = {r.id for r in data.corpus}
    qrels = {q: {d: s for d, s in rel.items() if d in ids} for q, rel in dev.qrels.items() if q not in data.qrels}
    qrels = {q: rel for q, rel in qrels.items() if rel}
    return BeirData(data.corpus, {q: dev.queries[q] for q in qrels}, qrels, dev.name, dev.info)


# ---------------------------------------------------------------------------------- STS
def load_sts(folder: str | Path, split: str = "test") -> list[tuple[str, str, float]]:
    """``(sentence1, sentence2, score)`` of ``<folder>/<split>.tsv``, in file order."""
    path = Path(folder) / f"{split}.tsv"
    if not path.is_file():
        raise NotFoundError(f"{path} not found: --sts expects a folder with {split}.tsv "
                                "(sentence1, sentence2, score)", param="--sts")
    pairs = []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, [])
        cols = {h.strip(): i for i, h in enumerate(header)}
        try:
            a, b, s = cols["sentence1"], cols["sentence2"], cols["score"]
        except KeyError:
            raise InvalidError(f"{path}: the header must name sentence1, sentence2 and score") from None
        for row in reader:
            if not row:
                continue
            try:
                pairs.append((row[a], row[b], float(row[s])))
            except (IndexError, ValueError):
                raise InvalidError(f"{path}, line {reader.line_num}: expected sentence1, sentence2 and a "
                                   f"numeric score, got {row!r}") from None
    return pairs


def sts_sentences(folder: str | Path, splits: Iterable[str] = ("test",), unique: bool = False) -> list[str]:
    """The sentences of the STS ``splits`` (both sides of each pair, in file order; ``unique``:
    each once, empty ones left out) -- benchmark inputs."""
    out = [x for split in splits if (Path(folder) / f"{split}.tsv").is_file()
           for a, b, _ in load_sts(folder, split) for x in (a, b)]
    return list(dict.fromkeys(x for x in out if x)) if unique else out
