"""``embedpool index --runner ray``: the index job with its embedding on Ray Data.

The job is the same :class:`app.indexing.IndexJob` as in-process -- the same collections, job
state, commits, resume and final compaction (:meth:`IndexJob.drive`); only where the embedding
runs differs:

* **Reading** -- the corpus is a Ray Dataset of a custom datasource, one read task per block of
  at most ``batch_docs`` records and about the bytes of ``batch_tokens`` tokens
  (:data:`BYTES_PER_TOKEN` each; a larger record is a block of its own:
  :meth:`app.datasets.CorpusSource.slices`; the driver scans a JSON-lines file once for where
  its blocks start, a Parquet file only for its footer). Each read task reads
  its block with the one loader, :meth:`CorpusSource.read_slice` -- same ids, texts and errors
  naming the same line as the in-process job; Ray's own JSON reader was not used because it infers
  an Arrow schema (a non-string text becomes an Arrow error naming no line), knows no BEIR title
  rule and gives no record positions, which resuming needs. Read tasks run wherever Ray
  schedules them: on a cluster the corpus path must be readable on every node (a shared file
  system). On a resumed run only the blocks from the last commit on are read (and the committed
  record before them, to check the corpus did not change).
* **Embedding** -- ``map_batches`` over a fixed pool of ``--workers`` actors, each loading its
  own encoder once and running torch on ``--worker-threads`` threads (the actor asks Ray for as
  many CPUs). It cuts its block into embedding calls of ``batch_tokens`` tokens with
  :func:`app.indexing.token_calls` and embeds each with :func:`app.indexing.embed_records` --
  the code the in-process job runs, so the vectors are the same -- and hands each call's
  result back as it is done (one output block per call): a worker holds one call's vectors.
* **Writing** -- blocks come back to the driver in corpus order (``preserve_order``). With a
  collection that takes one writer at a time (FAISS, Milvus Lite) the workers ship the vectors
  back (float32 bytes, one row per document) and the driver writes and commits them. With one
  that takes concurrent writers (``capabilities.concurrent_writers``: a Milvus server) every
  worker upserts its own block's rows straight into Milvus and ships back only the ids; the
  driver still moves the job state and commits (a Milvus flush), only ever over a contiguous
  prefix of whole blocks. Upserts replace by id, so a block written again after a crash of the
  driver lands once: exactly-once in the final collection. (A worker's rows are visible in Milvus
  before the driver commits them, as with any Milvus write; a rerun rewrites every block after
  the last commit.)

A job that fails raises the embedpool error a worker raised (the message names the record);
blocks after the last commit are not committed, so FAISS discards them.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np

from embedpool.app.datasets import CorpusSlice, CorpusSource, Record
from embedpool.app.indexing import EmbeddedBlock, IndexJob, check_position, embed_records, token_calls
from embedpool.app.retrieval import stored_rows
from embedpool.errors import EmbedpoolError, InternalError, InvalidError, UnavailableError, import_extra

if TYPE_CHECKING:
    from embedpool.poolers import EmbedOptions


#: bytes of a corpus file taken for one token when read tasks are cut (English text has ~4-5
#: characters a token; the worker cuts its block by counted tokens again)
BYTES_PER_TOKEN = 4


# ---------------------------------------------------------------------------------- reading
def _read_block(source: CorpusSource, s: CorpusSlice, start: int, checks: dict) -> list:
    """One block as an Arrow table: the records at positions >= ``start`` (those before it only
    for the corpus-changed check)."""
    import pyarrow as pa

    pos, ids, texts, meta = [], [], [], []
    try:
        for p, rec in enumerate(source.read_slice(s), s.start):
            if p in checks:
                check_position(p, rec, *checks[p])
            if p >= start:
                pos.append(p)
                ids.append(rec.id)
                texts.append(_utf8(rec.text))
                meta.append(None if rec.metadata is None else json.dumps(rec.metadata))
    except EmbedpoolError as e:
        raise _keep_message(e)
    return [pa.table({"slice": pa.array([s.index] * len(pos), pa.int64()), "pos": pa.array(pos, pa.int64()),
                      "id": pa.array(ids, pa.string()), "text": pa.array(texts, pa.binary()),
                      "metadata": pa.array(meta, pa.string())})]


def _utf8(text: str) -> bytes:
    """Texts travel as bytes: Arrow strings must be valid UTF-8, and a text that is not (a lone
    surrogate from JSON's ``"\\ud800"``) must reach the worker, whose encoder refuses it by name."""
    return text.encode("utf-8", "surrogatepass")


def _text(data: bytes) -> str:
    return data.decode("utf-8", "surrogatepass")


def _datasource(source: CorpusSource, slices: list[CorpusSlice], start: int, checks: dict):
    from ray.data import Datasource, ReadTask
    from ray.data.block import BlockMetadata

    class CorpusBlocks(Datasource):
        """The corpus, one read task per block (see the module docstring)."""

        def estimate_inmemory_data_size(self) -> int | None:
            return None

        def get_read_tasks(self, parallelism: int, per_task_row_limit=None, data_context=None) -> list:
            return [ReadTask(lambda s=s: _read_block(source, s, start, checks),
                             BlockMetadata(num_rows=s.stop - max(s.start, start), size_bytes=None,
                                           input_files=None, exec_stats=None))
                    for s in slices]

        def get_name(self) -> str:
            return "CorpusBlocks"

    return CorpusBlocks()


# ---------------------------------------------------------------------------------- the workers
class EmbedWorker:
    """A Ray Data actor: one encoder, ``threads`` torch threads; embeds a block per call and, in
    worker-write mode, upserts its rows into the collections itself."""

    def __init__(self, settings: dict, specs: list[str], options: EmbedOptions,
                 threads: int, write: dict | None, model: tuple[str, int], batch_tokens: int,
                 batch_docs: int) -> None:
        import torch

        from embedpool.app.settings import Settings, load_embedder

        torch.set_num_threads(threads)
        self.embedder = load_embedder(Settings(**settings))
        if (self.embedder.model_id, self.embedder.dim) != tuple(model):
            raise _keep_message(InvalidError(
                f"a Ray worker on {os.uname().nodename} loaded model {self.embedder.model_id!r} (dim "
                f"{self.embedder.dim}), the driver {model[0]!r} (dim {model[1]}); install the same model "
                "on every node"))
        self.specs, self.options = specs, options
        self.batch_tokens, self.batch_docs = batch_tokens, batch_docs
        self.write = write
        self.colls: dict[str, Any] = {}
        if write:
            from embedpool.index import open_collection

            for spec, t in write["targets"].items():
                self.colls[spec] = open_collection(write["data_dir"], t["name"], **write["where"])

    def __call__(self, batch):
        """One output block per embedding call of the input block(s) (a generator: a call's
        vectors leave the worker before the next call is embedded)."""
        try:
            cols = batch.to_pydict()
            for k in sorted(set(cols["slice"])):  # one block per call, unless Ray bundled several
                recs = [(cols["pos"][j], Record(cols["id"][j], _text(cols["text"][j]),
                                                json.loads(cols["metadata"][j]) if cols["metadata"][j] else None))
                        for j, x in enumerate(cols["slice"]) if x == k]
                for n, call in enumerate(token_calls(self.embedder, recs, self.specs, self.options,
                                                     batch_tokens=self.batch_tokens, batch_docs=self.batch_docs)):
                    block = embed_records(self.embedder, call, call[-1].pos + 1, call[-1].record.id, self.specs,
                                          self.options)
                    if self.write:
                        self._write(block)
                    yield _to_table((k, n), block, self.specs, shipped=not self.write)
        except EmbedpoolError as e:
            raise _keep_message(e)

    def _write(self, block: EmbeddedBlock) -> None:
        for spec, coll in self.colls.items():
            t = self.write["targets"][spec]
            sel = [i for i, p in enumerate(block.positions) if p >= t["added"]]
            if not sel:
                continue
            vec = [block.vectors[spec][i] for i in sel]
            comp = None if t["companion_pooler"] is None else [block.vectors[t["companion_pooler"]][i] for i in sel]
            coll.add([block.ids[i] for i in sel], stored_rows(coll.spec, vec),
                     texts=[block.texts[i] for i in sel] if self.write["store_text"] else None,
                     metadata=[block.metadata[i] for i in sel], model=self.write["model"], pooler=spec,
                     companion=comp)


def _to_table(call: tuple[int, int], block: EmbeddedBlock, specs: list[str], shipped: bool):
    """A block (embedding call ``call[1]`` of read block ``call[0]``) as an Arrow table, one row
    per kept record; the block's totals ride on every row."""
    import pyarrow as pa

    n = len(block.positions)
    cols: dict[str, Any] = {
        "slice": pa.array([call[0]] * n, pa.int64()), "call": pa.array([call[1]] * n, pa.int64()),
        "pos": pa.array(block.positions, pa.int64()),
        "id": pa.array(block.ids, pa.string()),
        "read": pa.array([block.read] * n, pa.int64()),
        "tokens": pa.array([block.tokens] * n, pa.int64()),
    }
    for i, spec in enumerate(specs):
        cols[f"seconds:{i}"] = pa.array([block.seconds.get(spec, 0.0)] * n, pa.float64())
    if shipped:
        cols["text"] = pa.array(block.texts, pa.string())
        cols["metadata"] = pa.array([None if m is None else json.dumps(m) for m in block.metadata], pa.string())
        for i, spec in enumerate(specs):
            cols[f"vectors:{i}"] = pa.array([np.ascontiguousarray(v, np.float32).tobytes()
                                             for v in block.vectors[spec]], pa.binary())
    return pa.table(cols)


def _blocks_of(batch, specs: list[str], shapes: dict[str, tuple[int, bool]]) -> Iterator[EmbeddedBlock]:
    """The blocks of one table the workers returned, back as :class:`EmbeddedBlock`
    (``shapes``: per spec, its dimension and whether it is multi-vector)."""
    c = batch.to_pydict()
    key = list(zip(c["slice"], c["call"]))
    j = 0
    while j < len(key):
        e = j
        while e < len(key) and key[e] == key[j]:
            e += 1
        r = range(j, e)
        vectors = None
        if "text" in c:  # the driver writes: the vectors came along
            vectors = {}
            for i, s in enumerate(specs):
                dim, multi = shapes[s]
                vs = [np.frombuffer(c[f"vectors:{i}"][x], np.float32).reshape(-1, dim) for x in r]
                vectors[s] = vs if multi else [v[0] for v in vs]
        yield EmbeddedBlock([c["pos"][x] for x in r], [c["id"][x] for x in r],
                            [c["text"][x] for x in r] if "text" in c else [],
                            [json.loads(c["metadata"][x]) if c["metadata"][x] else None for x in r]
                            if "metadata" in c else [None] * len(r),
                            vectors, {s: c[f"seconds:{i}"][j] for i, s in enumerate(specs)}, c["tokens"][j],
                            c["pos"][e - 1] + 1, c["id"][e - 1], c["read"][j])
        j = e


# ---------------------------------------------------------------------------------- errors
def _keep_message(e: EmbedpoolError) -> EmbedpoolError:
    """Ray appends its retry advice to a failed task's exception: keep the message we raised."""
    e.embedpool_message = str(e)
    return e


def _unwrap(e: BaseException) -> BaseException:
    """What a Ray task raised, out of Ray's wrappers (an embedpool error with its own message);
    a :class:`UnavailableError` when Ray itself failed (a worker died, the cluster went away)."""
    from ray.exceptions import RayError

    seen, c, found = set(), e, None
    while c is not None and id(c) not in seen:
        seen.add(id(c))
        if not isinstance(c, RayError):
            found = c
            break
        cause = getattr(c, "cause", None)
        c = cause if isinstance(cause, BaseException) else c.__cause__
    if found is None:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return UnavailableError(f"the Ray job failed ({type(e).__name__}: {first}); Ray's logs are in "
                                "/tmp/ray/session_latest/logs on each node; rerun the same command to continue "
                                "after the last commit")
    msg = getattr(found, "embedpool_message", None)
    if msg is not None:
        found.args = (msg,)
    return found


# ---------------------------------------------------------------------------------- the driver
def connect(address: str | None, log_to_driver: bool = False) -> bool:
    """Join the cluster at ``address``, or start a local Ray on this machine's cores. Returns
    whether this call started (and so should stop) Ray."""
    import ray

    if ray.is_initialized():
        return False
    kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=log_to_driver,
                                  logging_level=logging.WARNING, configure_logging=True)
    if address:
        ray.init(address=address, **kwargs)
    else:
        ray.init(num_cpus=os.cpu_count() or 1, object_store_memory=512 << 20, **kwargs)
    return True


def default_threads(workers: int) -> int:
    """Threads per worker: the cluster's CPUs shared out, at most one node's."""
    import ray

    nodes = [n.get("Resources", {}).get("CPU", 1) for n in ray.nodes() if n.get("Alive")]
    total = sum(nodes) or 1
    return max(1, int(min(total // max(workers, 1), max(nodes, default=1))))


def run_on_ray(job: IndexJob, source: CorpusSource, model_settings: dict, *, address: str | None = None,
               workers: int = 1, threads: int | None = None) -> dict[str, Any]:
    """Run ``job`` (opened) with its embedding on Ray (see the module docstring); the summary."""
    import_extra("ray", "ray", "--runner ray")
    if source.is_stdin:
        raise InvalidError("--runner ray reads the corpus on the workers: give it as a file, not stdin",
                           param="--runner")
    if workers < 1:
        raise InvalidError("--workers must be >= 1", param="--workers")
    # the workers run the encoder path the driver resolved (``auto`` picks per CPU): a collection's
    # vectors are all made by the one path its manifest records
    model_settings = {**model_settings, "precision": job.embedder.encoder.precision}
    return _run(job, source, model_settings, address, workers, threads)


def _run(job: IndexJob, source: CorpusSource, model_settings: dict, address: str | None, workers: int,
         threads: int | None) -> dict[str, Any]:
    import ray

    started = connect(address)
    try:
        threads = threads or default_threads(workers)
        work = job.remaining_work()
        slices = source.slices(work["batch_docs"], work["batch_tokens"] * BYTES_PER_TOKEN)
        job.records_read = slices[-1].stop if slices else 0
        first = min([work["start"], *work["checks"]])
        todo = [s for s in slices if s.stop > first]
        writes = _worker_writes(job)
        job.runner = {"runner": "ray", "address": address or "local", "workers": workers, "threads": threads,
                      "writes": "workers" if writes else "driver", "blocks": len(todo)}
        return job.drive(_stream(job, source, todo, work, model_settings, workers, threads, writes),
                         total=job.records_read)
    finally:
        if started:
            ray.shutdown()


def _worker_writes(job: IndexJob) -> dict | None:
    """The workers' part of writing, when every collection takes concurrent writers."""
    targets = list(job.targets.values())
    if not all(t.coll.capabilities.concurrent_writers for t in targets):
        return None
    return {"data_dir": str(job.data_dir), "where": job.where, "store_text": job.store_text,
            "model": job.embedder.model_id,
            "targets": {t.spec: {"name": t.name, "added": t.added, "multi": t.multi,
                                 "companion_pooler": t.companion_pooler} for t in targets}}


def _stream(job: IndexJob, source: CorpusSource, todo: list[CorpusSlice], work: dict, model_settings: dict,
            workers: int, threads: int, writes: dict | None) -> Iterator[EmbeddedBlock]:
    import ray

    if not todo:
        return
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False
    ctx.raise_original_map_exception = True  # a worker's own error, not "UDF failed to process a data block"
    specs = work["specs"]
    shapes = {s: (job.embedder.output_dim(s, job.options.dimensions), bool(job.embedder.pooler(s).multi_vector))
              for s in specs}
    env = {k: str(threads) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")}
    # one block per read task: Ray would otherwise split blocks to reach its default parallelism
    ds = ray.data.read_datasource(_datasource(source, todo, work["start"], work["checks"]), num_cpus=0,
                                  override_num_blocks=len(todo))
    ds = ds.map_batches(
        EmbedWorker, batch_size=None, batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=workers),
        fn_constructor_kwargs=dict(settings=model_settings, specs=specs, options=work["options"],
                                   threads=threads, write=writes,
                                   model=(job.embedder.model_id, job.embedder.dim),
                                   batch_tokens=work["batch_tokens"], batch_docs=work["batch_docs"]),
        num_cpus=threads, runtime_env={"env_vars": env})
    done = work["start"]  # every record before this position came back
    # Ray Data logs every failed task as a bug of its own ("open an issue") before it raises; the
    # error raised here says what failed (Ray's own logs keep the whole story)
    quiet = logging.getLogger("ray.data")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1):
            for block in _blocks_of(batch, specs, shapes):  # calls come whole and in order
                if block.end - block.read != done:
                    raise InternalError(f"Ray returned records {block.end - block.read}-{block.end - 1} after "
                                        f"record {done - 1}")
                done = block.end
                yield block
        if done != todo[-1].stop:
            raise InternalError(f"Ray returned records up to {done - 1} of {todo[-1].stop}")
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 -- every failure of the Ray job is mapped here
        raise _unwrap(e) from None
    finally:
        quiet.setLevel(level)
