"""Learned attention pooling: a masked softmax over per-token scores, then the weighted sum.

The head scores every token state with ``queries`` linear scorers. With zero scoring weights
(no weights file, or a freshly initialised head) every token gets the same weight and the
output is exactly :class:`poolers.mean.MeanPooler`'s. ``queries=k>1`` gives ``k`` vectors per
text (a fixed-count multi-vector, PMA-style); ``heads=h>1`` splits the state dimensions into
``h`` slices, each pooled with its own token weights. An optional value projection (identity at
initialisation) maps the pooled state.

Queries and documents may share one head (``roles: shared``, the default) or use separate
heads (``roles: separate``): the pipeline pools each text through :meth:`AttentionPooler.pool_role`
with its role, and a separate-heads file holds a ``query.*`` and a ``document.*`` head.

Weights are a safetensors file with a JSON config beside it (``head.safetensors`` +
``head.json``), written by ``embedpool train-attention``; ``weights=`` names either file or
their folder.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import Tensor, nn

from embedpool.poolers.base import Pooler, masked_mean, register
from embedpool.poolers.states import TokenStates

WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "head.json"


class AttentionHead(nn.Module):
    """Scores tokens and pools them.

    Args:
        dim: token state size.
        queries: number of output vectors per text.
        value_projection: add a ``dim x dim`` linear map of the pooled state, identity at init.
        heads: attention heads per output vector: the state dimensions are split into ``heads``
            equal slices and each slice is pooled with its own token weights (multi-head
            attention pooling); ``dim`` must be divisible by ``heads``.
    """

    roles = "shared"

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1) -> None:
        super().__init__()
        if queries < 1:
            raise ValueError(f"attention queries must be >= 1, got {queries}")
        if heads < 1 or dim % heads:
            raise ValueError(f"attention heads must be >= 1 and divide the state size {dim}, got {heads}")
        self.dim, self.queries, self.value_projection, self.heads = dim, queries, value_projection, heads
        self.score = nn.Linear(dim, queries * heads)
        nn.init.zeros_(self.score.weight)
        nn.init.zeros_(self.score.bias)
        self.value = None
        if value_projection:
            self.value = nn.Linear(dim, dim)
            nn.init.eye_(self.value.weight)
            nn.init.zeros_(self.value.bias)

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = None) -> Tensor:
        """``hidden [B,T,D]``, ``mask [B,T]`` -> ``[B, queries, D]`` (one head: ``role`` is ignored)."""
        scores = self.score(hidden)  # [B,T,Q*H]
        scores = scores.masked_fill(~mask.bool().unsqueeze(-1), float("-inf"))
        # exp(s - max) is exactly 1.0 for constant scores, so zero weights reproduce mean.
        weights = torch.exp(scores - scores.amax(dim=1, keepdim=True)).nan_to_num(0.0)
        if self.heads == 1:
            pooled = torch.stack([masked_mean(hidden, weights[..., q]) for q in range(self.queries)], dim=1)
        else:
            b, t, d = hidden.shape
            w = weights.view(b, t, self.queries, self.heads)
            num = torch.einsum("btqh,bthd->bqhd", w, hidden.view(b, t, self.heads, d // self.heads))
            pooled = (num / torch.clamp(w.sum(dim=1), min=1e-9).unsqueeze(-1)).reshape(b, self.queries, d)
        if self.value is not None:
            pooled = self.value(pooled)
        return pooled

    def config(self, encoder: str | None = None) -> dict:
        return {"dim": self.dim, "queries": self.queries, "value_projection": self.value_projection,
                "heads": self.heads, "roles": self.roles, "encoder": encoder}

    def save(self, path: str | Path, encoder: str | None = None, **extra) -> Path:
        """Write ``head.safetensors`` + ``head.json`` into folder ``path``."""
        return _save(self, path, encoder, **extra)

    @classmethod
    def load(cls, path: str | Path) -> tuple["AttentionHead | RoleHeads", dict]:
        """Load a head file: an :class:`AttentionHead`, or :class:`RoleHeads` for a
        ``roles: separate`` file."""
        return load_head(path)


class RoleHeads(nn.Module):
    """Separate heads for queries and documents, each an :class:`AttentionHead`.

    Args:
        dim: token state size.
        queries: output vectors per text (both heads).
        value_projection: give both heads a value projection (identity at init).
        heads: attention heads of each (see :class:`AttentionHead`).
    """

    roles = "separate"
    ROLES = ("query", "document")

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1) -> None:
        super().__init__()
        self.dim, self.queries, self.value_projection, self.heads = dim, queries, value_projection, heads
        self.query = AttentionHead(dim, queries, value_projection, heads)
        self.document = AttentionHead(dim, queries, value_projection, heads)

    def head(self, role: str | None) -> AttentionHead:
        if role not in (None, *self.ROLES):
            raise ValueError(f"role must be one of {', '.join(self.ROLES)}, got {role!r}")
        return self.query if role == "query" else self.document

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = "document") -> Tensor:
        """Pool with the head of ``role`` (``None`` = document)."""
        return self.head(role)(hidden, mask)

    config = AttentionHead.config
    save = AttentionHead.save


def _save(head: "AttentionHead | RoleHeads", path: str | Path, encoder: str | None, **extra) -> Path:
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in head.state_dict().items()}, str(folder / WEIGHTS_FILE))
    (folder / CONFIG_FILE).write_text(json.dumps({**head.config(encoder), **extra}, indent=2))
    return folder


def load_head(path: str | Path) -> tuple[AttentionHead | RoleHeads, dict]:
    """Read ``head.safetensors`` + ``head.json`` from folder ``path`` (or either file's folder)."""
    from safetensors.torch import load_file

    folder = Path(path)
    if folder.suffix in (".safetensors", ".json"):
        folder = folder.parent
    cfg_file, w_file = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    if not cfg_file.exists() or not w_file.exists():
        raise FileNotFoundError(
            f"attention weights not found: expected {w_file} and {cfg_file} "
            "(written by `embedpool train-attention --out DIR`)"
        )
    cfg = json.loads(cfg_file.read_text())
    roles = cfg.get("roles", "shared")
    kinds = {"shared": AttentionHead, "separate": RoleHeads}
    if roles not in kinds:
        raise ValueError(f"attention head {folder}: roles must be shared or separate, got {roles!r}")
    head = kinds[roles](int(cfg["dim"]), int(cfg.get("queries", 1)), bool(cfg.get("value_projection", False)),
                        int(cfg.get("heads", 1)))
    head.load_state_dict(load_file(str(w_file)))
    return head.eval(), cfg


MAX_QUERIES = 64  # output vectors per text: a bound so that a request cannot ask for millions


@register
class AttentionPooler(Pooler):
    """Learned attention pooling.

    Args:
        weights: folder (or file) of a trained head; empty for the untrained head (= mean).
        queries: output vectors per text when no weights are given (1 = single vector).
    """

    name = "attention"
    options = {"weights": str, "queries": int}
    weights = ""
    queries = 1

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.head_config: dict = {}
        self.head: AttentionHead | RoleHeads | None = None
        if self.weights:
            self.head, self.head_config = AttentionHead.load(self.weights)
            if "queries" in kwargs and kwargs["queries"] != self.head.queries:
                raise ValueError(f"attention head at {self.weights} has queries={self.head.queries}, "
                                 f"but the spec asks for queries={kwargs['queries']}")
            self.queries = self.head.queries
        elif not 1 <= self.queries <= MAX_QUERIES:
            raise ValueError(f"attention queries must be between 1 and {MAX_QUERIES}, got {self.queries}")

    @property
    def multi_vector(self) -> bool:  # type: ignore[override]
        return self.queries > 1

    def bind(self, model_id: str | None) -> None:
        """Refuse a head trained on another encoder."""
        trained_on = self.head_config.get("encoder")
        if trained_on and model_id and trained_on != model_id:
            raise ValueError(f"attention head {self.weights} was trained on encoder {trained_on!r}, "
                             f"but this encoder is {model_id!r}; train a head for it")

    @property
    def roles(self) -> str:
        """``shared`` (one head for queries and documents) or ``separate``."""
        return self.head.roles if self.head is not None else "shared"

    def pool(self, states: TokenStates) -> Tensor | list[Tensor]:
        """Pool as documents (the document head of a separate-heads file)."""
        return self.pool_role(states, "document")

    def pool_role(self, states: TokenStates, role: str) -> Tensor | list[Tensor]:
        """Pool texts of ``role`` (``query`` or ``document``) with that role's head."""
        if not states.one_row_per_text:
            raise ValueError("attention pooling runs on the standard tokenization plan")
        if self.head is None:
            self.head = AttentionHead(states.hidden.shape[-1], self.queries).eval()
        with torch.inference_mode():
            out = self.head(states.hidden, states.pool_mask, role=role)
        return out[:, 0] if self.queries == 1 else list(out)
