"""Training the attention pooler's head on a frozen encoder.

The encoder never changes, so every text's token states are computed once and cached
(float16, on disk when a cache folder is given); training then only runs the small head:
minutes on a CPU. Objectives:

- ``infonce``: (query, relevant document) pairs, contrastive with in-batch negatives;
- ``cosent``: STS pairs with a gold similarity, CoSENT ranking loss on cosine similarity;
- ICT (inverse cloze) is ``infonce`` on pairs built from unlabeled documents: one sentence as
  the query, the rest of its document as the positive (see :func:`ict_pairs`).

Early stopping watches the loss on a dev split carved from the training data (never the test
split); a fixed seed gives the same weights.
"""

from __future__ import annotations

import hashlib
import logging
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from poolers.attention import AttentionHead
from poolers.encoder import FrozenEncoder

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- token-state cache
def cache_token_states(encoder: FrozenEncoder, texts: Sequence[str], role: str = "document",
                       cache_dir: str | Path | None = None,
                       progress: Callable[[int], None] | None = None) -> list[Tensor]:
    """Each text's token states (``[n_i, D]`` float16, padding removed), from one pass.

    With ``cache_dir`` the states are saved under a key of (model, role, texts) and reloaded
    on the next call instead of running the encoder again.
    """
    texts = list(texts)
    path = None
    if cache_dir is not None:
        key = hashlib.sha256("\x1f".join([encoder.model_id, role, str(encoder.max_length), *texts])
                             .encode()).hexdigest()[:24]
        path = Path(cache_dir) / f"states-{key}.pt"
        if path.exists():
            return torch.load(path)
    out: list[Tensor | None] = [None] * len(texts)
    for ids, states in encoder.encode(texts, role=role):
        for j, i in enumerate(ids):
            out[i] = states.hidden[j][states.pool_mask[j].bool()].to(torch.float16).clone()
        if progress:
            progress(len(ids))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(out, tmp)
        tmp.replace(path)
    return out  # type: ignore[return-value]


def pad(states: Sequence[Tensor]) -> tuple[Tensor, Tensor]:
    """Right-pad ``[n_i, D]`` states into ``[B, T, D]`` float32 and a ``[B, T]`` mask."""
    width = max(s.shape[0] for s in states)
    hidden = torch.zeros(len(states), width, states[0].shape[1])
    mask = torch.zeros(len(states), width, dtype=torch.long)
    for i, s in enumerate(states):
        hidden[i, : s.shape[0]] = s.float()
        mask[i, : s.shape[0]] = 1
    return hidden, mask


# ---------------------------------------------------------------- data
@dataclass
class PairData:
    """Indices into cached query/document states; ``score`` only for STS pairs."""

    queries: list[Tensor]
    docs: list[Tensor]
    pairs: list[tuple[int, int]]
    scores: list[float] | None = None


def split_dev(n: int, dev_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    idx = list(range(n))
    random.Random(seed).shuffle(idx)
    n_dev = max(1, int(round(n * dev_fraction))) if n > 1 else 0
    return sorted(idx[n_dev:]), sorted(idx[:n_dev])


_SENT = re.compile(r"(?<=[.!?])\s+")


def ict_pairs(docs: Sequence[str], seed: int, min_words: int = 5) -> list[tuple[str, str]]:
    """Inverse cloze task: for each document with at least two sentences, one random sentence
    is the query and the rest of the document (that sentence removed) its positive."""
    rng = random.Random(seed)
    out = []
    for doc in docs:
        sents = [s for s in _SENT.split(doc.strip()) if s]
        if len(sents) < 2:
            continue
        i = rng.randrange(len(sents))
        if len(sents[i].split()) < min_words:
            continue
        out.append((sents[i], " ".join(sents[:i] + sents[i + 1:])))
    return out


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
@dataclass
class TrainConfig:
    objective: str = "infonce"  # infonce | cosent
    queries: int = 1
    value_projection: bool = True
    epochs: int = 20
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    temperature: float = 0.05
    patience: int = 3
    seed: int = 0
    dev_fraction: float = 0.1


@dataclass
class TrainReport:
    best_epoch: int
    best_dev_loss: float
    step0_dev_loss: float
    history: list[dict] = field(default_factory=list)


def _pool(head: AttentionHead, states: Sequence[Tensor]) -> Tensor:
    hidden, mask = pad(states)
    out = head(hidden, mask)  # [B, Q, D]
    return out.flatten(1) if out.shape[1] > 1 else out[:, 0]


def _batch_loss(head: AttentionHead, data: PairData, batch: Sequence[int], cfg: TrainConfig) -> Tensor:
    pairs = [data.pairs[i] for i in batch]
    q = _pool(head, [data.queries[a] for a, _ in pairs])
    d = _pool(head, [data.docs[b] for _, b in pairs])
    if cfg.objective == "cosent":
        assert data.scores is not None
        return cosent(q, d, torch.tensor([data.scores[i] for i in batch]))
    doc_ids = torch.tensor([b for _, b in pairs])
    return infonce(q, d, cfg.temperature, doc_ids[:, None] == doc_ids[None, :])


def _eval_loss(head: AttentionHead, data: PairData, idx: Sequence[int], cfg: TrainConfig) -> float:
    head.eval()
    with torch.no_grad():
        losses = [(_batch_loss(head, data, idx[s:s + cfg.batch_size], cfg).item(), len(idx[s:s + cfg.batch_size]))
                  for s in range(0, len(idx), cfg.batch_size)
                  if len(idx[s:s + cfg.batch_size]) > 1]
    head.train()
    return sum(l * n for l, n in losses) / max(1, sum(n for _, n in losses))


def train_head(data: PairData, dim: int, cfg: TrainConfig,
               progress: Callable[[dict], None] | None = None) -> tuple[AttentionHead, TrainReport]:
    """Train an :class:`AttentionHead` on cached states; return the best head on the dev split.

    Runs on one thread: the head's tensors are small, and OpenMP's thread barriers made a
    step 7x slower on two threads of a busy 2-core machine (measured).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(data, dim, cfg, progress)
    finally:
        torch.set_num_threads(threads)


def _train(data: PairData, dim: int, cfg: TrainConfig,
           progress: Callable[[dict], None] | None) -> tuple[AttentionHead, TrainReport]:
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    head = AttentionHead(dim, cfg.queries, cfg.value_projection)
    if cfg.queries > 1:  # break the symmetry between queries (all-zero scores would be identical)
        with torch.no_grad():
            head.score.weight.normal_(0, 0.01)
    train_idx, dev_idx = split_dev(len(data.pairs), cfg.dev_fraction, cfg.seed)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    best = _eval_loss(head, data, dev_idx, cfg)
    report = TrainReport(best_epoch=0, best_dev_loss=best, step0_dev_loss=best)
    best_state = {k: v.clone() for k, v in head.state_dict().items()}
    bad = 0
    for epoch in range(1, cfg.epochs + 1):
        order = train_idx[:]
        rng.shuffle(order)
        total, n = 0.0, 0
        for s in range(0, len(order), cfg.batch_size):
            batch = order[s:s + cfg.batch_size]
            if len(batch) < 2:
                continue
            loss = _batch_loss(head, data, batch, cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(batch)
            n += len(batch)
        dev = _eval_loss(head, data, dev_idx, cfg)
        row = {"epoch": epoch, "train_loss": total / max(n, 1), "dev_loss": dev}
        report.history.append(row)
        if progress:
            progress(row)
        if dev < best - 1e-4:
            best, bad = dev, 0
            report.best_epoch, report.best_dev_loss = epoch, dev
            best_state = {k: v.clone() for k, v in head.state_dict().items()}
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    head.load_state_dict(best_state)
    return head.eval(), report


