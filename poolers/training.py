"""Training the head of a learned pooler (``attention``, ``glot``, ``attnstats`` and ``reinpool``
over the last layer, ``multilayer`` over every layer) on a frozen encoder.

The encoder never changes, so every text's token states are computed once and cached
(float16, on disk when a cache folder is given; every layer's for ``multilayer``); training then
only runs the small head: minutes on a CPU. Objectives:

- ``infonce``: (query, relevant document) pairs, contrastive with in-batch negatives;
- ``cosent``: STS pairs with a gold similarity, CoSENT ranking loss on cosine similarity;
- ICT (inverse cloze) is ``infonce`` on pairs built from unlabeled documents: one sentence as
  the query, the rest of its document as the positive (see :func:`ict_spans`); the positive's
  token states are the document's cached states without the sentence's tokens
  (:func:`ict_positive_states`), so the corpus is encoded once.

Early stopping watches a dev split: carved from the training data (by query for retrieval
pairs, so a dev query never has a positive in train), or a separate dev split when one is given
(never the test split). It selects on the task's own metric by default (``select="metric"``:
nDCG@10 of the dev queries against every document of the data for ``infonce``, Spearman of cosine
for ``cosent``) because a falling CoSENT/InfoNCE loss can hide a falling metric (the loss also
drops when the head merely spreads the cosines). The step-0 head (= mean pooling) is scored too
and kept when no later checkpoint beats it. A fixed seed gives the same weights.

``reinpool``'s policy makes a discrete choice and trains by REINFORCE on an nDCG@10 reward
(:func:`poolers.reinpool.reinforce_loss`) on the same pairs: each document's pooled vector ranks
the training queries (STS: the first sentences of the pairs, pooled by the current head at each
epoch; a pair is relevant when its gold score is at least 80% of the top score); its dev
selection, guard and anchor are the other heads'.

Against over-fitting the training domain: ``anchor`` pulls the pooled vectors toward mean's
(no extra data), and a :class:`Guard` split of another task vetoes checkpoints that score below
the untrained head there (docs/attention.md measures both).
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from embedpool.errors import InvalidError
from embedpool.poolers.attention import AttentionHead, HeadModule, RoleHeads
from embedpool.poolers.attnstats import AttnStatsHead, AttnStatsRoleHeads
from embedpool.poolers.encoder import FrozenEncoder
from embedpool.poolers.gem import GeMHead, GeMRoleHeads, GGeMHead, GGeMRoleHeads
from embedpool.poolers.generalized import GatedHead, GatedRoleHeads, MixedHead, MixedRoleHeads
from embedpool.poolers.glot import GlotHead, GlotRoleHeads
from embedpool.poolers.multilayer import MultiLayerHead, MultiLayerRoleHeads
from embedpool.poolers.reinpool import ReinPoolHead, reinforce_loss

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- token-state cache
def cache_token_states(encoder: FrozenEncoder, texts: Sequence[str], role: str = "document",
                       cache_dir: str | Path | None = None,
                       progress: Callable[[int], None] | None = None, all_layers: bool = False) -> list[Tensor]:
    """Each text's token states (``[n_i, D]`` float16, padding removed), from one pass; with
    ``all_layers`` every hidden layer's, ``[K, n_i, D]`` (the last layer last), for the
    ``multilayer`` head.

    With ``cache_dir`` the states are saved under a key of (model, role, texts, layers) and
    reloaded on the next call instead of running the encoder again.
    """
    texts = list(texts)
    path = None
    if cache_dir is not None:
        parts = [encoder.model_id, role, str(encoder.max_length), *(["all-layers"] if all_layers else []), *texts]
        key = hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]
        path = Path(cache_dir) / f"states-{key}.pt"
        if path.exists():
            return torch.load(path)
    out: list[Tensor | None] = [None] * len(texts)
    for ids, states in encoder.encode(texts, role=role, all_layers=all_layers):
        for j, i in enumerate(ids):
            keep = states.pool_mask[j].bool()
            kept = states.layers[:, j][:, keep] if all_layers else states.hidden[j][keep]
            out[i] = kept.to(torch.float16).clone()
        if progress:
            progress(len(ids))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(out, tmp)
        tmp.replace(path)
    return out  # type: ignore[return-value]


def state_bytes(encoder: FrozenEncoder, texts: Sequence[str], all_layers: bool = False) -> int:
    """What :func:`cache_token_states` of ``texts`` holds in memory (float16, every layer's with
    ``all_layers``), from their token counts at the encoder's window, before anything is encoded."""
    counts = encoder.tokenizer(list(texts), truncation=True, max_length=encoder.max_length, verbose=False)
    layers = encoder.model.config.num_hidden_layers + 1 if all_layers else 1
    return sum(len(ids) for ids in counts["input_ids"]) * encoder.hidden_size * layers * 2


def pad(states: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Right-pad ``[n_i, D]`` states into ``[B, T, D]`` float32 and a ``[B, T]`` mask;
    all-layer states ``[K, n_i, D]`` into ``[K, B, T, D]``."""
    width = max(s.shape[-2] for s in states)
    layers, dim = tuple(states[0].shape[:-2]), states[0].shape[-1]  # layers: () or (K,)
    hidden = torch.zeros(*layers, len(states), width, dim)
    mask = torch.zeros(len(states), width, dtype=torch.long)
    for i, s in enumerate(states):
        hidden[..., i, : s.shape[-2], :] = s.float()
        mask[i, : s.shape[-2]] = 1
    return hidden, mask


# ---------------------------------------------------------------- data
@dataclass
class PairData:
    """Indices into cached query/document states; ``score`` only for STS pairs."""

    queries: list[Tensor]
    docs: list[Tensor]
    pairs: list[tuple[int, int]]
    scores: list[float] | None = None


def pair_states(encoder: FrozenEncoder, pairs: Sequence[tuple[str, str]], scores: list[float] | None = None, *,
                query_role: str = "query", cache_dir: str | Path | None = None,
                progress: Callable[[int], None] | None = None, all_layers: bool = False) -> PairData:
    """:class:`PairData` of ``(query, document)`` text pairs: the token states of each distinct
    query (as ``query_role``; ``document`` for symmetric STS pairs) and document, each from one
    cached pass (:func:`cache_token_states`)."""
    q_texts = sorted({a for a, _ in pairs})
    d_texts = sorted({b for _, b in pairs})
    q_states = cache_token_states(encoder, q_texts, query_role, cache_dir, progress, all_layers)
    d_states = cache_token_states(encoder, d_texts, "document", cache_dir, progress, all_layers)
    q_pos = {t: i for i, t in enumerate(q_texts)}
    d_pos = {t: i for i, t in enumerate(d_texts)}
    return PairData(q_states, d_states, [(q_pos[a], d_pos[b]) for a, b in pairs], scores)


def split_dev(n: int, dev_fraction: float, seed: int,
              groups: Sequence[int] | None = None) -> tuple[list[int], list[int]]:
    """Shuffle ``range(n)`` with ``seed`` into (train, dev) index lists, ``dev_fraction`` of them
    in dev. With ``groups`` (e.g. each pair's query index) whole groups go to one side."""
    if groups is None:
        groups = list(range(n))
    keys = sorted(set(groups))
    random.Random(seed).shuffle(keys)
    n_dev = max(1, int(round(len(keys) * dev_fraction))) if len(keys) > 1 else 0
    dev_keys = set(keys[:n_dev])
    return ([i for i in range(n) if groups[i] not in dev_keys],
            [i for i in range(n) if groups[i] in dev_keys])


_SENT = re.compile(r"(?<=[.!?])\s+")


@dataclass
class IctSpan:
    """One inverse-cloze pair: ``sentence`` of ``docs[doc]`` (characters ``start:end``) is the
    query, ``rest`` (the document without it) the positive."""

    doc: int
    sentence: str
    rest: str
    start: int
    end: int


def ict_spans(docs: Sequence[str], seed: int, min_words: int = 5) -> list[IctSpan]:
    """Inverse cloze task: for each document with at least two sentences, one random sentence
    is the query and the rest of the document (that sentence removed) its positive."""
    rng = random.Random(seed)
    out = []
    for n, doc in enumerate(docs):
        text = doc.strip()
        lead = len(doc) - len(doc.lstrip())
        sents = [s for s in _SENT.split(text) if s]
        if len(sents) < 2:
            continue
        i = rng.randrange(len(sents))
        if len(sents[i].split()) < min_words:
            continue
        pos = 0
        for sent in sents[:i]:
            pos = text.index(sent, pos) + len(sent)
        start = lead + text.index(sents[i], pos)
        out.append(IctSpan(n, sents[i], " ".join(sents[:i] + sents[i + 1:]), start, start + len(sents[i])))
    return out


def ict_pairs(docs: Sequence[str], seed: int, min_words: int = 5) -> list[tuple[str, str]]:
    """``(sentence, rest of its document)`` text pairs of :func:`ict_spans`."""
    return [(s.sentence, s.rest) for s in ict_spans(docs, seed, min_words)]


def ict_positive_states(encoder: FrozenEncoder, docs: Sequence[str], doc_states: Sequence[Tensor],
                        spans: Sequence[IctSpan]) -> list[Tensor]:
    """ICT positives from the documents' own token states: each span's document states without
    the tokens of its query sentence.

    This reuses one encoder pass over the corpus (the same cache retrieval evaluation reads)
    instead of encoding every "rest of the document" text again; the price is that the kept
    tokens were contextualised with the removed sentence still in the window.
    """
    if encoder.prompt_for("document"):
        raise InvalidError("ICT from cached document states does not support a document prompt")
    out = []
    for span in spans:
        enc = encoder.tokenizer(docs[span.doc], add_special_tokens=True, truncation=True,
                                max_length=encoder.max_length, return_offsets_mapping=True, verbose=False)
        offsets = enc["offset_mapping"]
        states = doc_states[span.doc]
        if len(offsets) != states.shape[-2]:
            raise InvalidError(f"document {span.doc}: {len(offsets)} tokens but {states.shape[-2]} cached states")
        keep = torch.tensor([not (b > a and a < span.end and b > span.start) for a, b in offsets])
        out.append(states[..., keep, :].clone())
    return out


def query_role(objective: str) -> str:
    """The role the first text of a pair is encoded and pooled as: STS pairs are symmetric
    (``document`` on both sides), retrieval pairs have a ``query``."""
    return "document" if objective == "cosent" else "query"


# ---------------------------------------------------------------- losses
def infonce(q: Tensor, d: Tensor, temperature: float, same_doc: Tensor | None = None) -> Tensor:
    """In-batch negatives: row i's positive is column i. ``same_doc[i, j]`` masks out columns
    that are also positives of row i (the same document appearing twice in a batch)."""
    logits = F.normalize(q, dim=-1) @ F.normalize(d, dim=-1).T / temperature
    if same_doc is not None:
        logits = logits.masked_fill(same_doc & ~torch.eye(len(q), dtype=torch.bool), float("-inf"))
    return F.cross_entropy(logits, torch.arange(len(q)))


def cosent(a: Tensor, b: Tensor, gold: Tensor, scale: float = 20.0) -> Tensor:
    """CoSENT: every pair with a higher gold score should have a higher cosine."""
    cos = F.cosine_similarity(a, b, dim=-1) * scale
    diff = cos[None, :] - cos[:, None]  # diff[i, j] = cos_j - cos_i, penalised when gold_i > gold_j
    diff = diff.masked_fill(gold[:, None] <= gold[None, :], -1e12)
    return torch.logsumexp(torch.cat([torch.zeros(1), diff.flatten()]), dim=0)


# ---------------------------------------------------------------- training loop
#: pooler -> (one shared head, separate query/document heads), for the heads over the last layer
HEAD_CLASSES: dict[str, tuple[type, type | None]] = {
    "attention": (AttentionHead, RoleHeads),
    "glot": (GlotHead, GlotRoleHeads),
    "attnstats": (AttnStatsHead, AttnStatsRoleHeads),
    "reinpool": (ReinPoolHead, None),  # one policy, for documents: a query is the mean of its vectors
    "mixed": (MixedHead, MixedRoleHeads),
    "gated": (GatedHead, GatedRoleHeads),
    "gem": (GeMHead, GeMRoleHeads),
    "ggem": (GGeMHead, GGeMRoleHeads),  # --heads G: G groups of channels
}
POOLERS = ("attention", "multilayer", "glot", "attnstats", "reinpool", "mixed", "gated", "gem", "ggem")


def default_roles(objective: str, pooler: str) -> str:
    """``separate`` query and document heads for query/document pairs where the head has them
    (separate beat one shared head on SciFact in each of 3 seeds on MiniLM, +2.1 to +3.1 points, and
    by 7.5 points on mpnet's seed 0: docs/attention.md), else ``shared`` (STS pairs are symmetric)."""
    if objective != "infonce":
        return "shared"
    return "separate" if pooler == "multilayer" or HEAD_CLASSES.get(pooler, (None, None))[1] else "shared"


# Optimizer settings that work per objective, what `train-pooler` uses unless told otherwise
# (docs/attention.md, "The command's defaults"): with CoSENT at scale 20 and lr 1e-3, no checkpoint
# of an STS-B-trained head beat the untrained one on STS-B dev (the saved head was mean); scale 5,
# lr 3e-4 and a dev evaluation every 30 steps (an epoch of STS-B train is 90) is what gained.
OBJECTIVE_DEFAULTS: dict[str, dict[str, float]] = {
    "infonce": {"lr": 1e-3, "cosent_scale": 20.0, "eval_every": 0, "patience": 3},
    "cosent": {"lr": 3e-4, "cosent_scale": 5.0, "eval_every": 30, "patience": 6},
}


@dataclass
class TrainConfig:
    """Args:
        objective: ``infonce`` (query/document pairs, also ICT) or ``cosent`` (STS pairs).
        pooler: the head trained: ``attention``, ``glot``, ``attnstats``, ``reinpool`` (last
            layer) or ``multilayer`` (every layer; its states are cached with ``all_layers``).
        heads: attention heads per output vector (see :class:`AttentionHead`).
        roles: ``shared`` (one head) or ``separate`` (a query head and a document head; infonce only).
        select: early-stop and keep the best checkpoint by the dev ``metric`` or the dev ``loss``.
        eval_every: also score the dev split every this many optimizer steps (0: once per epoch).
        patience: stop after this many dev evaluations without a new best.
        cosent_scale: the CoSENT scale (inverse temperature) on cosine similarities.
        anchor: weight of a pull toward the untrained head's output (``mean`` of the last layer):
            ``anchor * mean(1 - cos(pooled, mean))`` over the batch's texts and output vectors is
            added to the loss. It regularizes in the space the vectors are used in, so its scale
            does not depend on the head's size.
        guard_tolerance: with a guard split (:class:`Guard`), a checkpoint is kept only if its
            guard metric is at least the untrained head's minus this; ``None`` (the default):
            only if it is not significantly below the untrained head's there
            (:func:`significantly_below`, one-sided p < :data:`GUARD_ALPHA`): a loss within the
            guard split's noise is no reason to throw a gain away, a real one is.
        layer_lr: the learning rate of a multilayer head's layer weights, as a multiple of ``lr``.
            Adam moves each parameter by about ``lr`` a step whatever its gradient's scale, and a
            layer weight must travel ~0.1-1 to matter where a token score needs ~0.01.
        samples: ``reinpool``: selections drawn per document for REINFORCE.
    """

    objective: str = "infonce"  # infonce | cosent
    pooler: str = "attention"  # attention | multilayer
    queries: int = 1
    heads: int = 1
    value_projection: bool = True
    roles: str = "shared"
    epochs: int = 20
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    temperature: float = 0.05
    cosent_scale: float = 20.0
    patience: int = 3
    seed: int = 0
    dev_fraction: float = 0.1
    select: str = "metric"  # metric | loss
    eval_every: int = 0
    anchor: float = 0.0
    guard_tolerance: float | None = None
    layer_lr: float = 1.0
    samples: int = 8


@dataclass
class Guard:
    """A dev split of another task that training must not lose on (e.g. STS-B dev while
    training on retrieval pairs): scored at every evaluation with its own ``objective``'s
    metric (:func:`dev_metric`), and a checkpoint below the untrained head's score there (by
    more than :attr:`TrainConfig.guard_tolerance`) is never kept."""

    data: PairData
    objective: str  # infonce | cosent


@dataclass
class TrainReport:
    """``best_*`` describe the kept checkpoint (``best_step`` 0 = the untrained head, i.e. mean);
    ``*_guard_metric`` are the guard split's (NaN without one)."""

    best_epoch: int
    best_dev_loss: float
    step0_dev_loss: float
    metric: str = ""
    best_dev_metric: float = float("nan")
    step0_dev_metric: float = float("nan")
    best_step: int = 0
    guard_metric: str = ""
    step0_guard_metric: float = float("nan")
    best_guard_metric: float = float("nan")
    history: list[dict] = field(default_factory=list)


Head = HeadModule  # AttentionHead, RoleHeads, MultiLayerHead, GlotHead, ... (see HEAD_CLASSES)


def layer_count(states: Sequence[Tensor]) -> int:
    """Hidden layers in cached states: ``K`` of ``[K, n, D]`` all-layer states, 0 for last-layer ``[n, D]``."""
    return states[0].shape[0] if states[0].dim() == 3 else 0


def new_head(cfg: TrainConfig, dim: int, layers: int) -> Head:
    """The untrained head ``cfg`` trains (= mean pooling) for states of size ``dim`` with
    ``layers`` hidden layers (0: last-layer states)."""
    if cfg.pooler not in POOLERS:
        raise InvalidError(f"pooler must be one of {', '.join(POOLERS)}, got {cfg.pooler!r}", param="--pooler")
    separate = cfg.roles == "separate"
    if cfg.pooler == "multilayer":
        if not layers:
            raise InvalidError("a multilayer head trains on every layer's states: cache them with all_layers=True")
        head: Head = (MultiLayerRoleHeads if separate else MultiLayerHead)(dim, layers, cfg.queries,
                                                                           cfg.value_projection, cfg.heads)
    elif layers:
        raise InvalidError(f"the {cfg.pooler} head trains on last-layer states; these hold every layer")
    else:
        shared, roles = HEAD_CLASSES[cfg.pooler]
        if separate and roles is None:
            raise InvalidError(f"{cfg.pooler} has no separate query/document heads; use roles=shared")
        head = (roles if separate else shared)(dim, cfg.queries, cfg.value_projection, cfg.heads)
    if cfg.queries > 1:  # break the symmetry between queries (all-zero scores would be identical)
        with torch.no_grad():
            for m in head.modules():
                if isinstance(m, AttentionHead):
                    m.score.weight.normal_(0, 0.01)
    return head


def _forward(head: Head, states: Sequence[Tensor], role: str) -> tuple[Tensor, Tensor]:
    """The head's ``[B, Q, D']`` output and the last layer's mean, ``[B, D']`` (zero-padded when the
    head's vectors are wider than the states, as ``[mu ; sigma]`` without a projection)."""
    hidden, mask = pad(states)
    last = hidden[-1] if hidden.dim() == 4 else hidden
    w = mask.unsqueeze(-1).float()
    out = head(hidden, mask, role=role)
    mean = (last * w).sum(1) / w.sum(1).clamp(min=1)
    return out, F.pad(mean, (0, out.shape[-1] - mean.shape[-1]))


def _flat(out: Tensor) -> Tensor:
    """``[B, Q, D]`` -> the vector a text is compared by: ``[B, D]``, or ``[B, Q*D]`` for Q > 1."""
    return out.flatten(1) if out.shape[1] > 1 else out[:, 0]


def _pool(head: Head, states: Sequence[Tensor], role: str = "document") -> Tensor:
    hidden, mask = pad(states)
    return _flat(head(hidden, mask, role=role))


def pool_states(head: Head, states: Sequence[Tensor], role: str, chunk: int = 128) -> Tensor:
    """Pool many texts in length-sorted chunks (little padding); rows in input order."""
    order = sorted(range(len(states)), key=lambda i: states[i].shape[-2])
    out = [None] * len(states)
    for s in range(0, len(order), chunk):
        ids = order[s:s + chunk]
        for i, v in zip(ids, _pool(head, [states[i] for i in ids], role)):
            out[i] = v
    return torch.stack(out)  # type: ignore[arg-type]


@dataclass
class InverseRetrieval:
    """What ``reinpool``'s reward ranks: ``candidates`` (L2-normalized ``[Q, D]``, the vectors of
    ``data.queries``) and, per document index, the candidate rows relevant to it."""

    candidates: Tensor
    relevant: dict[int, list[int]]

    @classmethod
    def of(cls, head: Head, data: PairData, idx: Sequence[int], cfg: TrainConfig) -> "InverseRetrieval":
        """The training pairs ``idx``: every query pooled as its role (a retrieval query: the mean
        of its vectors; an STS sentence: the head's current selection); with gold scores, only
        pairs scoring at least 80% of the top score are relevant."""
        keep = list(idx)
        if data.scores is not None:
            top = max(data.scores)
            keep = [i for i in keep if data.scores[i] >= 0.8 * top]
        queries = sorted({data.pairs[i][0] for i in idx})
        row = {a: r for r, a in enumerate(queries)}
        relevant: dict[int, list[int]] = {}
        for i in keep:
            a, b = data.pairs[i]
            relevant.setdefault(b, []).append(row[a])
        was = head.training
        head.eval()
        with torch.no_grad():
            vectors = pool_states(head, [data.queries[a] for a in queries], query_role(cfg.objective))
        head.train(was)
        return cls(F.normalize(vectors, dim=-1), relevant)


def _reinforce(head: Head, data: PairData, batch: Sequence[int], cfg: TrainConfig, anchor: float,
               inverse: InverseRetrieval) -> Tensor:
    """``reinpool``'s policy-gradient loss on the batch's distinct documents that have a relevant query."""
    docs = list(dict.fromkeys(b for a, b in (data.pairs[i] for i in batch) if b in inverse.relevant))
    if not docs:
        return sum(p.sum() for p in head.parameters()) * 0.0
    hidden, mask = pad([data.docs[b] for b in docs])
    relevant = torch.zeros(len(docs), inverse.candidates.shape[0], dtype=torch.bool)
    for r, b in enumerate(docs):
        relevant[r, inverse.relevant[b]] = True
    return reinforce_loss(head, hidden, mask, inverse.candidates, relevant, cfg.samples, anchor)


def _batch_loss(head: Head, data: PairData, batch: Sequence[int], cfg: TrainConfig,
                anchor: float = 0.0, inverse: InverseRetrieval | None = None) -> Tensor:
    """The task loss of a batch of pairs, plus ``anchor`` times the pull toward mean (see
    :attr:`TrainConfig.anchor`); ``reinpool``'s REINFORCE loss when ``inverse`` is given."""
    if inverse is not None:
        return _reinforce(head, data, batch, cfg, anchor, inverse)
    pairs = [data.pairs[i] for i in batch]
    q_out, q_mean = _forward(head, [data.queries[a] for a, _ in pairs], query_role(cfg.objective))
    d_out, d_mean = _forward(head, [data.docs[b] for _, b in pairs], "document")
    q, d = _flat(q_out), _flat(d_out)
    if cfg.objective == "cosent":
        assert data.scores is not None
        loss = cosent(q, d, torch.tensor([data.scores[i] for i in batch]), cfg.cosent_scale)
    else:
        doc_ids = torch.tensor([b for _, b in pairs])
        loss = infonce(q, d, cfg.temperature, doc_ids[:, None] == doc_ids[None, :])
    if anchor:
        out, mean = torch.cat([q_out, d_out]), torch.cat([q_mean, d_mean])
        loss = loss + anchor * (1 - F.cosine_similarity(out, mean.unsqueeze(1), dim=-1)).mean()
    return loss


def _eval_loss(head: Head, data: PairData, idx: Sequence[int], cfg: TrainConfig) -> float:
    head.eval()
    with torch.no_grad():
        losses = [(_batch_loss(head, data, idx[s:s + cfg.batch_size], cfg).item(), len(idx[s:s + cfg.batch_size]))
                  for s in range(0, len(idx), cfg.batch_size)
                  if len(idx[s:s + cfg.batch_size]) > 1]
    head.train()
    return sum(l * n for l, n in losses) / max(1, sum(n for _, n in losses))


def dev_metric(head: Head, data: PairData, idx: Sequence[int], cfg: TrainConfig) -> tuple[str, float]:
    """The task metric on dev pairs ``idx`` (higher is better).

    ``cosent``: Spearman correlation of the pairs' cosine with the gold scores. ``infonce``:
    nDCG@10 of each dev query ranking every document in ``data`` (train documents are
    distractors too); a document is relevant when any pair of ``data`` links it to the query.
    """
    name, value, _ = dev_scores(head, data, idx, cfg)
    return name, value


def dev_scores(head: Head, data: PairData, idx: Sequence[int], cfg: TrainConfig) -> tuple[str, float, "DevItems"]:
    """:func:`dev_metric` and what it was computed from, for a paired test between two heads
    (:func:`significantly_below`): each dev query's nDCG@10 (``infonce``), or each pair's cosine
    and gold score (``cosent``)."""
    from scipy.stats import spearmanr

    head.eval()
    with torch.no_grad():
        if cfg.objective == "cosent":
            assert data.scores is not None
            q = F.normalize(pool_states(head, [data.queries[data.pairs[i][0]] for i in idx], "document"), dim=-1)
            d = F.normalize(pool_states(head, [data.docs[data.pairs[i][1]] for i in idx], "document"), dim=-1)
            cos = (q * d).sum(-1).double().numpy()
            gold = np.asarray([data.scores[i] for i in idx], dtype=np.float64)
            head.train()
            return "spearman", float(spearmanr(cos, gold).statistic), DevItems(cos, gold)
        queries = sorted({data.pairs[i][0] for i in idx})
        relevant: dict[int, set[int]] = {}
        for a, b in data.pairs:
            relevant.setdefault(a, set()).add(b)
        q = F.normalize(pool_states(head, [data.queries[a] for a in queries], "query"), dim=-1)
        d = F.normalize(pool_states(head, data.docs, "document"), dim=-1)
        top = (q @ d.T).topk(min(10, d.shape[0]), dim=1).indices
    head.train()
    discount = 1.0 / torch.log2(torch.arange(2, 12, dtype=torch.float64))
    per_query = []
    for row, a in zip(top.tolist(), queries):
        rel = relevant[a]
        dcg = sum(discount[r].item() for r, doc in enumerate(row) if doc in rel)
        idcg = discount[: min(len(rel), 10)].sum().item()
        per_query.append(dcg / idcg)
    values = np.asarray(per_query, dtype=np.float64)
    return "ndcg@10", float(values.mean()) if len(values) else 0.0, DevItems(values)


@dataclass
class DevItems:
    """Per-item dev results: ``values`` are per-query nDCG@10 (``gold`` None), or per-pair
    cosines with their ``gold`` scores (Spearman is not a mean of per-item values)."""

    values: np.ndarray
    gold: np.ndarray | None = None


GUARD_ALPHA = 0.05
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_CHUNK_ENTRIES = 1 << 22


def significantly_below(now: DevItems, before: DevItems, alpha: float = GUARD_ALPHA) -> tuple[bool, float]:
    """Whether the head that gave ``now`` scores significantly below the one that gave ``before``
    on the same dev items (one-sided, level ``alpha``), and the p-value.

    nDCG@10: scipy's paired t-test on the per-query values (the test `embedpool eval` reports
    through ranx). Spearman: a paired bootstrap of the Spearman difference over the pairs
    (:data:`BOOTSTRAP_RESAMPLES` resamples, a fixed seed, as the STS evaluation does), because
    a correlation has no per-pair terms to test."""
    if now.gold is None:
        from scipy.stats import ttest_rel

        if len(now.values) < 2 or np.array_equal(now.values, before.values):
            return False, 1.0
        p = float(ttest_rel(now.values, before.values, alternative="less").pvalue)
        return bool(p < alpha), p
    from scipy.stats import rankdata

    rng = np.random.default_rng(0)
    n = len(now.values)
    # resamples in chunks of at most BOOTSTRAP_CHUNK_ENTRIES indices: memory stays bounded whatever
    # the guard split's size (1,000 resamples of a 100,000-pair split would be 800 MB an array)
    per_chunk = max(1, BOOTSTRAP_CHUNK_ENTRIES // max(1, n))
    diffs = []
    for start in range(0, BOOTSTRAP_RESAMPLES, per_chunk):
        picks = rng.integers(0, n, size=(min(per_chunk, BOOTSTRAP_RESAMPLES - start), n))
        b = rankdata(now.gold[picks], axis=1)
        b -= b.mean(1, keepdims=True)

        def spearman(x: np.ndarray) -> np.ndarray:
            a = rankdata(x[picks], axis=1)
            a -= a.mean(1, keepdims=True)
            with np.errstate(invalid="ignore", divide="ignore"):  # a resample of one gold value: no correlation
                return np.nan_to_num((a * b).sum(1) / np.sqrt((a * a).sum(1) * (b * b).sum(1)))

        diffs.append(spearman(now.values) - spearman(before.values))
    diff = np.concatenate(diffs)
    p = float((np.count_nonzero(diff >= 0) + 1) / (BOOTSTRAP_RESAMPLES + 1))
    return bool(p < alpha), p


def train_head(data: PairData, dim: int, cfg: TrainConfig,
               progress: Callable[[dict], None] | None = None,
               dev: PairData | None = None, guard: Guard | None = None) -> tuple[Head, TrainReport]:
    """Train an attention (or multilayer) head on cached states; return the best head on the dev split.

    ``dev``: a separate dev split (e.g. STS-B ``dev.tsv``); without it a ``dev_fraction`` of
    ``data`` is carved off (by query for ``infonce``). ``guard``: another task's split that a
    kept checkpoint must not lose on (see :class:`Guard`). Returns an :class:`AttentionHead`
    (:class:`MultiLayerHead` for ``pooler="multilayer"``), or the role pair for ``roles="separate"``.

    Runs on one thread: the head's tensors are small, and OpenMP's thread barriers made a
    step several times slower on two threads of a busy 2-core machine.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _Training(data, dim, cfg, progress, dev, guard).run()
    finally:
        torch.set_num_threads(threads)


class _Training:
    """One training run: the head, its optimizer, the dev (and guard) splits, and the best
    checkpoint so far; :meth:`run` trains until the epochs or the patience run out."""

    def __init__(self, data: PairData, dim: int, cfg: TrainConfig, progress: Callable[[dict], None] | None,
                 dev: PairData | None, guard: Guard | None) -> None:
        if cfg.select not in ("metric", "loss"):
            raise InvalidError(f"select must be metric or loss, got {cfg.select!r}", param="--select")
        if cfg.roles not in ("shared", "separate"):
            raise InvalidError(f"roles must be shared or separate, got {cfg.roles!r}", param="--roles")
        if cfg.roles == "separate" and cfg.objective == "cosent":
            raise InvalidError("separate query/document heads need query/document pairs; STS pairs are symmetric",
                               param="--roles")
        if guard is not None and guard.objective not in ("infonce", "cosent"):
            raise InvalidError(f"guard objective must be infonce or cosent, got {guard.objective!r}")
        torch.manual_seed(cfg.seed)
        self.cfg, self.data, self.progress, self.guard = cfg, data, progress, guard
        self.rng = random.Random(cfg.seed)
        self.head = new_head(cfg, dim, layer_count(data.docs))
        if dev is None:
            groups = [a for a, _ in data.pairs] if cfg.objective == "infonce" else None
            self.train_idx, self.dev_idx = split_dev(len(data.pairs), cfg.dev_fraction, cfg.seed, groups)
            self.dev = data
        else:
            self.train_idx, self.dev_idx, self.dev = list(range(len(data.pairs))), list(range(len(dev.pairs))), dev
        # the dev loss is computed in batches: shuffle once so that a split sorted by score (or
        # genre) does not give CoSENT batches with a single gold value
        random.Random(cfg.seed).shuffle(self.dev_idx)
        named = dict(self.head.named_parameters())
        mix = [p for n, p in named.items() if n.rsplit(".", 1)[-1] == "layer_mix"]
        rest = [p for n, p in named.items() if n.rsplit(".", 1)[-1] != "layer_mix"]
        groups = [{"params": rest}, *([{"params": mix, "lr": cfg.lr * cfg.layer_lr}] if mix else [])]
        self.opt = torch.optim.AdamW(groups, lr=cfg.lr, weight_decay=cfg.weight_decay)
        first = self.evaluate(0, 0, None)
        self.report = TrainReport(best_epoch=0, best_dev_loss=first["dev_loss"], step0_dev_loss=first["dev_loss"],
                                  metric=first["metric"], best_dev_metric=first["value"],
                                  step0_dev_metric=first["value"], guard_metric=first.get("guard_metric", ""),
                                  step0_guard_metric=first.get("guard", float("nan")),
                                  best_guard_metric=first.get("guard", float("nan")), history=[first["row"]])
        self.step0_guard_items = first.get("guard_items")
        self.best_state = self._snapshot()
        self.bad = 0

    def _snapshot(self) -> dict[str, Tensor]:
        return {k: v.clone() for k, v in self.head.state_dict().items()}

    def evaluate(self, epoch: int, step: int, train_loss: float | None) -> dict:
        """The dev metric and loss (and the guard's metric) of the head as it is now."""
        name, value = dev_metric(self.head, self.dev, self.dev_idx, self.cfg)
        row = {"epoch": epoch, "step": step, "train_loss": train_loss,
               "dev_loss": _eval_loss(self.head, self.dev, self.dev_idx, self.cfg), f"dev_{name}": value}
        out = {"row": row, "metric": name, "value": value, "dev_loss": row["dev_loss"]}
        if self.guard is not None:
            g_name, g_value, g_items = dev_scores(self.head, self.guard.data, range(len(self.guard.data.pairs)),
                                                 replace(self.cfg, objective=self.guard.objective))
            row[f"guard_{g_name}"] = g_value
            out.update(guard_metric=g_name, guard=g_value, guard_items=g_items)
        return out

    def _guard_refuses(self, result: dict, row: dict) -> bool:
        """Whether the guard split vetoes this checkpoint (see :attr:`TrainConfig.guard_tolerance`)."""
        tolerance = self.cfg.guard_tolerance
        if tolerance is not None:
            return result["guard"] < self.report.step0_guard_metric - tolerance
        below, p = significantly_below(result["guard_items"], self.step0_guard_items)
        row["guard_p_below"] = round(p, 5)
        return below

    def record(self, result: dict) -> bool:
        """Keep the checkpoint if it beats every earlier one (step 0 included) and passes the
        guard; True when patience has run out."""
        cfg, report, row = self.cfg, self.report, result["row"]
        if cfg.select == "metric":
            improved = result["value"] > report.best_dev_metric + 1e-5
        else:
            improved = row["dev_loss"] < report.best_dev_loss - 1e-4
        if self.guard is not None and self._guard_refuses(result, row):
            improved = False
            row["guard_refused"] = True
        report.history.append(row)
        if self.progress:
            self.progress(row)
        if improved:
            report.best_epoch, report.best_step = row["epoch"], row["step"]
            report.best_dev_loss, report.best_dev_metric = row["dev_loss"], result["value"]
            report.best_guard_metric = result.get("guard", float("nan"))
            self.best_state = self._snapshot()
            self.bad = 0
            return False
        self.bad += 1
        return self.bad >= cfg.patience

    def run(self) -> tuple[Head, TrainReport]:
        cfg, step = self.cfg, 0
        inverse = None
        for epoch in range(1, cfg.epochs + 1):
            if cfg.pooler == "reinpool" and (inverse is None or self.data.scores is not None):
                inverse = InverseRetrieval.of(self.head, self.data, self.train_idx, cfg)
            order = self.train_idx[:]
            self.rng.shuffle(order)
            total, n = 0.0, 0
            batches = [order[s:s + cfg.batch_size] for s in range(0, len(order), cfg.batch_size)]
            batches = [b for b in batches if len(b) >= 2]
            for i, batch in enumerate(batches):
                loss = _batch_loss(self.head, self.data, batch, cfg, cfg.anchor, inverse)
                self.opt.zero_grad()
                loss.backward()
                self.opt.step()
                step += 1
                total += loss.item() * len(batch)
                n += len(batch)
                last = i == len(batches) - 1
                if (last or (cfg.eval_every and step % cfg.eval_every == 0)) and \
                        self.record(self.evaluate(epoch, step, total / max(n, 1))):
                    return self._finish()
        return self._finish()

    def _finish(self) -> tuple[Head, TrainReport]:
        self.head.load_state_dict(self.best_state)
        return self.head.eval(), self.report
