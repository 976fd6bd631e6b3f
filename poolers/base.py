"""Pooler base class, spec strings (``name[:key=value,...]``), the registry, and the one way
every module of this package saves and loads its config (:class:`Configurable`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import Tensor

from embedpool.errors import InvalidError
from embedpool.poolers.encoder import STANDARD, WINDOWED, Plan
from embedpool.poolers.states import TokenStates, layer_indices

REGISTRY: dict[str, type["Pooler"]] = {}


def register(cls: type["Pooler"]) -> type["Pooler"]:
    REGISTRY[cls.name] = cls
    return cls


class Configurable:
    """Config saved and loaded one way, as sentence-transformers' ``Module`` does it.

    ``config_keys`` name the constructor arguments that make the module; :meth:`get_config_dict`
    reads them off the object, :meth:`save` writes them as JSON (``config_file_name``) into a
    folder, with any weights beside them, and :meth:`load` builds the object again from that
    folder. A missing config file is an empty config (the defaults), as in sentence-transformers.
    """

    config_keys: ClassVar[tuple[str, ...]] = ()
    config_file_name: ClassVar[str] = "config.json"

    def get_config_dict(self) -> dict[str, Any]:
        return {key: getattr(self, key) for key in self.config_keys}

    def save_config(self, path: str | Path, extra: dict[str, Any] | None = None) -> Path:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        config = {**self.get_config_dict(), **(extra or {})}
        (folder / self.config_file_name).write_text(json.dumps(config, indent=2))
        return folder

    def save(self, path: str | Path) -> Path:
        """Write the module into folder ``path`` (created if needed); returns the folder."""
        return self.save_config(path)

    @classmethod
    def load_config(cls, path: str | Path) -> dict[str, Any]:
        file = Path(path) / cls.config_file_name
        try:
            config = json.loads(file.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidError(f"{file} is not a readable config: {e}") from None
        if not isinstance(config, dict):
            raise InvalidError(f"{file} must hold a JSON object, not {type(config).__name__}")
        return config

    @classmethod
    def load(cls, path: str | Path) -> Any:
        """The module saved in folder ``path``."""
        return cls(**cls.load_config(path))


class Pooler(Configurable):
    """Turns :class:`TokenStates` into one vector per text (``[B, D]``) or, for multi-vector
    poolers, a list of ``[n_i, D]`` tensors. Pure tensor code: no I/O but loading weights.

    Subclasses set ``name``, ``options`` (option name -> type, with defaults as class
    attributes of the same name; they are also the ``config_keys``) and implement :meth:`pool`.

    What a pooler can do is declared, not guessed from its methods:

    - ``multi_vector``: gives several vectors per text (``None`` on a class whose instances
      decide from their options, e.g. ``attention:queries=k`` or ``mean:per_window=true``;
      every instance has a bool);
    - ``role_aware``: pools queries and documents differently (:meth:`pool_role`);
    - ``binds_model``: checks itself against the encoder it pools for (:meth:`bind`, e.g. a
      trained head refuses another encoder);
    - ``plan``: the tokenization plan its token states come from;
    - ``needs_layers``: reads every hidden layer (``TokenStates.layers``), which the encoder then
      returns from the same forward pass; the other poolers' requests never pay for them;
    - ``sparse``: gives sparse vocabulary-sized vectors scored by dot product (``splade``): never
      normalized nor truncated, served as indices and values.

    Every pooler that is not always multi-vector has the option ``model_head`` (default true): its
    vectors go through the model's own modules after Pooling (Dense, LayerNorm, Normalize, its
    Matryoshka ``truncate_dim``) where they apply, so that they live in the model's space
    (:meth:`poolers.pipeline.Embedder.uses_head`); ``model_head=false`` keeps the raw pooled states.
    """

    name: ClassVar[str] = ""
    options: ClassVar[dict[str, type]] = {}
    multi_vector: bool | None = False
    role_aware: bool = False
    binds_model: ClassVar[bool] = False
    needs_layers: ClassVar[bool] = False
    sparse: ClassVar[bool] = False
    #: single-vector poolers take ``model_head``; one with a size of its own (``fde``) does not
    has_model_head: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.multi_vector is not True and cls.has_model_head and "model_head" not in cls.options:
            # every single-vector pooler: through the model's head or not (Embedder.uses_head)
            cls.options = {**cls.options, "model_head": bool}
            cls.model_head = True
        if "config_keys" not in cls.__dict__:
            cls.config_keys = tuple(cls.options)

    def __init__(self, **kwargs: Any) -> None:
        for key, value in self.check_config(kwargs).items():
            setattr(self, key, value)

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        if config.get("model_head") is True:  # the default: saved configs stay as they were
            del config["model_head"]
        return config

    @classmethod
    def check_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with every value of its option's type (strings are parsed, as in a spec).

        Raises:
            InvalidError: an unknown option, or a value that is not of the option's type.
        """
        out = {}
        for key, value in config.items():
            if key not in cls.options:
                valid = ", ".join(cls.options) or "none"
                multi = sorted(n for n, c in REGISTRY.items() if c.multi_vector is True and key in c.options)
                if multi and cls.multi_vector is not True:
                    raise InvalidError(
                        f"pooler {cls.name!r} gives one vector per text and has no option {key!r}: {key!r} is "
                        f"an option of the multi-vector poolers ({', '.join(multi)}); drop it or use one of "
                        f"those (valid options of {cls.name!r}: {valid})", param="pooler")
                raise InvalidError(f"pooler {cls.name!r} has no option {key!r}; valid options: {valid}", param="pooler")
            out[key] = _coerce(cls.name, key, value, cls.options[key])
        return out

    @property
    def plan(self) -> Plan:
        return STANDARD

    @property
    def spec(self) -> str:
        """Canonical spec: options that differ from their defaults, in declaration order."""
        parts = [f"{k}={_fmt(getattr(self, k))}" for k in self.options
                 if getattr(self, k) != getattr(type(self), k)]
        return self.name + (":" + ",".join(parts) if parts else "")

    def output_dim(self, model_dim: int) -> int | None:
        """Size of this pooler's vectors when it has one of its own (``fde``), else ``None``: the
        model's hidden size, which Matryoshka ``dimensions`` may truncate."""
        return None

    def bind(self, model_id: str | None) -> None:
        """Check the pooler against the encoder ``model_id`` (poolers with ``binds_model``)."""

    def pool(self, states: TokenStates) -> Tensor | list[Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def pool_role(self, states: TokenStates, role: str) -> Tensor | list[Tensor]:
        """:meth:`pool` for texts of ``role`` (``query`` or ``document``); the same for both
        unless the pooler is ``role_aware`` (``cluster`` leaves query tokens unpooled)."""
        return self.pool(states)

    # A text with more windows than one forward batch holds comes in several batches (see
    # TokenStates.continued); its result is merged from one part per batch, so that no pooler
    # ever holds more than a batch of token states.
    def part(self, states: TokenStates, pooled: Tensor | list[Tensor], role: str = "document") -> Any:
        """What :meth:`merge` needs of a batch that holds part of one text's windows
        (``pooled``: this pooler's output for that batch, pooled as ``role``). Default: the
        output itself."""
        return pooled[0]

    def merge(self, parts: list[Any], role: str = "document") -> Tensor:
        """One text's result (in ``role``) from its :meth:`part` of each batch, in window order. Default:
        multi-vector outputs are concatenated (they pool every window on its own); a
        single-vector pooler on a windowing plan must say how its parts combine."""
        if self.multi_vector:
            return torch.cat(parts)
        raise NotImplementedError(f"pooler {self.name!r} cannot pool a text spread over several batches")

    def n_vectors(self, rows: list[int], role: str) -> int:
        """How many vectors :meth:`pool_role` returns for one text whose rows (windows) have
        these lengths: known before the forward pass (request limits). One by default."""
        return 1

    def __repr__(self) -> str:
        return f"<pooler {self.spec}>"


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _coerce(pooler: str, key: str, raw: Any, kind: type) -> Any:
    """``raw`` (a spec's string, or a saved config's JSON value) as a ``kind``."""
    if isinstance(raw, kind) and not (kind is not bool and isinstance(raw, bool)):
        return raw
    if kind is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    try:
        if not isinstance(raw, str):
            raise ValueError
        if kind is bool:
            low = raw.lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return kind(raw)
    except ValueError:
        raise InvalidError(
            f"pooler {pooler!r}: option {key}={raw!r} is not a valid {kind.__name__}", param="pooler"
        ) from None


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    if not isinstance(spec, str) or not spec.strip():
        raise InvalidError(f"a pooler spec must be a non-empty string like 'mean' or 'cluster:pool_factor=2', got {spec!r}",
                           param="pooler")
    name, _, rest = spec.strip().partition(":")
    opts: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise InvalidError(f"pooler option {part!r} in {spec!r} must look like key=value", param="pooler")
        opts[key.strip()] = value.strip()
    return name.strip().lower(), opts


def build_pooler(spec: str, *, default: str = "mean", model_id: str | None = None) -> Pooler:
    """Make a pooler from a spec string. ``auto`` means the model's own pooling (``default``).

    Raises:
        InvalidError: unknown pooler or option, or a value of the wrong type; the message
            names the valid choices.
    """
    from embedpool import poolers  # noqa: F401  (registers every pooler module)

    name, raw = parse_spec(spec)
    if name == "auto":
        if raw:
            raise InvalidError("pooler 'auto' takes no options", param="pooler")
        name, raw = parse_spec(default)
    cls = REGISTRY.get(name)
    if cls is None:
        raise InvalidError(
            f"unknown pooler {name!r}; choose one of: auto, {', '.join(sorted(REGISTRY))}", param="pooler"
        )
    pooler = cls(**raw)
    if cls.binds_model:
        pooler.bind(model_id)
    return pooler


class PerWindow:
    """The ``per_window`` option of a single-vector pooler (added by :func:`per_window_option`):
    with ``per_window=true`` the pooler is multi-vector on the windowed plan (a pooler with a
    windowing plan of its own, ``landmark``, keeps it) and

    - a document gives one vector per window (row), ``[n_windows, D]``: each what the plain
      pooler (the same options, ``per_window=false``) gives for that row taken alone; a text
      that fits one window gives ``[1, D]``, the plain pooler's vector on the standard plan
      (the first window is the standard, truncated, sequence);
    - a query gives one vector, ``[1, D]``: the plain pooler's over all its windows (a query
      is not split for candidate search), so one spec serves a collection's documents and
      queries.

    A document whose windows span several forward batches gives all its windows' vectors in
    order (its parts are concatenated); a query merges as the plain pooler does. A pooler with
    a ``window`` option (``fde``) gets ``window=true``: per-window pooling implies it. With
    ``per_window=false`` every method is the plain pooler's.
    """

    per_window = False
    _plain: "Pooler"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if self.per_window:
            if "window" in self.options:
                self.window = True
            # the plain pooler pools every window (documents) or the whole text (queries)
            self._plain = type(self)(**{**self.get_config_dict(), "per_window": False})
        self.multi_vector = self.per_window
        self.role_aware = self.per_window or self.role_aware

    @property
    def plan(self) -> Plan:
        if not self.per_window:
            return super().plan
        plain = self._plain.plan
        return WINDOWED if plain == STANDARD else plain

    def pool(self, states: TokenStates) -> Tensor | list[Tensor]:
        if not self.per_window:
            return super().pool(states)
        return self.pool_role(states, "document")

    def pool_role(self, states: TokenStates, role: str) -> Tensor | list[Tensor]:
        if not self.per_window:
            return super().pool_role(states, role)
        if role == "query":
            return [v[None] for v in self._plain.pool_role(states, role)]
        rows = states.hidden.shape[0]
        alone = dataclasses.replace(states, text_index=torch.arange(rows), n_texts=rows, continued=False)
        return states.rows_by_text([v[None] for v in self._plain.pool_role(alone, role)])

    def part(self, states: TokenStates, pooled: list[Tensor], role: str = "document") -> Any:
        if not self.per_window:
            return super().part(states, pooled, role)
        if role == "query":
            return self._plain.part(states, torch.cat(pooled), role)
        return pooled[0]

    def merge(self, parts: list[Any], role: str = "document") -> Tensor:
        if not self.per_window:
            return super().merge(parts, role)
        if role == "query":
            return self._plain.merge(parts, role)[None]
        return torch.cat(parts)

    def n_vectors(self, rows: list[int], role: str) -> int:
        if not self.per_window:
            return super().n_vectors(rows, role)
        return 1 if role == "query" else len(rows)


def per_window_option(cls: type[Pooler]) -> type[Pooler]:
    """Class decorator: ``cls`` (a single-vector pooler) with the ``per_window`` option of
    :class:`PerWindow`. The result is a subclass of ``cls`` under the same name, with
    :class:`PerWindow` ahead of ``cls`` in its method order so that it can call ``cls``'s own
    methods; its instances decide ``multi_vector`` from their options."""
    if cls.multi_vector is not False:
        raise TypeError(f"per_window is an option of single-vector poolers; {cls.__name__} is not one")
    namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__doc__": cls.__doc__,
                 "options": {**cls.options, "per_window": bool}, "multi_vector": None}
    return type(cls.__name__, (PerWindow, cls), namespace)


class LayersOption:
    """Mixin of the weight-free poolers over hidden layers (``layermean``, ``maxpoolbert``): they
    declare ``needs_layers``, and their ``layers`` option (see
    :func:`poolers.states.layer_indices`) is checked when they are built."""

    needs_layers = True
    layers = "all"
    name: ClassVar[str]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        try:
            layer_indices(self.layers, None)
        except InvalidError as e:
            raise InvalidError(f"pooler {self.name!r}: {e}", param="pooler") from None


class WeightedMeanPooler(Pooler):
    """A weighted mean of token states (``mean``, ``landmark``): subclasses give the
    weights. A text's windows in several batches merge into the mean over all of them."""

    def weights(self, states: TokenStates) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def source(self, states: TokenStates) -> Tensor:
        """The token states averaged, ``[R, T, D]``: the last layer (``layermean`` mixes layers)."""
        return states.hidden

    def pool(self, states: TokenStates) -> Tensor:
        w = self.weights(states)
        return rows_to_texts(masked_mean(self.source(states), w), states, w)

    def part(self, states: TokenStates, pooled: Tensor, role: str = "document") -> tuple[Tensor, Tensor]:
        return pooled[0], self.weights(states).to(pooled.dtype).sum()

    def merge(self, parts: list[tuple[Tensor, Tensor]], role: str = "document") -> Tensor:
        total = torch.stack([w for _, w in parts])
        means = torch.stack([m for m, _ in parts])
        return (means * total[:, None]).sum(0) / torch.clamp(total.sum(), min=1e-9)


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
