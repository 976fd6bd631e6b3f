"""MUVERA fixed-dimensional encodings (Dhulipala et al., NeurIPS 2024, arXiv 2405.19504): token
states -> one vector whose inner product approximates MaxSim (Chamfer similarity), so any
single-vector index can generate the candidates that exact MaxSim then reranks.

The definition (paper, section 3), per repetition ``r = 1..reps``:

- SimHash partitions: ``k_sim`` Gaussian hyperplanes ``g_i``; a vector ``x`` falls in partition
  ``sum_i [<g_i, x> > 0] * 2**i`` of ``B = 2**k_sim``.
- A query's block ``k`` is the *sum* of its vectors in partition ``k`` (zero if none); a document's
  is their *mean*, and an empty document partition takes the document vector whose sign pattern
  is nearest in Hamming distance (ties: the earliest vector).
- Every block goes through the inner projection ``psi(x) = S x / sqrt(dim_proj)``, ``S`` a random
  ``dim_proj x d`` matrix of uniform +-1 entries (none when ``dim_proj`` equals ``d``).
- The ``reps`` results of ``B * dim_proj`` each are concatenated; an optional final projection
  (``final_dim``) multiplies the result by another random +-1 matrix, scaled the same way.

Why not a library (measured in this repository, bench/fde_libraries.py; 512 SciFact documents of
~238 MiniLM tokens, k_sim 4 / dim_proj 32 / reps 10, one thread):

- ``muvera-fde`` (bindings of Google's graph-mining reference) ships only an sdist whose CMake
  build git-clones Eigen and Abseil at install time: it cannot be installed on a machine that
  reaches only package registries.
- ``muvera-python`` 0.2.0 (Rust kernels) fills empty document partitions with the wrong vector:
  it maps a partition index back to its sign pattern with a full Gray-to-binary conversion where
  the reference uses ``i ^ (i >> 1)``: 113 of 400 random small cases give an FDE that is not the
  definition's (a filled partition holds a vector that is not at minimal Hamming distance).
- ``fastembed.postprocess.Muvera`` 0.9.1 follows the definition (checked against the literal
  reading in tests/poolers/test_fde.py) but loops in Python over every token of every repetition
  and installing fastembed would downgrade ``huggingface-hub`` 2.x to 1.x under transformers
  (it pins ``<2.0``) and add four other packages.

So this module is plain numpy, vectorised over a batch: one matrix product for all SimHash
signs and one for all projections, sums per partition by a sorted segment reduction, and the
empty-partition fill at the partition level (every vector of a partition shares its sign
pattern, so the nearest vector is the earliest vector of the nearest occupied partition). Its
cost is linear in the number of tokens. The random matrices come from numpy's legacy
``RandomState``, whose streams numpy keeps frozen across versions: the FDEs of a stored
collection and of later queries are made with the same matrices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import reduce

import numpy as np
import torch
from scipy import sparse
from torch import Tensor

from embedpool.errors import InvalidError
from embedpool.poolers.base import Pooler, _fmt, per_window_option, register
from embedpool.poolers.encoder import STANDARD, WINDOWED, Plan
from embedpool.poolers.states import TokenStates
from embedpool.poolers.tokens import normalized_tokens

ROLES = ("query", "document")


MAX_K_SIM = 10
MAX_DIM = 1 << 16  # FDE components (256 KB per vector in float32)
MAX_FINAL_WEIGHTS = 1 << 27  # final projection matrix entries (512 MB in float32)


def check_options(k_sim: int, dim_proj: int, reps: int, final_dim: int) -> None:
    """Raise InvalidError (a ValueError) naming the bad FDE option."""
    if not 1 <= k_sim <= MAX_K_SIM:
        raise InvalidError(f"fde k_sim must be between 1 and {MAX_K_SIM}, got {k_sim}", param="pooler")
    if dim_proj < 1 or reps < 1:
        raise InvalidError(f"fde dim_proj and reps must be >= 1, got {dim_proj} and {reps}", param="pooler")
    if final_dim < 0:
        raise InvalidError(f"fde final_dim must be >= 0 (0: no final projection), got {final_dim}", param="pooler")
    if max(reps * 2 ** k_sim * dim_proj, final_dim) > MAX_DIM:
        raise InvalidError(f"fde: reps * 2**k_sim * dim_proj = {reps * 2 ** k_sim * dim_proj} components "
                         f"(final_dim {final_dim}); at most {MAX_DIM:,} are supported", param="pooler")
    if final_dim * reps * 2 ** k_sim * dim_proj > MAX_FINAL_WEIGHTS:
        raise InvalidError(f"fde final_dim={final_dim}: the final projection of {reps * 2 ** k_sim * dim_proj} "
                         f"components would need more than {MAX_FINAL_WEIGHTS:,} weights; lower final_dim "
                         "or the FDE size", param="pooler")


class FDE:
    """The encoding for ``dim``-dimensional vectors (numpy, float32).

    Args:
        dim: input vector size.
        k_sim: SimHash hyperplanes per repetition (``2**k_sim`` partitions).
        dim_proj: size of each partition's block after the inner projection (``dim``: none).
        reps: independent repetitions, concatenated.
        seed: seed of every random matrix.
        final_dim: size after a final random +-1 projection (0: none).
    """

    def __init__(self, dim: int, k_sim: int, dim_proj: int, reps: int, seed: int, final_dim: int = 0) -> None:
        check_options(k_sim, dim_proj, reps, final_dim)
        if dim_proj > dim:
            raise InvalidError(f"fde dim_proj must be at most the model's dimension {dim}, got {dim_proj}",
                               param="pooler")
        self.dim, self.k_sim, self.dim_proj, self.reps = dim, k_sim, dim_proj, reps
        self.partitions = 2 ** k_sim
        rng = np.random.RandomState(seed)
        # [dim, reps * k_sim]: column r * k_sim + i is hyperplane i of repetition r
        self.hyperplanes = rng.standard_normal((reps, dim, k_sim)).transpose(1, 0, 2).reshape(dim, -1).astype(np.float32)
        self.projections = None  # [reps, dim, dim_proj]: S_r^T / sqrt(dim_proj)
        if dim_proj < dim:
            signs = rng.randint(0, 2, size=(reps, dim, dim_proj)).astype(np.float32) * 2 - 1
            self.projections = (signs / np.sqrt(dim_proj)).astype(np.float32)
        self.final = None
        if final_dim:
            signs = rng.randint(0, 2, size=(self.raw_dim, final_dim)).astype(np.float32) * 2 - 1
            self.final = (signs / np.sqrt(final_dim)).astype(np.float32)
        pat = np.arange(self.partitions)
        # Hamming distance between partition sign patterns: popcount of the xor
        self.hamming = np.array([[bin(a ^ b).count("1") for b in pat] for a in pat], dtype=np.int64)

    @property
    def raw_dim(self) -> int:
        return self.reps * self.partitions * self.dim_proj

    @property
    def out_dim(self) -> int:
        return self.final.shape[1] if self.final is not None else self.raw_dim

    def partition(self, x: np.ndarray) -> np.ndarray:
        """``[n, reps]`` SimHash partition of each vector in each repetition."""
        bits = (x @ self.hyperplanes > 0).reshape(len(x), self.reps, self.k_sim)
        return (bits.astype(np.int64) << np.arange(self.k_sim)).sum(-1)

    def encode(self, sets: list[np.ndarray], role: str) -> np.ndarray:
        """``[len(sets), out_dim]`` FDEs of the vector sets (``[n_i, dim]`` each, n_i >= 1).

        Per repetition, the vectors are summed per (text, partition) by one sparse product,
        averaged and filled for documents, and only then projected: the projection runs on
        ``2**k_sim`` blocks per text instead of on every token (it is linear, so the result is
        the same)."""
        _check_role(role)
        n_sets, parts = len(sets), self.partitions
        if not n_sets:
            return np.zeros((0, self.out_dim), np.float32)
        lengths = np.array([len(s) for s in sets])
        if (lengths < 1).any():
            raise InvalidError("fde: every text needs at least one vector")
        x = np.ascontiguousarray(np.concatenate(sets), dtype=np.float32)
        owner = np.repeat(np.arange(n_sets), lengths)
        part = self.partition(x)

        def repetition(r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, Callable]:
            sums, counts, first = self._accumulate(x, owner * parts + part[:, r], n_sets * parts)
            return sums, counts, first, lambda cells: x[first[cells]]

        return self._encode(n_sets, repetition, role)

    def cells(self, x: np.ndarray) -> "FdeCells":
        """One text's vectors ``x`` (``[n, dim]``, n >= 1) as :class:`FdeCells`: all that
        :meth:`encode_cells` needs of them, ``reps * 2**k_sim * dim`` floats twice, whatever
        ``n``."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        part = self.partition(x)
        sums, counts, first = zip(*(self._accumulate(x, part[:, r], self.partitions) for r in range(self.reps)))
        first = np.stack(first)
        earliest = np.where((first >= 0)[..., None], x[np.maximum(first, 0)], np.float32(0))
        return FdeCells(np.stack(sums), np.stack(counts), first, earliest, len(x))

    def encode_cells(self, cells: "FdeCells", role: str) -> np.ndarray:
        """``[out_dim]``: the FDE of the text that ``cells`` summarise, the same as
        :meth:`encode` of its vectors."""
        _check_role(role)
        return self._encode(1, lambda r: (cells.sums[r], cells.counts[r], cells.first[r],
                                          lambda c: cells.earliest[r][c]), role)[0]

    @staticmethod
    def _accumulate(x: np.ndarray, cell: np.ndarray, n_cells: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per cell (text, partition) of one repetition, given each vector's ``cell``: the sum
        of its vectors ``[n_cells, dim]``, their count and the index in ``x`` of the earliest
        (-1: none)."""
        n = len(x)
        onehot = sparse.csr_matrix((np.ones(n, np.float32), (cell, np.arange(n))), shape=(n_cells, n))
        first = np.full(n_cells, -1, np.int64)
        occupied, index = np.unique(cell, return_index=True)
        first[occupied] = index
        return np.asarray(onehot @ x), np.bincount(cell, minlength=n_cells), first

    def _encode(self, n_sets: int, repetition: Callable[[int], tuple], role: str) -> np.ndarray:
        """``[n_sets, out_dim]`` from each repetition's cells: ``repetition(r)`` gives the
        sums ``[n_sets * 2**k_sim, dim]``, counts and earliest positions of its cells (as
        :meth:`_accumulate`) and a function from cells to their earliest vectors."""
        out = np.empty((n_sets, self.reps, self.partitions, self.dim_proj), np.float32)
        for r in range(self.reps):
            sums, counts, first, earliest = repetition(r)
            blocks = sums
            if role == "document":
                blocks = sums / np.maximum(counts, 1)[:, None].astype(np.float32)
                self._fill_empty(blocks, first, earliest)
            if self.projections is not None:
                blocks = blocks @ self.projections[r]
            out[:, r] = blocks.reshape(n_sets, self.partitions, self.dim_proj)
        out = out.reshape(n_sets, -1)
        return out if self.final is None else out @ self.final

    def _fill_empty(self, blocks: np.ndarray, first: np.ndarray, earliest: Callable) -> None:
        """Give every empty document partition (``first < 0``) the earliest vector among those
        at minimal Hamming distance. Every vector of a partition has that partition's sign
        pattern, so it is the earliest vector of the nearest occupied partition (nearest, then
        earliest): ``earliest(cells)`` gives those vectors, ``first`` their positions."""
        targets = np.flatnonzero(first < 0)
        if not len(targets):
            return
        parts, big = self.partitions, np.int64(1) << 40
        first_of = np.where(first < 0, big, first).reshape(-1, parts)  # [text, source partition]
        step = max(1, (1 << 22) // parts)  # bounded memory: [step, parts] keys at a time
        for s in range(0, len(targets), step):
            t = targets[s:s + step]
            src = first_of[t // parts]  # [m, source partition]
            key = np.where(src == big, big * 64, self.hamming[t % parts] * big + src)
            blocks[t] = earliest(t - t % parts + key.argmin(axis=1))


@dataclass
class FdeCells:
    """One text's vectors summarised per (repetition, partition): enough to encode it exactly
    (:meth:`FDE.encode_cells`) and to join it with the vectors that follow (:meth:`then`), in
    ``2 * reps * 2**k_sim * dim`` floats however long the text.

    Attributes:
        sums: ``[reps, P, dim]`` sum of each partition's vectors.
        counts: ``[reps, P]`` how many vectors each partition holds.
        first: ``[reps, P]`` position in the text of each partition's earliest vector (-1: none).
        earliest: ``[reps, P, dim]`` that vector (zero for an empty partition).
        n: the text's vectors.
    """

    sums: np.ndarray
    counts: np.ndarray
    first: np.ndarray
    earliest: np.ndarray
    n: int

    def then(self, later: "FdeCells") -> "FdeCells":
        """These vectors followed by ``later``'s: sums and counts add, and a partition first
        occupied in ``later`` takes its earliest vector there."""
        new = (self.first < 0) & (later.first >= 0)
        return FdeCells(self.sums + later.sums, self.counts + later.counts,
                        np.where(new, later.first + self.n, self.first),
                        np.where(new[..., None], later.earliest, self.earliest), self.n + later.n)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise InvalidError(f"role must be one of {', '.join(ROLES)}, got {role!r}", param="role")


@register
@per_window_option
class FdePooler(Pooler):
    """MUVERA fixed-dimensional encoding of a text's L2-normalized token vectors (the ``tokens``
    pooler's vectors): one vector of ``reps * 2**k_sim * dim_proj`` components whose inner
    product with another text's FDE approximates their MaxSim. Queries and documents are
    encoded differently (sum vs mean per partition, empty partitions filled for documents), so
    embed queries with ``role="query"``.

    Args:
        k_sim: SimHash hyperplanes per repetition.
        dim_proj: block size after the random +-1 projection (the model's size: no projection).
        reps: repetitions.
        seed: random seed of the hyperplanes and projections.
        final_dim: final random projection to this size (0: none).
        window: encode every window of a long input and use all its tokens (default: truncate
            at the model's window, like ``tokens``).
        per_window: a document gives one FDE per window (``[n_windows, out_dim]``, each the
            document FDE of that window's tokens), a query one FDE of all its tokens (``[1,
            out_dim]``); see :class:`poolers.base.PerWindow`. Implies ``window=true``: the
            canonical spec of ``fde:per_window=true`` (or ``fde:window=true,per_window=true``)
            ends ``window=true,per_window=true``.
    """

    name = "fde"
    has_model_head = False  # its own size: never through the model's head
    options = {"k_sim": int, "dim_proj": int, "reps": int, "seed": int, "final_dim": int, "window": bool}
    k_sim = 4  # defaults: the best of bench/index.py --fde's sweep (README, "MUVERA FDE candidates")
    dim_proj = 64
    reps = 10
    seed = 42
    final_dim = 0
    window = False
    role_aware = True  # queries sum per partition, documents average and fill

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._fde: FDE | None = None
        check_options(self.k_sim, self.dim_proj, self.reps, self.final_dim)

    @property
    def plan(self) -> Plan:
        return WINDOWED if self.window else STANDARD

    @property
    def spec(self) -> str:
        """Every option, defaults included: the spec a collection's manifest records pins the
        encoding even if a later version changes the defaults. ``per_window`` is written only
        when true, so the specs written before it existed still name the same pooler."""
        parts = [f"{k}={_fmt(getattr(self, k))}" for k in self.options if k != "per_window" or self.per_window]
        return self.name + ":" + ",".join(parts)

    def output_dim(self, model_dim: int) -> int:
        return self.final_dim or self.reps * 2 ** self.k_sim * self.dim_proj

    def encoder(self, dim: int) -> FDE:
        if self._fde is None or self._fde.dim != dim:
            self._fde = FDE(dim, self.k_sim, self.dim_proj, self.reps, self.seed, self.final_dim)
        return self._fde

    def encode_sets(self, sets: list[np.ndarray], role: str) -> np.ndarray:
        """FDEs of given vector sets (e.g. a collection's stored token vectors)."""
        if not sets:
            return np.zeros((0, self.output_dim(0)), np.float32)
        return self.encoder(sets[0].shape[1]).encode(sets, role)

    def pool(self, states: TokenStates) -> Tensor:
        return self.pool_role(states, "document")

    def pool_role(self, states: TokenStates, role: str) -> Tensor:
        sets = [t.numpy() for t in normalized_tokens(states)]
        return torch.from_numpy(self.encode_sets(sets, role))

    # A long text split over forward batches (window=true): each batch's part is its token
    # vectors summarised per (repetition, partition) -- sums, counts, and the earliest vector
    # with its position, for the document fill -- bounded by the FDE's size, not the text's
    # length; the merge joins them in order and encodes the result, exactly as one set.
    def part(self, states: TokenStates, pooled: Tensor, role: str = "document") -> FdeCells:
        tokens = normalized_tokens(states)[0].numpy()
        return self.encoder(tokens.shape[1]).cells(tokens)

    def merge(self, parts: list[FdeCells], role: str = "document") -> Tensor:
        cells = reduce(FdeCells.then, parts)
        return torch.from_numpy(self.encoder(cells.sums.shape[-1]).encode_cells(cells, role))
