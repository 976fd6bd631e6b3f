"""One settings object for every entry point: CLI flags override ``EMBEDPOOL_*`` environment
variables, which override the defaults below."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from embedpool.errors import InvalidError
from embedpool.index import BACKENDS, MAX_METADATA_BYTES, MAX_METADATA_DEPTH, READ_CONSISTENCY
from embedpool.precisions import ENCODER_PRECISIONS

#: ``milvus_consistency``'s default: Session for one API server, Strong for replicas
AUTO_CONSISTENCY = "auto"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EMBEDPOOL_", extra="ignore")

    # the model and its encoder
    model: str | None = Field(None, description="Hugging Face id or local folder; default: packaged all-MiniLM-L6-v2. "
                              "The server takes several, NAME=PATH_OR_ID separated by commas, the first the default")
    precision: Literal[ENCODER_PRECISIONS] = Field(  # type: ignore[valid-type]
        "auto", description="encoder path; auto = the fastest within the quality bar on this CPU "
        "(see poolers/precision.py)")
    calibration_file: str | None = Field(None, description="texts (one per line) to calibrate static int8 "
                                         "(openvino-int8); default: a few built-in sentences")
    pooler: str = Field("auto", description="default pooler spec; auto = the model's own pooling")
    max_batch_tokens: int = Field(2048, ge=64, description="token budget of one forward batch and of one batcher "
                                  "round (small batches stay in cache: faster on small CPUs than 16384)")
    # storage
    data_dir: str = Field("./data", description="folder of the FAISS collections")
    backend: Literal[BACKENDS] = Field(  # type: ignore[valid-type]
        "faiss", description="vector store: faiss (folders under data_dir) or milvus")
    milvus_uri: str = Field("./milvus.db", description="Milvus Lite file (.db) or a Milvus server's http://host:19530")
    milvus_token: str | None = Field(None, description="Milvus token (user:password), if the server needs one")
    milvus_consistency: Literal[(AUTO_CONSISTENCY, *READ_CONSISTENCY)] = Field(  # type: ignore[valid-type]
        AUTO_CONSISTENCY, description="consistency of the server's and `search`'s reads on a Milvus server: Strong "
        "sees every committed write from any process but waits for the server's time tick (~200 ms a read on a "
        "standalone 2.3 server); Session sees this process's own writes at once and other processes' within "
        "the tick (~4 ms a search). auto: Session, but Strong when `replicas` is more than 1 (replicas read each "
        "other's writes at once). Writes and the indexing job are always Strong")
    replicas: int = Field(1, ge=1, description="API servers sharing one Milvus server; more than 1 makes their reads "
                          "Strong (with milvus_consistency auto), so a write through one is read through every other "
                          "at once")
    # what a document may store (checked where documents enter: an upsert, the indexing job's corpus)
    max_metadata_depth: int = Field(
        MAX_METADATA_DEPTH, ge=1, le=MAX_METADATA_DEPTH, description="most levels of objects and arrays in a "
        "document's metadata (the metadata object is level 1); deeper is a 422 naming the value. At most "
        f"{MAX_METADATA_DEPTH}: every answer renders that deep")
    max_metadata_bytes: int = Field(
        MAX_METADATA_BYTES, ge=2, description="largest metadata of one document, as compact UTF-8 JSON; larger is "
        f"a 422. The default is what every backend stores (a Milvus JSON field holds {MAX_METADATA_BYTES:,} "
        "bytes: Milvus refuses more whatever this says); FAISS folders store more")
    # service
    host: str = Field("127.0.0.1", description="address the HTTP service listens on")
    port: int = Field(8000, description="port of the HTTP service")
    api_key: str | None = Field(None, description="if set, every route but /health, /metrics, /docs and the playground needs Authorization: Bearer KEY")
    max_client_batch: int = Field(512, ge=1, description="most inputs in one request")
    max_input_chars: int = Field(100_000, ge=1, description="longest single input, in characters")
    max_payload_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="largest request body")
    max_request_tokens: int = Field(262_144, ge=1, description="most tokens one request may run through the "
                                    "encoder, counted after windowing: every window of every tokenization plan "
                                    "its poolers need (413 above it)")
    max_request_vectors: int = Field(131_072, ge=1, description="most vectors one request may return, all inputs "
                                     "and poolers together (a multi-vector pooler returns one per token or "
                                     "cluster; 413 above it)")
    max_queue: int = Field(1024, ge=1, description="inputs waiting to be encoded before 429")
    max_wait_ms: float = Field(2.0, ge=0, description="longest wait of the batcher to fill a round, only after the "
                               "model was idle (a round that ends with requests queued is followed at once) and "
                               "while the previous round's clients are still to come; a lone client never waits")
    single_thread_tokens: int = Field(32, ge=0, description="batcher rounds under this many tokens (a sentence or "
                                      "two) run the encoder on one thread, which is as fast on a quiet machine and "
                                      "faster on a busy one; 0 = always all threads")
    rerank_cache_mb: int = Field(256, ge=0, description="memory for the document vectors /rerank keeps (least "
                                 "recently used first out); reranked candidates often recur; 0 = off")
    shutdown_timeout: float = Field(30.0, ge=0, description="seconds a stopping server (SIGTERM) lets the requests "
                                    "in flight finish; one still running then gets a 503 that says to send it again. "
                                    "Give the container manager longer (docker stop -t, compose stop_grace_period)")
    allow_pooler_paths: bool = Field(False, description="let requests name pooler weight files (attention:weights=PATH)")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field("info", description="server log level")

    def stored_limits(self) -> dict[str, int]:
        """The limits on what a document stores: the keywords of :func:`index.check_document`."""
        return {"max_metadata_depth": self.max_metadata_depth, "max_metadata_bytes": self.max_metadata_bytes}

    def store(self, *, reads: bool = False) -> dict[str, Any]:
        """Where collections live: the ``backend``/``milvus_uri``/``milvus_token`` keyword
        arguments of :func:`index.open_collection` (and of the indexing job); with ``reads``,
        ``milvus_consistency`` too (the server and ``search``: the job reads Strong)."""
        out = {"backend": self.backend, "milvus_uri": self.milvus_uri, "milvus_token": self.milvus_token}
        return {**out, "milvus_consistency": self.read_consistency()} if reads else out

    def read_consistency(self) -> str:
        """The Milvus read consistency of the server and ``search``: ``milvus_consistency``, where
        ``auto`` is Session for one API server and Strong for several (``replicas``)."""
        if self.milvus_consistency != AUTO_CONSISTENCY:
            return self.milvus_consistency
        return "Strong" if self.replicas > 1 else "Session"


# Flags that map 1:1 onto settings fields: flag name -> (field, argparse kwargs)
def add_model_args(parser: argparse.ArgumentParser, *, several_models: bool = False) -> None:
    if several_models:
        parser.add_argument("--model", action="append", metavar="[NAME=]PATH_OR_ID",
                            help="Hugging Face id or local folder; repeat as NAME=PATH_OR_ID to serve several "
                                 "models, the first the default (env EMBEDPOOL_MODEL, entries separated by commas)")
    else:
        parser.add_argument("--model", help="Hugging Face id or local folder (env EMBEDPOOL_MODEL)")
    parser.add_argument("--precision", choices=list(ENCODER_PRECISIONS),
                        help="encoder path: auto (default: the fastest within the quality bar on this CPU), fp32, "
                        "bf16 (autocast), bf16-weights, openvino-fp32/-bf16/-int8/-int8-weights; "
                        "int8 = openvino-int8 (env EMBEDPOOL_PRECISION)")
    parser.add_argument("--calibration-file", help="texts, one per line, for static int8 calibration")
    parser.add_argument("--max-batch-tokens", type=int, help="token budget of one forward batch")


def add_storage_args(parser: argparse.ArgumentParser, *, reads: bool = True) -> None:
    """The storage flags; ``reads``: the command reads collections to answer (search, serve),
    so it takes ``--milvus-consistency`` (the indexing job reads and writes Strong)."""
    parser.add_argument("--data-dir", help="folder of collections (env EMBEDPOOL_DATA_DIR)")
    parser.add_argument("--backend", choices=list(BACKENDS), help="vector store (env EMBEDPOOL_BACKEND)")
    parser.add_argument("--milvus-uri", help="Milvus Lite file or http://host:19530 (env EMBEDPOOL_MILVUS_URI)")
    parser.add_argument("--milvus-token", help="Milvus token (env EMBEDPOOL_MILVUS_TOKEN)")
    if reads:
        parser.add_argument("--milvus-consistency", choices=[AUTO_CONSISTENCY, *READ_CONSISTENCY],
                            help="consistency of reads on a Milvus server; default auto: Session, Strong with "
                            "--replicas above 1 (env EMBEDPOOL_MILVUS_CONSISTENCY)")


def add_stored_value_args(parser: argparse.ArgumentParser) -> None:
    """The limits on what a document stores (the commands that write documents: serve, index)."""
    parser.add_argument("--max-metadata-depth", type=int, metavar="N",
                        help=f"most levels of objects and arrays in a document's metadata (default and most "
                             f"{MAX_METADATA_DEPTH}; env EMBEDPOOL_MAX_METADATA_DEPTH)")
    parser.add_argument("--max-metadata-bytes", type=int, metavar="N",
                        help=f"largest metadata of one document as compact JSON (default {MAX_METADATA_BYTES:,}: "
                             "what every backend stores; env EMBEDPOOL_MAX_METADATA_BYTES)")


def from_args(args: argparse.Namespace, **overrides: Any) -> Settings:
    """Settings from the environment, with every CLI flag that was given on top (a repeated
    ``--model`` as ``EMBEDPOOL_MODEL`` spells several: entries separated by commas)."""
    fields = Settings.model_fields
    given = {k: ",".join(v) if isinstance(v, list) else v for k, v in vars(args).items()
             if k in fields and v is not None}
    return Settings(**{**given, **overrides})


def model_entries(values: Sequence[str] | str | None) -> list[tuple[str, str | None]]:
    """``(name, path or id)`` per ``--model`` value, in order: ``NAME=PATH_OR_ID`` names it, a
    bare folder or id is named by its last part (``None``: the packaged default model). A string
    (``EMBEDPOOL_MODEL``) holds its entries separated by commas."""
    if values is None or isinstance(values, str):
        values = [v.strip() for v in values.split(",") if v.strip()] if values else [None]
    out: list[tuple[str, str | None]] = []
    for value in values:
        if value and "=" in value and not Path(value).expanduser().exists():
            name, _, path = value.partition("=")
            name, path = name.strip(), path.strip()
            if not name or not path:
                raise InvalidError(f"--model {value!r}: use NAME=PATH_OR_ID or PATH_OR_ID", param="--model")
        else:
            path = value or None
            name = Path(value).name if value else "all-MiniLM-L6-v2"
        if name in (n for n, _ in out):
            raise InvalidError(f"--model: two models are named {name!r}; name them (NAME=PATH_OR_ID)", param="--model")
        out.append((name, path))
    return out


def _calibration(settings: Settings) -> list[str] | None:
    if not settings.calibration_file:
        return None
    return [t for t in Path(settings.calibration_file).read_text().splitlines() if t.strip()]


def load_embedder(settings: Settings):
    """The :class:`poolers.Embedder` for these settings (imported lazily: torch is slow to import).
    A cross-encoder (a reranker) gives no embeddings: refused, naming what to do with it."""
    from embedpool.poolers import Embedder, FrozenEncoder, is_cross_encoder
    from embedpool.poolers.encoder import resolve_model

    if is_cross_encoder(resolve_model(settings.model)[1]):
        raise InvalidError(f"model {settings.model!r} is a reranker (a cross-encoder: it scores query-document "
                           "pairs) and gives no embeddings; serve it (embedpool serve --model ...) and rank with "
                           "POST /rerank, or use an embedding model here", param="--model")
    encoder = FrozenEncoder(settings.model, precision=settings.precision,
                            max_batch_tokens=settings.max_batch_tokens, calibration=_calibration(settings))
    return Embedder(encoder, default_pooler=settings.pooler)


def load_model(settings: Settings):
    """What a server serves for these settings: a :class:`poolers.CrossEncoderModel` for a
    cross-encoder (a reranker), else the :class:`poolers.Embedder` of :func:`load_embedder`."""
    from embedpool.poolers import CrossEncoderModel, is_cross_encoder
    from embedpool.poolers.encoder import resolve_model

    if is_cross_encoder(resolve_model(settings.model)[1]):
        return CrossEncoderModel(settings.model, precision=settings.precision,
                                 max_batch_tokens=settings.max_batch_tokens, calibration=_calibration(settings))
    return load_embedder(settings)
