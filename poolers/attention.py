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

A head saves and loads as every module of :mod:`poolers` does (:class:`poolers.base.Configurable`):
its config is ``head.json`` (the constructor arguments, the ``roles`` and the ``encoder`` it was
trained on, plus whatever provenance ``embedpool train-pooler`` adds) and its weights
``head.safetensors``, side by side in one folder; ``weights=`` names that folder or either file.
An :class:`AttentionPooler` saves its own ``config.json`` and, when it has a trained head, the
head beside it, so its folder also works as ``attention:weights=DIR``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from embedpool.errors import InvalidError, NotFoundError
from embedpool.poolers.base import Configurable, Pooler, masked_mean, register
from embedpool.poolers.states import TokenStates

WEIGHTS_FILE = "head.safetensors"
CONFIG_FILE = "head.json"


#: (kind, roles) -> head class: what :meth:`HeadModule.load` builds from a saved config
HEADS: dict[tuple[str, str], type["HeadModule"]] = {}


def head_class(cls: type["HeadModule"]) -> type["HeadModule"]:
    """Class decorator: ``cls`` is the head :meth:`HeadModule.load` builds for its ``kind`` and ``roles``."""
    HEADS[(cls.kind, cls.roles)] = cls
    return cls


class HeadModule(nn.Module, Configurable):
    """What every head shares: the config, and saving and loading it with the weights.

    Loading dispatches on the saved ``kind`` (the pooler the head is for: ``attention``, the
    default of files that do not name one, or ``multilayer``) and ``roles``: :meth:`load` gives
    an :class:`AttentionHead` for an ``attention`` head with ``shared`` roles and
    :class:`RoleHeads` for ``separate`` ones, whichever class it is called on (see :data:`HEADS`)."""

    config_file_name = CONFIG_FILE
    config_keys = ("dim", "queries", "value_projection", "heads", "roles", "encoder")
    kind = "attention"  # saved by the other kinds (in their config_keys); attention files stay as they were
    roles = "shared"

    def __init__(self, dim: int, queries: int, value_projection: bool, heads: int,
                 encoder: str | None, meta: dict[str, Any] | None) -> None:
        super().__init__()
        self.dim, self.queries, self.value_projection, self.heads = dim, queries, value_projection, heads
        self.encoder = encoder
        self.meta: dict[str, Any] = dict(meta or {})  # provenance: objective, source, seed, ...

    def save(self, path: str | Path, encoder: str | None = None, **meta: Any) -> Path:
        """Write ``head.safetensors`` + ``head.json`` into folder ``path``; ``encoder`` (the
        model the head was trained on) and ``meta`` (provenance) go into the config."""
        from safetensors.torch import save_file

        if encoder is not None:
            self.encoder = encoder
        self.meta.update(meta)
        folder = self.save_config(path, extra=self.meta)
        save_file({k: v.contiguous() for k, v in self.state_dict().items()}, str(folder / WEIGHTS_FILE))
        return folder

    @classmethod
    def load(cls, path: str | Path) -> "AttentionHead | RoleHeads":
        """The head saved in folder ``path`` (or beside the file ``path`` names)."""
        from safetensors.torch import load_file

        folder = head_folder(path)
        if not has_head(folder):
            raise NotFoundError(
                f"attention weights not found: expected {folder / WEIGHTS_FILE} and {folder / CONFIG_FILE} "
                "(written by `embedpool train-pooler --out DIR`)", param="pooler")
        config = cls.load_config(folder)
        kind = config.pop("kind", "attention")
        roles = config.pop("roles", "shared")
        if roles not in ("shared", "separate"):
            raise InvalidError(f"attention head {folder}: roles must be shared or separate, got {roles!r}",
                               param="pooler")
        if (kind, roles) not in HEADS:
            raise InvalidError(f"head {folder}: unknown kind {kind!r}; one of {', '.join(sorted({k for k, _ in HEADS}))}",
                               param="pooler")
        made = HEADS[(kind, roles)]
        args = {k: config.pop(k) for k in made.config_keys if k in config and k not in ("kind", "roles")}
        try:
            head = made(**args, meta=config)
        except TypeError as e:  # e.g. no "dim"
            raise InvalidError(f"attention head {folder}: {CONFIG_FILE} is incomplete ({e})", param="pooler") from None
        head.load_state_dict(load_file(str(folder / WEIGHTS_FILE)))
        return head.eval()


def head_folder(path: str | Path) -> Path:
    """The folder of a head given as the folder or as one of its two files."""
    folder = Path(path)
    return folder.parent if folder.suffix in (".safetensors", ".json") else folder


def has_head(folder: Path) -> bool:
    return (folder / CONFIG_FILE).is_file() and (folder / WEIGHTS_FILE).is_file()


@head_class
class AttentionHead(HeadModule):
    """Scores tokens and pools them.

    Args:
        dim: token state size.
        queries: number of output vectors per text.
        value_projection: add a ``dim x dim`` linear map of the pooled state, identity at init.
        heads: attention heads per output vector: the state dimensions are split into ``heads``
            equal slices and each slice is pooled with its own token weights (multi-head
            attention pooling); ``dim`` must be divisible by ``heads``.
        encoder: the model the head is trained on (recorded in its config).
        meta: provenance kept in the config (not used to pool).
    """

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None) -> None:
        if queries < 1:
            raise InvalidError(f"attention queries must be >= 1, got {queries}", param="pooler")
        if heads < 1 or dim % heads:
            raise InvalidError(f"attention heads must be >= 1 and divide the state size {dim}, got {heads}",
                               param="pooler")
        super().__init__(dim, queries, value_projection, heads, encoder, meta)
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
        return self.project(self.attend(hidden, mask))

    def project(self, pooled: Tensor) -> Tensor:
        """The value projection of pooled states (identity without one)."""
        return pooled if self.value is None else self.value(pooled)

    def attend(self, hidden: Tensor, mask: Tensor) -> Tensor:
        """The attention-weighted token means, ``[B, queries, D]``, before the value projection."""
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
        return pooled


@head_class
class RoleHeads(HeadModule):
    """Separate heads for queries and documents, each an :class:`AttentionHead`.

    Args:
        dim: token state size.
        queries: output vectors per text (both heads).
        value_projection: give both heads a value projection (identity at init).
        heads: attention heads of each (see :class:`AttentionHead`).
        encoder: the model the heads are trained on.
        meta: provenance kept in the config.
    """

    roles = "separate"
    ROLES = ("query", "document")
    member: type[AttentionHead] = AttentionHead  # the head of each role

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = False, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None, **member: Any) -> None:
        super().__init__(dim, queries, value_projection, heads, encoder, meta)
        for key, value in member.items():  # the member's own config (multilayer: layers)
            setattr(self, key, value)
        self.query = self.member(dim, queries=queries, value_projection=value_projection, heads=heads, **member)
        self.document = self.member(dim, queries=queries, value_projection=value_projection, heads=heads, **member)

    def head(self, role: str | None) -> AttentionHead:
        if role not in (None, *self.ROLES):
            raise InvalidError(f"role must be one of {', '.join(self.ROLES)}, got {role!r}", param="role")
        return self.query if role == "query" else self.document

    def forward(self, hidden: Tensor, mask: Tensor, role: str | None = "document") -> Tensor:
        """Pool with the head of ``role`` (``None`` = document)."""
        return self.head(role)(hidden, mask)


def role_heads(member: type[HeadModule]) -> type[RoleHeads]:
    """The separate query/document heads of a head class with options of its own (``glot``,
    ``attnstats``, ``reinpool``): a :class:`RoleHeads` whose two members are ``member``, saved and
    loaded under ``member``'s ``kind`` with ``roles: separate``."""
    own = tuple(k for k in member.config_keys if k not in HeadModule.config_keys and k != "kind")

    def __init__(self, dim: int, queries: int = 1, value_projection: bool = True, heads: int = 1,
                 encoder: str | None = None, meta: dict[str, Any] | None = None, **options: Any) -> None:
        RoleHeads.__init__(self, dim, queries, value_projection, heads, encoder, meta, **options)
        for key in own:  # the members' defaults for the options not given
            setattr(self, key, getattr(self.query, key))

    name = member.__name__ + "Roles"
    return head_class(type(name, (RoleHeads,), {
        "__module__": member.__module__, "__qualname__": name, "__init__": __init__,
        "__doc__": f"Separate query and document :class:`{member.__name__}` heads.",
        "kind": member.kind, "config_keys": member.config_keys, "member": member}))


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
    multi_vector = None  # queries > 1
    binds_model = True  # a trained head refuses another encoder

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.head: AttentionHead | RoleHeads | None = None
        if self.weights:
            self.head = AttentionHead.load(self.weights)
            if self.head.kind != self.name:
                raise InvalidError(f"{self.weights} holds a head for pooler {self.head.kind!r}, not {self.name!r}; "
                                   f"use {self.head.kind}:weights={self.weights}", param="pooler")
            if "queries" in kwargs and self.queries != self.head.queries:
                raise InvalidError(f"attention head at {self.weights} has queries={self.head.queries}, "
                                   f"but the spec asks for queries={self.queries}", param="pooler")
            self.queries = self.head.queries
        elif not 1 <= self.queries <= MAX_QUERIES:
            raise InvalidError(f"attention queries must be between 1 and {MAX_QUERIES}, got {self.queries}",
                               param="pooler")
        self.multi_vector = self.queries > 1
        self.role_aware = self.roles == "separate"

    @property
    def head_config(self) -> dict[str, Any]:
        """The trained head's config (``{}`` without weights)."""
        return self.head.get_config_dict() if self.weights and self.head is not None else {}

    def bind(self, model_id: str | None) -> None:
        """Refuse a head trained on another encoder."""
        trained_on = self.head_config.get("encoder")
        if trained_on and model_id and trained_on != model_id:
            raise InvalidError(f"{self.name} head {self.weights} was trained on encoder {trained_on!r}, "
                               f"but this encoder is {model_id!r}; train a head for it", param="pooler")

    def save(self, path: str | Path) -> Path:
        """``config.json``, and the trained head beside it (``weights`` then names this folder)."""
        if not self.weights:
            return super().save(path)
        assert self.head is not None
        folder = self.head.save(path)
        return self.save_config(folder, extra={"weights": "."})

    @classmethod
    def load(cls, path: str | Path) -> "AttentionPooler":
        """The pooler saved in ``path``; a folder with only a head (``embedpool train-pooler``
        output) loads as ``attention:weights=path``. A relative ``weights`` is relative to ``path``."""
        config = cls.load_config(path)
        if not config and has_head(Path(path)):
            config = {"weights": "."}
        weights = config.get("weights")
        if isinstance(weights, str) and weights and not Path(weights).is_absolute():
            config["weights"] = str(Path(path) / weights)
        return cls(**config)

    def n_vectors(self, rows: list[int], role: str) -> int:
        return self.queries

    @property
    def roles(self) -> str:
        """``shared`` (one head for queries and documents) or ``separate``."""
        return self.head.roles if self.head is not None else "shared"

    def pool(self, states: TokenStates) -> Tensor | list[Tensor]:
        """Pool as documents (the document head of a separate-heads file)."""
        return self.pool_role(states, "document")

    def new_head(self, states: TokenStates) -> AttentionHead:
        """The untrained head (zero scores: mean pooling) for these states."""
        return AttentionHead(states.hidden.shape[-1], self.queries)

    def head_input(self, states: TokenStates) -> Tensor:
        """What the head attends over: the last layer's token states ``[B, T, D]``."""
        return states.hidden

    def pool_role(self, states: TokenStates, role: str) -> Tensor | list[Tensor]:
        """Pool texts of ``role`` (``query`` or ``document``) with that role's head."""
        if not states.one_row_per_text:
            raise InvalidError(f"{self.name} pooling runs on the standard tokenization plan")
        if self.head is None:
            self.head = self.new_head(states).eval()
        with torch.inference_mode():
            out = self.head(self.head_input(states), states.pool_mask, role=role)
        return out[:, 0] if self.queries == 1 else list(out)
