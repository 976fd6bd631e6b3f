"""Pooler base class, spec strings (``name[:key=value,...]``) and the registry."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from embedpool.poolers.encoder import STANDARD, Plan
from embedpool.poolers.states import TokenStates

REGISTRY: dict[str, type["Pooler"]] = {}


class PoolerSpecError(ValueError):
    """A pooler spec that does not parse or names an unknown pooler or option."""


def register(cls: type["Pooler"]) -> type["Pooler"]:
    REGISTRY[cls.name] = cls
    return cls


class Pooler:
    """Turns :class:`TokenStates` into one vector per text (``[B, D]``) or, for multi-vector
    poolers, a list of ``[n_i, D]`` tensors. Pure tensor code: no I/O but loading weights.

    Subclasses set ``name``, ``options`` (option name -> type, with defaults as class
    attributes of the same name) and implement :meth:`pool`.
    """

    name: ClassVar[str] = ""
    options: ClassVar[dict[str, type]] = {}
    multi_vector: ClassVar[bool] = False

    def __init__(self, **kwargs: Any) -> None:
        for key, value in kwargs.items():
            setattr(self, key, value)

    @property
    def plan(self) -> Plan:
        return STANDARD

    @property
    def spec(self) -> str:
        """Canonical spec: options that differ from their defaults, in declaration order."""
        parts = [f"{k}={_fmt(getattr(self, k))}" for k in self.options
                 if getattr(self, k) != getattr(type(self), k)]
        return self.name + (":" + ",".join(parts) if parts else "")

    def config(self) -> dict[str, Any]:
        return {"name": self.name, **{k: getattr(self, k) for k in self.options}}

    def pool(self, states: TokenStates) -> Tensor | list[Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def pool_role(self, states: TokenStates, role: str) -> Tensor | list[Tensor]:
        """:meth:`pool` for texts of ``role`` (``query`` or ``document``); the same for both
        unless a pooler treats queries differently (``cluster`` leaves query tokens unpooled)."""
        return self.pool(states)

    def __repr__(self) -> str:
        return f"<pooler {self.spec}>"


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _coerce(pooler: str, key: str, raw: str, kind: type) -> Any:
    try:
        if kind is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return kind(raw)
    except ValueError:
        raise PoolerSpecError(
            f"pooler {pooler!r}: option {key}={raw!r} is not a valid {kind.__name__}"
        ) from None


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    if not isinstance(spec, str) or not spec.strip():
        raise PoolerSpecError(f"a pooler spec must be a non-empty string like 'mean' or 'cluster:pool_factor=2', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    opts: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise PoolerSpecError(f"pooler option {part!r} in {spec!r} must look like key=value")
        opts[key.strip()] = value.strip()
    return name.strip().lower(), opts


def build_pooler(spec: str, *, default: str = "mean", model_id: str | None = None) -> Pooler:
    """Make a pooler from a spec string. ``auto`` means the model's own pooling (``default``).

    Raises:
        PoolerSpecError: unknown pooler or option, or a value of the wrong type; the message
            names the valid choices.
    """
    from embedpool import poolers  # noqa: F401  (registers every pooler module)

    name, raw = parse_spec(spec)
    if name == "auto":
        if raw:
            raise PoolerSpecError("pooler 'auto' takes no options")
        name, raw = parse_spec(default)
    cls = REGISTRY.get(name)
    if cls is None:
        raise PoolerSpecError(
            f"unknown pooler {name!r}; choose one of: auto, {', '.join(sorted(REGISTRY))}"
        )
    kwargs = {}
    for key, value in raw.items():
        if key not in cls.options:
            valid = ", ".join(cls.options) or "none"
            raise PoolerSpecError(f"pooler {name!r} has no option {key!r}; valid options: {valid}")
        kwargs[key] = _coerce(name, key, value, cls.options[key])
    pooler = cls(**kwargs)
    if hasattr(pooler, "bind"):
        pooler.bind(model_id)
    return pooler


def masked_mean(hidden: Tensor, weights: Tensor) -> Tensor:
    """Weighted mean over tokens: ``sum_t w_t h_t / sum_t w_t`` for ``hidden [R,T,D]`` and
    ``weights [R,T]`` (a 0/1 mask for plain mean). Mean and attention pooling share it, so
    attention with constant scores equals mean to the bit."""
    w = weights.to(hidden.dtype).unsqueeze(-1)
    return (hidden * w).sum(dim=1) / torch.clamp(w.sum(dim=1), min=1e-9)


def rows_to_texts(per_row: Tensor, states: TokenStates, weights: Tensor) -> Tensor:
    """Combine per-row weighted means into per-text means, weighting each row by its weight sum."""
    if states.one_row_per_text:
        return per_row
    w = weights.to(per_row.dtype).sum(dim=1, keepdim=True)
    out = torch.zeros(states.n_texts, per_row.shape[-1], dtype=per_row.dtype)
    tot = torch.zeros(states.n_texts, 1, dtype=per_row.dtype)
    out.index_add_(0, states.text_index, per_row * w)
    tot.index_add_(0, states.text_index, w)
    return out / torch.clamp(tot, min=1e-9)
