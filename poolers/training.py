"""Training the attention pooler's head on a frozen encoder.

The encoder never changes, so every text's token states are computed once and cached
(float16, on disk when a cache folder is given); training then only runs the small head:
minutes on a CPU. Objectives:

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

from embedpool.errors import InvalidError
from embedpool.poolers.attention import AttentionHead, RoleHeads
from embedpool.poolers.encoder import FrozenEncoder

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


def pair_states(encoder: FrozenEncoder, pairs: Sequence[tuple[str, str]], scores: list[float] | None = None, *,
                query_role: str = "query", cache_dir: str | Path | None = None,
                progress: Callable[[int], None] | None = None) -> PairData:
    """:class:`PairData` of ``(query, document)`` text pairs: the token states of each distinct
    query (as ``query_role``; ``document`` for symmetric STS pairs) and document, each from one
    cached pass (:func:`cache_token_states`)."""
    q_texts = sorted({a for a, _ in pairs})
    d_texts = sorted({b for _, b in pairs})
    q_states = cache_token_states(encoder, q_texts, query_role, cache_dir, progress)
    d_states = cache_token_states(encoder, d_texts, "document", cache_dir, progress)
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
        if len(offsets) != states.shape[0]:
            raise InvalidError(f"document {span.doc}: {len(offsets)} tokens but {states.shape[0]} cached states")
        keep = torch.tensor([not (b > a and a < span.end and b > span.start) for a, b in offsets])
        out.append(states[keep].clone())
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
    """Args:
        objective: ``infonce`` (query/document pairs, also ICT) or ``cosent`` (STS pairs).
        heads: attention heads per output vector (see :class:`AttentionHead`).
        roles: ``shared`` (one head) or ``separate`` (a query head and a document head; infonce only).
        select: early-stop and keep the best checkpoint by the dev ``metric`` or the dev ``loss``.
        eval_every: also score the dev split every this many optimizer steps (0: once per epoch).
        patience: stop after this many dev evaluations without a new best.
        cosent_scale: the CoSENT scale (inverse temperature) on cosine similarities.
    """

    objective: str = "infonce"  # infonce | cosent
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


@dataclass
class TrainReport:
    """``best_*`` describe the kept checkpoint (``best_step`` 0 = the untrained head, i.e. mean)."""

    best_epoch: int
    best_dev_loss: float
    step0_dev_loss: float
    metric: str = ""
    best_dev_metric: float = float("nan")
    step0_dev_metric: float = float("nan")
    best_step: int = 0
    history: list[dict] = field(default_factory=list)


Head = AttentionHead | RoleHeads


def _pool(head: Head, states: Sequence[Tensor], role: str = "document") -> Tensor:
    hidden, mask = pad(states)
    out = head(hidden, mask, role=role)  # [B, Q, D]
    return out.flatten(1) if out.shape[1] > 1 else out[:, 0]


def pool_states(head: Head, states: Sequence[Tensor], role: str, chunk: int = 128) -> Tensor:
    """Pool many texts in length-sorted chunks (little padding); rows in input order."""
    order = sorted(range(len(states)), key=lambda i: states[i].shape[0])
    out = [None] * len(states)
    for s in range(0, len(order), chunk):
        ids = order[s:s + chunk]
        for i, v in zip(ids, _pool(head, [states[i] for i in ids], role)):
            out[i] = v
    return torch.stack(out)  # type: ignore[arg-type]


def _batch_loss(head: Head, data: PairData, batch: Sequence[int], cfg: TrainConfig) -> Tensor:
    pairs = [data.pairs[i] for i in batch]
    q_role = "document" if cfg.objective == "cosent" else "query"  # STS pairs are symmetric
    q = _pool(head, [data.queries[a] for a, _ in pairs], q_role)
    d = _pool(head, [data.docs[b] for _, b in pairs], "document")
    if cfg.objective == "cosent":
        assert data.scores is not None
        return cosent(q, d, torch.tensor([data.scores[i] for i in batch]), cfg.cosent_scale)
    doc_ids = torch.tensor([b for _, b in pairs])
    return infonce(q, d, cfg.temperature, doc_ids[:, None] == doc_ids[None, :])


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
    from scipy.stats import spearmanr

    head.eval()
    with torch.no_grad():
        if cfg.objective == "cosent":
            assert data.scores is not None
            q = F.normalize(pool_states(head, [data.queries[data.pairs[i][0]] for i in idx], "document"), dim=-1)
            d = F.normalize(pool_states(head, [data.docs[data.pairs[i][1]] for i in idx], "document"), dim=-1)
            value = float(spearmanr((q * d).sum(-1).numpy(), [data.scores[i] for i in idx]).statistic)
            head.train()
            return "spearman", value
        queries = sorted({data.pairs[i][0] for i in idx})
        relevant: dict[int, set[int]] = {}
        for a, b in data.pairs:
            relevant.setdefault(a, set()).add(b)
        q = F.normalize(pool_states(head, [data.queries[a] for a in queries], "query"), dim=-1)
        d = F.normalize(pool_states(head, data.docs, "document"), dim=-1)
        top = (q @ d.T).topk(min(10, d.shape[0]), dim=1).indices
    head.train()
    discount = 1.0 / torch.log2(torch.arange(2, 12, dtype=torch.float64))
    total = 0.0
    for row, a in zip(top.tolist(), queries):
        rel = relevant[a]
        dcg = sum(discount[r].item() for r, doc in enumerate(row) if doc in rel)
        idcg = discount[: min(len(rel), 10)].sum().item()
        total += dcg / idcg
    return "ndcg@10", total / max(1, len(queries))


def train_head(data: PairData, dim: int, cfg: TrainConfig,
               progress: Callable[[dict], None] | None = None,
               dev: PairData | None = None) -> tuple[Head, TrainReport]:
    """Train an attention head on cached states; return the best head on the dev split.

    ``dev``: a separate dev split (e.g. STS-B ``dev.tsv``); without it a ``dev_fraction`` of
    ``data`` is carved off (by query for ``infonce``). Returns an :class:`AttentionHead`, or
    :class:`RoleHeads` for ``roles="separate"``.

    Runs on one thread: the head's tensors are small, and OpenMP's thread barriers made a
    step 7x slower on two threads of a busy 2-core machine (measured).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(data, dim, cfg, progress, dev)
    finally:
        torch.set_num_threads(threads)


def _train(data: PairData, dim: int, cfg: TrainConfig, progress: Callable[[dict], None] | None,
           dev: PairData | None) -> tuple[Head, TrainReport]:
    if cfg.select not in ("metric", "loss"):
        raise InvalidError(f"select must be metric or loss, got {cfg.select!r}")
    if cfg.roles not in ("shared", "separate"):
        raise InvalidError(f"roles must be shared or separate, got {cfg.roles!r}")
    if cfg.roles == "separate" and cfg.objective == "cosent":
        raise InvalidError("separate query/document heads need query/document pairs; STS pairs are symmetric")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed)
    head: Head = (RoleHeads if cfg.roles == "separate" else AttentionHead)(dim, cfg.queries, cfg.value_projection,
                                                                          cfg.heads)
    if cfg.queries > 1:  # break the symmetry between queries (all-zero scores would be identical)
        with torch.no_grad():
            for m in head.modules():
                if isinstance(m, AttentionHead):
                    m.score.weight.normal_(0, 0.01)
    if dev is None:
        groups = [a for a, _ in data.pairs] if cfg.objective == "infonce" else None
        train_idx, dev_idx = split_dev(len(data.pairs), cfg.dev_fraction, cfg.seed, groups)
        dev_data = data
    else:
        train_idx, dev_idx, dev_data = list(range(len(data.pairs))), list(range(len(dev.pairs))), dev
    # the dev loss is computed in batches: shuffle once so that a split sorted by score (or
    # genre) does not give CoSENT batches with a single gold value
    random.Random(cfg.seed).shuffle(dev_idx)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)

    def evaluate(epoch: int, step: int, train_loss: float | None) -> tuple[dict, float]:
        name, value = dev_metric(head, dev_data, dev_idx, cfg)
        report.metric = name
        return {"epoch": epoch, "step": step, "train_loss": train_loss,
                "dev_loss": _eval_loss(head, dev_data, dev_idx, cfg), f"dev_{name}": value}, value

    report = TrainReport(best_epoch=0, best_dev_loss=float("nan"), step0_dev_loss=float("nan"))
    first, metric0 = evaluate(0, 0, None)
    report.best_dev_loss = report.step0_dev_loss = first["dev_loss"]
    report.best_dev_metric = report.step0_dev_metric = metric0
    report.history.append(first)
    best_state = {k: v.clone() for k, v in head.state_dict().items()}
    bad, step = 0, 0

    def record(row: dict, metric: float) -> bool:
        """Keep the checkpoint if it beats every earlier one (step 0 included); True when
        patience has run out."""
        nonlocal best_state, bad
        if cfg.select == "metric":
            improved = metric > report.best_dev_metric + 1e-5
        else:
            improved = row["dev_loss"] < report.best_dev_loss - 1e-4
        report.history.append(row)
        if progress:
            progress(row)
        if improved:
            report.best_epoch, report.best_step = row["epoch"], row["step"]
            report.best_dev_loss, report.best_dev_metric = row["dev_loss"], metric
            best_state = {k: v.clone() for k, v in head.state_dict().items()}
            bad = 0
            return False
        bad += 1
        return bad >= cfg.patience

    stop = False
    for epoch in range(1, cfg.epochs + 1):
        order = train_idx[:]
        rng.shuffle(order)
        total, n = 0.0, 0
        batches = [order[s:s + cfg.batch_size] for s in range(0, len(order), cfg.batch_size)]
        batches = [b for b in batches if len(b) >= 2]
        for i, batch in enumerate(batches):
            loss = _batch_loss(head, data, batch, cfg)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            total += loss.item() * len(batch)
            n += len(batch)
            last = i == len(batches) - 1
            if last or (cfg.eval_every and step % cfg.eval_every == 0):
                stop = record(*evaluate(epoch, step, total / max(n, 1)))
                if stop:
                    break
        if stop:
            break
    head.load_state_dict(best_state)
    return head.eval(), report


