"""The pipeline: one forward pass per tokenization plan, every requested pooler applied to it,
then post-processing (Matryoshka ``dimensions``, normalization)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from embedpool.errors import InvalidError, InvalidTypeError
from embedpool.poolers.base import Pooler, build_pooler
from embedpool.poolers.encoder import FrozenEncoder, Plan

ROLES = ("query", "document")


@dataclass
class EmbedResult:
    """Embeddings per pooler spec, in input order.

    ``vectors[spec][i]`` is a ``[D]`` float32 array for single-vector poolers and ``[n_i, D]``
    for multi-vector ones. ``tokens`` counts the tokens through the encoder, all plans.
    """

    vectors: dict[str, list[np.ndarray]]
    multi_vector: dict[str, bool]
    tokens: int = 0
    specs: list[str] = field(default_factory=list)

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


def _tokenize_key(role: str, truncate: bool, prompt_name: str | None = None,
                  truncation_direction: str = "right") -> tuple:
    return (role, bool(truncate), prompt_name, truncation_direction)


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
        return self.encoder.hidden_size

    def pooler(self, spec: str | None) -> Pooler:
        """Build (once) and return the pooler for ``spec``."""
        spec = spec or self.default_pooler
        if spec not in self._poolers:
            p = build_pooler(spec, default=self.encoder.pooling_mode, model_id=self.model_id)
            self._poolers[spec] = p
            self._poolers.setdefault(p.spec, p)
        return self._poolers[spec]

    def canonical(self, spec: str | None) -> str:
        return self.pooler(spec).spec

    def output_dim(self, spec: str | None, dimensions: int | None = None) -> int:
        """Size of the vectors of pooler ``spec`` after post-processing with ``dimensions``."""
        own = self.pooler(spec).output_dim(self.dim)
        return own if own is not None else (dimensions or self.dim)

    def dimensions_for(self, spec: str | None, dim: int) -> int | None:
        """The ``dimensions`` argument that makes pooler ``spec`` produce ``dim``-sized vectors
        (``None``: none needed, e.g. a pooler with a size of its own)."""
        if self.pooler(spec).output_dim(self.dim) is not None or dim >= self.dim:
            return None
        return dim

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        if isinstance(dimensions, bool) or not isinstance(dimensions, int):
            raise InvalidTypeError(f"dimensions must be an integer, got {type(dimensions).__name__}")
        if not 1 <= dimensions <= self.dim:
            raise InvalidError(f"dimensions must be between 1 and the model's {self.dim}, got {dimensions}")

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
                role: str = "document", truncate: bool = True, **options) -> Workload:
        """The tokens and vectors :meth:`embed` would run and return for these arguments
        (``options``: ``prompt_name``, ``truncation_direction``), from tokenization alone (no
        forward pass): what request limits check. The tokenization is kept in the result
        (``tokenized``) for :meth:`embed` to reuse, so a server that checks a request's limits
        does not tokenize it again to encode it. Raises what :meth:`embed` would for an input it
        refuses (e.g. too long with ``truncate=False``)."""
        if isinstance(texts, str):
            raise InvalidTypeError("texts must be a list of strings, not a single string")
        built, by_plan = self._plans(poolers)
        tokens = [0] * len(texts)
        vectors = 0
        if not texts:  # the tokenizer refuses an empty batch; nothing to count
            return Workload(tokens, vectors)
        per_text: list[dict[Plan, list]] = [{} for _ in texts]
        for plan, specs in by_plan.items():
            for i, rows in enumerate(self.encoder.tokenize_each(texts, plan, role, truncate, **options)):
                lengths = [len(r.ids) for r in rows]
                tokens[i] += sum(lengths)
                vectors += sum(built[spec].n_vectors(lengths, role) for spec in specs)
                per_text[i][plan] = rows
        key = _tokenize_key(role, truncate, **options)
        counts = [self.encoder.standard_count(rows, truncate) for rows in per_text]
        return Workload(tokens, vectors, counts, [Tokenized(key, rows) for rows in per_text])

    def embed(
        self,
        texts: Sequence[str],
        poolers: Sequence[str] | str | None = None,
        role: str = "document",
        normalize: bool = True,
        dimensions: int | None = None,
        truncate: bool = True,
        on_batch: Callable[[int, int], None] | None = None,
        on_pool: Callable[[str, float], None] | None = None,
        *,
        prompt_name: str | None = None,
        truncation_direction: str = "right",
        tokenized: Sequence[Tokenized] | None = None,
    ) -> EmbedResult:
        """Embed ``texts`` with every pooler in ``poolers`` from one forward pass per plan.

        Args:
            texts: the inputs (a list of strings; an empty string is a valid input).
            poolers: pooler specs; ``None`` uses the default pooler.
            role: ``query`` or ``document``; selects the model's prompt if it has one.
            normalize: L2-normalize every output vector.
            dimensions: keep the first ``dimensions`` components (Matryoshka), then normalize;
                not applied to poolers with a size of their own (``fde``).
            truncate: cut inputs at the model's window (standard plan); ``False`` raises on
                an over-long input instead. The landmark plan windows and never truncates.
            on_batch: called with ``(texts_done, tokens)`` after each forward batch (a text
                split over several batches is done at its last).
            on_pool: called with ``(spec, seconds)`` after each pooler has pooled (and
                post-processed) a forward batch: the pooler's own time, apart from the forward
                pass its plan shares with the other poolers of the call.
            prompt_name: one of the model's prompts by name (instead of the ``role``'s).
            truncation_direction: ``right`` (default) or ``left``: the end at which
                ``truncate`` cuts an over-long input.
            tokenized: the texts as :meth:`measure` tokenized them (``Workload.tokenized``,
                one per text, in order): the plans it holds are not tokenized again. Rows made
                with other options than this call's are ignored (tokenized again).
        """
        if isinstance(texts, str):
            raise InvalidTypeError("texts must be a list of strings, not a single string")
        if role not in ROLES:
            raise InvalidError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.check_dimensions(dimensions)
        built, by_plan = self._plans(poolers)

        texts = list(texts)
        out: dict[str, list] = {spec: [None] * len(texts) for spec in built}
        tokens_before = self.encoder.stats.tokens
        key = _tokenize_key(role, truncate, prompt_name, truncation_direction)
        reuse = tokenized is not None and len(tokenized) == len(texts) and all(t.key == key for t in tokenized)
        for plan, specs in by_plan.items():
            parts: dict[str, list] = {spec: [] for spec in specs}  # of a text split over batches
            rows = [t.rows[plan] for t in tokenized] if reuse and all(plan in t.rows for t in tokenized) else None
            # every hidden layer only when a pooler of this plan reads them, from the same pass
            all_layers = any(built[spec].needs_layers for spec in specs)
            for text_ids, states in self.encoder.encode(texts, plan, role=role, truncate=truncate,
                                                        all_layers=all_layers, prompt_name=prompt_name,
                                                        truncation_direction=truncation_direction, rows=rows):
                for spec in specs:
                    t0 = time.perf_counter()
                    pooled = _pool_part(built[spec], states, role, parts[spec])
                    dims = dimensions if built[spec].output_dim(self.dim) is None else None
                    if pooled is not None:
                        if isinstance(pooled, Tensor) and pooled.dim() == 2 and not built[spec].multi_vector:
                            vecs = postprocess(pooled, normalize, dims).numpy()  # the batch at once
                        else:
                            vecs = [postprocess(p, normalize, dims).numpy() for p in pooled]
                        for j, i in enumerate(text_ids):
                            out[spec][i] = vecs[j].astype(np.float32, copy=False)
                    if on_pool:
                        on_pool(spec, time.perf_counter() - t0)
                if on_batch:
                    on_batch(0 if states.continued else len(text_ids), int(states.attention_mask.sum()))
        return EmbedResult(
            vectors=out,
            multi_vector={spec: bool(p.multi_vector) for spec, p in built.items()},
            tokens=self.encoder.stats.tokens - tokens_before,
            specs=list(built),
        )
