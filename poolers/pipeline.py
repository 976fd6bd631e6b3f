"""The pipeline: one forward pass per tokenization plan, every requested pooler applied to it,
then post-processing (Matryoshka ``dimensions``, normalization)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from embedpool.errors import InvalidError
from embedpool.poolers.base import Pooler, build_pooler
from embedpool.poolers.encoder import STANDARD, FrozenEncoder, Plan

ROLES = ("query", "document")


@dataclass
class EmbedResult:
    """Embeddings per pooler spec, in input order: what :meth:`Embedder.embed` returns, and
    what the server's batcher hands each request.

    ``vectors[spec][i]`` is a ``[D]`` float32 array for single-vector poolers and ``[n_i, D]``
    for multi-vector ones. ``tokens`` counts the tokens through the encoder, all plans (every
    window); ``usage`` the inputs' tokens under the model's own (standard) layout, once per
    input whatever the poolers (``Workload.counts`` summed): what a server reports as usage.
    """

    vectors: dict[str, list[np.ndarray]]
    multi_vector: dict[str, bool]
    tokens: int = 0
    specs: list[str] = field(default_factory=list)
    usage: int = 0

    def matrix(self, spec: str) -> np.ndarray:
        """Single-vector results of ``spec`` stacked as ``[N, D]``."""
        if self.multi_vector[spec]:
            raise InvalidError(f"pooler {spec!r} is multi-vector; use .vectors[spec]")
        rows = self.vectors[spec]
        return np.stack(rows) if rows else np.zeros((0, 0), dtype=np.float32)


@dataclass
class Workload:
    """What a call of :meth:`Embedder.embed` would run and return, known before it runs, and the
    tokenization it was counted on, which that call can reuse.

    ``tokens[i]`` counts the tokens text ``i`` takes through the encoder over every plan the
    poolers need (all windows of a windowed or landmark plan); ``vectors`` the vectors all
    poolers return for all texts. ``counts[i]`` is text ``i``'s tokens under the model's own
    (standard) layout -- prompt and special tokens included, cut at the window when
    ``truncate`` -- once per input whatever its poolers: what a server reports as usage.
    ``tokenized[i]`` is text ``i`` as the encoder will read it; pass the list (or a slice of
    it, or lists joined, with the texts they belong to) to ``embed(tokenized=...)``."""

    tokens: list[int]
    vectors: int
    counts: list[int] = field(default_factory=list)
    tokenized: list[Tokenized] = field(default_factory=list)


@dataclass(frozen=True)
class Tokenized:
    """One text's rows under each plan, and the options that made them (``embed`` reuses the
    rows only for a call with the same options)."""

    key: tuple
    rows: dict[Plan, list]


@dataclass(frozen=True)
class EmbedOptions:
    """The options of an :meth:`Embedder.embed` call besides its texts and poolers: what
    changes the forward pass or its post-processing. Calls with equal options can share
    forward batches (the server's batcher groups requests by them).

    Args:
        role: ``query`` or ``document``; selects the model's prompt if it has one.
        normalize: L2-normalize every output vector.
        dimensions: keep the first ``dimensions`` components (Matryoshka), then normalize;
            not applied to poolers with a size of their own (``fde``).
        truncate: cut inputs at the model's window (standard plan); ``False`` raises on an
            over-long input instead. The landmark plan windows and never truncates.
        prompt_name: one of the model's prompts by name (instead of the ``role``'s).
        truncation_direction: ``right`` (default) or ``left``: the end at which ``truncate``
            cuts an over-long input.
    """

    role: str = "document"
    normalize: bool = True
    dimensions: int | None = None
    truncate: bool = True
    prompt_name: str | None = None
    truncation_direction: str = "right"

    @classmethod
    def of(cls, options: "EmbedOptions | None" = None, **fields) -> "EmbedOptions":
        """``options`` (default: the defaults) with ``fields`` replaced; an unknown field is a
        ``TypeError``."""
        options = options if options is not None else cls()
        return dataclasses.replace(options, **fields) if fields else options

    @property
    def tokenize_key(self) -> tuple:
        """The options that change tokenization: rows made under another key are not reusable."""
        return (self.role, bool(self.truncate), self.prompt_name, self.truncation_direction)

    @property
    def tokenizer_options(self) -> dict:
        """The encoder's keyword options of tokenization (besides role and truncate)."""
        return {"prompt_name": self.prompt_name, "truncation_direction": self.truncation_direction}


def _check_tokenized(tokenized: Sequence[Tokenized] | None, n_texts: int, key: tuple) -> None:
    """Pre-tokenized rows must be one per text, made with this call's tokenization options."""
    if tokenized is None:
        return
    if len(tokenized) != n_texts:
        raise InvalidError(f"tokenized holds {len(tokenized)} texts' rows for {n_texts} texts", param="tokenized")
    for i, t in enumerate(tokenized):
        if t.key != key:
            raise InvalidError(f"tokenized[{i}] was made with the options {t.key} (role, truncate, prompt "
                               f"name, truncation direction), this call has {key}: measure with the same options",
                               param="tokenized")


def _pool_part(pooler: Pooler, states, role: str, parts: list) -> list | None:
    """``pooler``'s output per text of a forward batch; for a text split over several batches
    (``states.continued``), ``None`` while its parts gather in ``parts``, then their merge."""
    pooled = pooler.pool_role(states, role)
    if not (states.continued or parts):
        return pooled
    parts.append(pooler.part(states, pooled, role))
    if states.continued:
        return None
    merged = [pooler.merge(parts, role)]
    parts.clear()
    return merged


def postprocess(x: Tensor, normalize: bool, dimensions: int | None) -> Tensor:
    """Matryoshka truncation, then L2 normalization, on the last axis."""
    if dimensions is not None:
        x = x[..., :dimensions]
    if normalize:
        x = torch.nn.functional.normalize(x, dim=-1)
    return x


class Embedder:
    """Runs the encoder once per tokenization plan and applies poolers.

    Args:
        encoder: a loaded :class:`FrozenEncoder`.
        default_pooler: the spec used when none is asked for; ``auto`` means the model's own.
    """

    def __init__(self, encoder: FrozenEncoder, default_pooler: str = "auto") -> None:
        self.encoder = encoder
        self.default_pooler = default_pooler
        self._poolers: dict[str, Pooler] = {}

    @property
    def model_id(self) -> str:
        return self.encoder.model_id

    @property
    def dim(self) -> int:
        """The size of the default pooler's vectors (before any Matryoshka ``dimensions``): with
        ``auto``, the model's own output size, after its head (what ``/info`` reports)."""
        return self.natural_dim(None)

    def uses_head(self, spec: str | Pooler | None) -> bool:
        """Whether pooler ``spec``'s vectors go through the model's head (its sentence-transformers
        modules after Pooling: Dense, LayerNorm, Normalize, ..., then its ``truncate_dim``).

        The rule: every single-vector pooler (and each window's vector of a ``per_window`` one)
        goes through it, so that its vectors live in the model's own space, unless it is asked
        not to (``model_head=false``), has a size of its own (``fde``), or its vectors are not the size
        the head takes (a single mode of a model that concatenates several). Token-level poolers
        (``tokens``, ``cluster``) never do: a sentence head is not trained on tokens (a ColBERT
        model's token projection is applied to every token by the encoder instead)."""
        pooler = spec if isinstance(spec, Pooler) else self.pooler(spec)
        stack = self.encoder.stack
        if stack.multi_vector or not stack.has_head or not getattr(pooler, "model_head", True):
            return False
        if pooler.multi_vector and not getattr(pooler, "per_window", False):
            return False
        if pooler.output_dim(self.encoder.hidden_size) is not None:
            return False
        return self._pooled_dim(pooler) == stack.head_in_dim

    def _pooled_dim(self, pooler: Pooler) -> int:
        """The size of ``pooler``'s vectors before any head."""
        return self.encoder.hidden_size * getattr(pooler, "width", 1)

    def natural_dim(self, spec: str | None) -> int:
        """The size of pooler ``spec``'s vectors before any Matryoshka ``dimensions``: its own
        (``fde``), the model's output size when it goes through the head, else the token
        states' (a ColBERT model's: its projection)."""
        pooler = self.pooler(spec)
        own = pooler.output_dim(self.encoder.hidden_size)
        if own is not None:
            return own
        if self.uses_head(pooler):
            return int(self.encoder.stack.head_out_dim)
        return self._pooled_dim(pooler)

    def pooler(self, spec: str | None) -> Pooler:
        """Build (once) and return the pooler for ``spec``."""
        spec = spec or self.default_pooler
        if spec not in self._poolers:
            p = build_pooler(spec, default=self.encoder.pooling_mode, model_id=self.model_id)
            self.encoder.check_pooler(p)
            self._poolers[spec] = p
            self._poolers.setdefault(p.spec, p)
        return self._poolers[spec]

    def canonical(self, spec: str | None) -> str:
        return self.pooler(spec).spec

    def output_dim(self, spec: str | None, dimensions: int | None = None) -> int:
        """Size of the vectors of pooler ``spec`` after post-processing with ``dimensions``."""
        own = self.pooler(spec).output_dim(self.encoder.hidden_size)
        return own if own is not None else (dimensions or self.natural_dim(spec))

    def check_dimensions(self, dimensions: int | None, spec: str | None = None) -> None:
        """Raise unless ``dimensions`` (Matryoshka) fits pooler ``spec``'s vectors (``None``: the
        default pooler's, or any of the model's sizes)."""
        if dimensions is None:
            return
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise InvalidError(f"dimensions must be an integer, got {type(dimensions).__name__}", param="dimensions")
        limit = self.natural_dim(spec) if spec is not None else max(self.dim, self.encoder.hidden_size)
        if not 1 <= dimensions <= limit:
            what = f" (the size of pooler {self.canonical(spec)!r}'s vectors)" if spec is not None else ""
            raise InvalidError(f"dimensions must be between 1 and the model's {limit}{what}, got {dimensions}",
                               param="dimensions")

    def _plans(self, poolers: Sequence[str] | str | None) -> tuple[dict[str, Pooler], dict[Plan, list[str]]]:
        """The built poolers per spec, and the specs of each tokenization plan."""
        if poolers is None or isinstance(poolers, str):
            poolers = [poolers] if poolers else [self.default_pooler]
        built = {spec: self.pooler(spec) for spec in poolers}
        by_plan: dict[Plan, list[str]] = {}
        for spec, p in built.items():
            by_plan.setdefault(p.plan, []).append(spec)
        return built, by_plan

    def measure(self, texts: Sequence[str], poolers: Sequence[str] | str | None = None,
                options: EmbedOptions | None = None, **fields) -> Workload:
        """The tokens and vectors :meth:`embed` would run and return for these arguments
        (``options`` or its ``fields`` as keywords; only those that change tokenization matter:
        ``role``, ``truncate``, ``prompt_name``, ``truncation_direction``), from tokenization
        alone (no forward pass): what request limits check. The tokenization is kept in the
        result (``tokenized``) for :meth:`embed` to reuse, so a server that checks a request's
        limits does not tokenize it again to encode it. Raises what :meth:`embed` would for an
        input it refuses (e.g. too long with ``truncate=False``)."""
        if isinstance(texts, str):
            raise InvalidError("texts must be a list of strings, not a single string", param="texts")
        options = EmbedOptions.of(options, **fields)
        built, by_plan = self._plans(poolers)
        tokens = [0] * len(texts)
        vectors = 0
        if not texts:  # the tokenizer refuses an empty batch; nothing to count
            return Workload(tokens, vectors)
        per_text: list[dict[Plan, list]] = [{} for _ in texts]
        for plan, specs in by_plan.items():
            for i, rows in enumerate(self.encoder.tokenize_each(texts, plan, options.role, options.truncate,
                                                                **options.tokenizer_options)):
                lengths = [len(r.ids) for r in rows]
                tokens[i] += sum(lengths)
                vectors += sum(built[spec].n_vectors(lengths, options.role) for spec in specs)
                per_text[i][plan] = rows
        counts = [self.encoder.standard_count(rows, options.truncate) for rows in per_text]
        return Workload(tokens, vectors, counts, [Tokenized(options.tokenize_key, rows) for rows in per_text])

    def work_bound(self, n_texts: int, poolers: Sequence[str] | str | None = None,
                   options: EmbedOptions | None = None) -> tuple[int, int] | None:
        """``(tokens, vectors)`` that :meth:`measure` of any ``n_texts`` texts with these poolers
        and options cannot exceed, known without tokenizing, or ``None`` when no such bound
        holds. It holds when every pooler is single-vector on the standard plan and inputs are
        truncated: each text is then one row of at most the model's window, and one vector per
        pooler. (A server checks its work limits on it, when it suffices, instead of tokenizing
        a small request on the thread that answers requests.)"""
        options = options if options is not None else EmbedOptions()
        built, by_plan = self._plans(poolers)
        if (not options.truncate or set(by_plan) != {STANDARD} or any(p.multi_vector for p in built.values())
                or self.encoder.stack.multi_vector):  # a ColBERT model pads its queries: not bounded here
            return None
        window = max(self.encoder.window_for(options.role), self.encoder.max_length)
        return n_texts * window, n_texts * len(built)

    def embed(self, texts: Sequence[str], poolers: Sequence[str] | str | None = None,
              options: EmbedOptions | None = None, *, tokenized: Sequence[Tokenized] | None = None,
              on_batch: Callable[[int, int], None] | None = None,
              on_pool: Callable[[str, float], None] | None = None, **fields) -> EmbedResult:
        """Embed ``texts`` with every pooler in ``poolers`` from one forward pass per plan.

        Args:
            texts: the inputs (a list of strings; an empty string is a valid input).
            poolers: pooler specs; ``None`` uses the default pooler.
            options: an :class:`EmbedOptions` (role, normalize, dimensions, truncate, prompt
                name, truncation direction); its fields may also be given as keywords
                (``fields``: ``role="query"``), alone or over ``options``.
            tokenized: the texts as :meth:`measure` tokenized them (``Workload.tokenized``,
                one per text, in order; a slice of it, or lists joined): the plans it holds are
                not tokenized again (a plan it lacks is tokenized here). Rows made with other
                tokenization options than this call's raise :class:`InvalidError`.
            on_batch: called with ``(texts_done, tokens)`` after each forward batch (a text
                split over several batches is done at its last).
            on_pool: called with ``(spec, seconds)`` after each pooler has pooled (and
                post-processed) a forward batch: the pooler's own time, apart from the forward
                pass its plan shares with the other poolers of the call.
        """
        if isinstance(texts, str):
            raise InvalidError("texts must be a list of strings, not a single string", param="texts")
        options = EmbedOptions.of(options, **fields)
        if options.role not in ROLES:
            raise InvalidError(f"role must be one of {', '.join(ROLES)}, got {options.role!r}", param="role")
        built, by_plan = self._plans(poolers)
        for spec, p in built.items():
            if p.output_dim(self.encoder.hidden_size) is None:
                self.check_dimensions(options.dimensions, spec)
        texts = list(texts)
        _check_tokenized(tokenized, len(texts), options.tokenize_key)
        if tokenized is None:  # tokenized here, once, as encode would: it also gives the usage
            t0 = time.perf_counter()
            tokenized = self.measure(texts, list(built), options).tokenized
            self.encoder.stats.tokenize_seconds += time.perf_counter() - t0
        out: dict[str, list] = {spec: [None] * len(texts) for spec in built}
        tokens_before = self.encoder.stats.tokens
        for plan, specs in by_plan.items():
            rows = None
            if tokenized is not None and all(plan in t.rows for t in tokenized):
                rows = [t.rows[plan] for t in tokenized]
            self._embed_plan(texts, plan, {spec: built[spec] for spec in specs}, options, rows, out,
                             on_batch, on_pool)
        return EmbedResult(
            vectors=out,
            multi_vector={spec: bool(p.multi_vector) for spec, p in built.items()},
            tokens=self.encoder.stats.tokens - tokens_before,
            specs=list(built),
            usage=sum(self.encoder.standard_count(t.rows, options.truncate) for t in tokenized),
        )

    def _embed_plan(self, texts: list[str], plan: Plan, poolers: dict[str, Pooler], options: EmbedOptions,
                    rows: list | None, out: dict[str, list], on_batch: Callable[[int, int], None] | None,
                    on_pool: Callable[[str, float], None] | None) -> None:
        """One forward pass over ``texts`` under ``plan``, every pooler of the plan applied to
        each forward batch, the post-processed vectors written into ``out[spec][i]``."""
        parts: dict[str, list] = {spec: [] for spec in poolers}  # of a text split over batches
        # every hidden layer only when a pooler of this plan reads them, from the same pass
        all_layers = any(p.needs_layers for p in poolers.values())
        heads = {spec: self.uses_head(p) for spec, p in poolers.items()}
        for text_ids, states in self.encoder.encode(texts, plan, role=options.role, truncate=options.truncate,
                                                    all_layers=all_layers, rows=rows,
                                                    **options.tokenizer_options):
            for spec, pooler in poolers.items():
                t0 = time.perf_counter()
                pooled = _pool_part(pooler, states, options.role, parts[spec])
                if pooled is not None:
                    if heads[spec]:  # the model's own modules after Pooling (see uses_head)
                        head = self.encoder.stack.head
                        pooled = head(pooled) if isinstance(pooled, Tensor) else [head(p) for p in pooled]
                    dims = options.dimensions if pooler.output_dim(self.encoder.hidden_size) is None else None
                    norm = options.normalize and not pooler.sparse  # SPLADE weights are scored by dot product
                    if isinstance(pooled, Tensor) and pooled.dim() == 2 and not pooler.multi_vector:
                        vecs = postprocess(pooled, norm, dims).numpy()  # the batch at once
                    else:
                        vecs = [postprocess(p, norm, dims).numpy() for p in pooled]
                    for j, i in enumerate(text_ids):
                        out[spec][i] = vecs[j].astype(np.float32, copy=False)
                if on_pool:
                    on_pool(spec, time.perf_counter() - t0)
            if on_batch:
                on_batch(0 if states.continued else len(text_ids), int(states.attention_mask.sum()))
