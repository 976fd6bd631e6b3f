"""The model's own module stack around embedpool's forward pass.

A sentence-transformers folder is a list of modules: the transformer, then (single-vector
models) a ``Pooling`` and the modules after it -- ``Dense``, ``LayerNorm``, ``Normalize``, any
other -- or (ColBERT-family models, PyLate's format) token-level modules -- a ``Dense``
projection per token, the scoring mask (query expansion, document skiplist), ``Normalize``.
embedpool runs the transformer itself (its batching, windows and precision paths) and hands
the token states to **the model's own modules**, loaded and run by sentence-transformers,
instead of writing them again:

- :class:`ModelStack` loads the folder with ``SentenceTransformer`` or, for a ColBERT-family
  model, ``MultiVectorEncoder`` (sentence-transformers >= 6 reads PyLate's saves without
  importing PyLate, which pins an older sentence-transformers), keeps every module, and
  refuses a stack it cannot run exactly (a module between the transformer and its Pooling
  that is not a no-op at inference).
- :meth:`ModelStack.head` runs the modules after ``Pooling`` on pooled vectors ``[B, D]``
  (the head of single-vector poolers, and of ``auto``), then the model's Matryoshka
  ``truncate_dim``.
- :meth:`ModelStack.token_vectors` runs a ColBERT model's token modules on the last hidden
  state: the projected (normalized) token vectors and the mask of the tokens the model scores
  with.
- :func:`special_template` reads the special tokens the model's own tokenizer puts around a
  text (``[CLS] … [SEP]``, ``<s> … </s>``, ``… <|endoftext|>``, ``<s> …``), which windows and
  landmarks reuse instead of assuming BERT's.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from embedpool.errors import InvalidError, NotFoundError

log = logging.getLogger(__name__)

#: config_sentence_transformers.json keys that only a ColBERT-family (PyLate) save has
_COLBERT_KEYS = ("query_prefix", "document_prefix", "attend_to_expansion_tokens", "skiplist_words",
                 "do_query_expansion")
#: modules between the transformer and its Pooling that are the identity at inference
_NOOP_TOKEN_MODULES = ("Dropout",)


def read_model_file(path: str, name: str) -> dict:
    """JSON file ``name`` of the model at ``path`` (a folder, or a Hugging Face id in the local
    cache); ``{}`` when there is none."""
    folder = Path(path)
    file: Path | None = folder / name if folder.is_dir() else None
    if file is None:
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(path, name)
            file = Path(cached) if isinstance(cached, str) else None
        except Exception:  # not a valid repo id
            file = None
    if file is None or not file.is_file():
        return {}
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError):
        return {}


def local_snapshot(path: str) -> str:
    """The local folder of a Hugging Face id already in the cache (its snapshot), so that the
    model loads from files exactly as from a folder the user gave (sentence-transformers reads a
    PyLate save's settings from a folder, not from an id offline); ``path`` itself otherwise."""
    if Path(path).is_dir():
        return path
    try:  # a cache lookup only (no network call exists on this path): the snapshot of config.json
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(path, "config.json")
    except Exception:  # not a valid repo id: the loader says so
        return path
    return str(Path(cached).parent) if isinstance(cached, str) else path


def is_multi_vector(path: str) -> bool:
    """Whether the model at ``path`` is a ColBERT-family (multi-vector) model: a PyLate save, or
    a sentence-transformers ``MultiVectorEncoder``."""
    config = read_model_file(path, "config_sentence_transformers.json")
    if config.get("model_type") in ("ColBERT", "MultiVectorEncoder") or any(k in config for k in _COLBERT_KEYS):
        return True
    modules = read_model_file(path, "modules.json")
    return any("pylate." in str(m.get("type", "")) or "MultiVectorMask" in str(m.get("type", ""))
               for m in (modules if isinstance(modules, list) else []))


#: Held by every load of weights in embedpool (a server loads its models in parallel threads).
#: transformers' ``from_pretrained`` patches classes for the whole process while it loads
#: (``initialization.no_tie_weights`` swaps ``PreTrainedModel.tie_weights`` for a no-op and puts
#: back what it found): two loads that overlap can put the no-op back for good, after which every
#: tied MLM head (SPLADE's decoder) loads with its weights reported missing.
LOADING = threading.RLock()

@dataclass(frozen=True)
class SpecialTemplate:
    """The special tokens the tokenizer puts around one text: ``prefix`` before it, ``suffix``
    after it (ids)."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.prefix) + len(self.suffix)

    @property
    def separator(self) -> int | None:
        """The id a landmark (LMK) inserts after every chunk: the one closing special token,
        ``[SEP]`` / ``</s>`` / an EOS; ``None`` when the template has none."""
        return self.suffix[-1] if self.suffix else None


def special_template(tokenizer) -> SpecialTemplate:
    """The special tokens ``tokenizer`` adds around a single text, read off an encoding."""
    enc = tokenizer("a b", add_special_tokens=True, return_special_tokens_mask=True)
    ids, special = enc["input_ids"], enc["special_tokens_mask"]
    lead = 0
    while lead < len(ids) and special[lead]:
        lead += 1
    trail = 0
    while trail < len(ids) - lead and special[len(ids) - 1 - trail]:
        trail += 1
    return SpecialTemplate(tuple(ids[:lead]), tuple(ids[len(ids) - trail:]))


def is_causal(model) -> bool:
    """A decoder-only (causal attention) transformer: Qwen, Llama, Mistral, GPT-style."""
    config = model.config
    if getattr(config, "is_decoder", False):
        return True
    archs = [a.lower() for a in (getattr(config, "architectures", None) or [])]
    if any(a.endswith("forcausallm") for a in archs):
        return True
    return getattr(config, "model_type", "") in {
        "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "llama", "mistral", "mixtral", "gemma", "gemma2", "gemma3_text",
        "phi", "phi3", "gpt2", "gpt_neox", "gptj", "falcon", "olmo", "olmo2", "stablelm", "starcoder2", "bloom", "opt"}


@dataclass
class ModelStack:
    """A loaded sentence-transformers / PyLate model, as embedpool runs it.

    Attributes:
        model: the ``SentenceTransformer`` or ``MultiVectorEncoder``.
        multi_vector: a ColBERT-family model (token vectors are its output).
        transformer: its first module (``model[0]``): the transformers model, tokenizer, lengths.
        pooling: the ``Pooling`` module of a single-vector model (``None`` for ColBERT models).
        post: the modules after ``Pooling`` (single-vector) -- the head -- but a final
            ``Normalize``, which is the ``normalize`` option of every request (default true).
        token_modules: a ColBERT model's modules after the transformer.
        truncate_dim: Matryoshka truncation of the model's output (``SentenceTransformer(truncate_dim=...)``).
    """

    model: Any
    multi_vector: bool
    transformer: Any
    pooling: Any = None
    post: list = field(default_factory=list)
    token_modules: list = field(default_factory=list)
    truncate_dim: int | None = None
    normalized: bool = False  # the model ends with Normalize (left to the `normalize` option)

    @classmethod
    def load(cls, path: str, device: str = "cpu", truncate_dim: int | None = None) -> "ModelStack":
        from sentence_transformers import MultiVectorEncoder, SentenceTransformer

        path = local_snapshot(path)
        multi = is_multi_vector(path)
        kind = MultiVectorEncoder if multi else SentenceTransformer
        try:
            with LOADING:
                model = kind(path, device=device, local_files_only=True, truncate_dim=truncate_dim)
        except OSError as exc:  # not a folder and not in the local cache
            raise NotFoundError(
                f"model {path!r} is neither a local folder nor in the local Hugging Face cache; "
                "nothing is downloaded at run time", param="model") from exc
        model.eval()
        modules = list(model)
        stack = cls(model, multi, modules[0], truncate_dim=model.truncate_dim)
        if multi:
            stack.token_modules = modules[1:]
            return stack
        pool_at = next((i for i, m in enumerate(modules) if type(m).__name__ == "Pooling"), None)
        if pool_at is None:  # e.g. a SparseEncoder (MLMTransformer + SpladePooling): its pooler is `splade`
            names = ", ".join(type(m).__name__ for m in modules[1:]) or "none"
            log.info("model %s has no Pooling module (after the transformer: %s): embedpool's poolers pool its "
                     "token states (auto: splade for a SPLADE SparseEncoder, else mean)", path, names)
            stack.post = []
            return stack
        between = [type(m).__name__ for m in modules[1:pool_at] if type(m).__name__ not in _NOOP_TOKEN_MODULES]
        if between:
            raise InvalidError(f"model {path!r} has token-level modules between its transformer and Pooling "
                               f"({', '.join(between)}); embedpool runs the transformer's token states through "
                               "the Pooling and the modules after it only", param="model")
        stack.pooling, stack.post = modules[pool_at], modules[pool_at + 1:]
        if stack.post and type(stack.post[-1]).__name__ == "Normalize":
            # a final Normalize is the request's `normalize` (default true, as TEI's): with
            # normalize=false a caller gets the vector before it
            stack.post, stack.normalized = stack.post[:-1], True
        return stack

    # -------------------------------------------------------------------------- single-vector
    @property
    def pooling_modes(self) -> tuple[str, ...]:
        """The model's pooling modes, in the order its Pooling concatenates them."""
        if self.pooling is None:
            return ()
        mode = self.pooling.pooling_mode
        return (mode,) if isinstance(mode, str) else tuple(mode)

    @property
    def include_prompt(self) -> bool:
        return bool(getattr(self.pooling, "include_prompt", True))

    @property
    def head_in_dim(self) -> int | None:
        """The size of the vectors the head takes (the Pooling's output), ``None`` without a Pooling."""
        return int(self.pooling.get_embedding_dimension()) if self.pooling is not None else None

    @property
    def head_out_dim(self) -> int | None:
        """The size of the model's own output vectors (after the head and ``truncate_dim``)."""
        if self.multi_vector:
            return int(self.model.get_embedding_dimension())
        dim = self.head_in_dim
        for m in self.post:
            get = getattr(m, "get_embedding_dimension", None)
            out = get() if get is not None else None
            dim = int(out) if out else dim
        return min(dim, self.truncate_dim) if self.truncate_dim else dim

    @property
    def has_head(self) -> bool:
        """Whether the head changes a pooled vector (modules after Pooling, or a truncation)."""
        return bool(self.post) or self.truncate_dim is not None

    def head(self, x: Tensor) -> Tensor:
        """The model's modules after Pooling on pooled vectors ``x`` (``[B, head_in_dim]``), then
        its ``truncate_dim``: what ``encode()`` makes of the Pooling's output."""
        features = {"sentence_embedding": x}
        with torch.inference_mode():
            for m in self.post:
                features = m(features)
        out = features["sentence_embedding"].float()
        return out[..., : self.truncate_dim] if self.truncate_dim else out

    # -------------------------------------------------------------------------- multi-vector
    @property
    def query_length(self) -> int | None:
        """A ColBERT model's query width (its query expansion pads every query to it)."""
        expansion = getattr(self.transformer, "query_expansion", None)
        if expansion:
            return int(expansion["length"])
        return getattr(self.transformer, "query_length", None)

    @property
    def document_length(self) -> int | None:
        return getattr(self.transformer, "document_length", None)

    @property
    def expansion(self) -> dict | None:
        """A ColBERT model's query expansion (``length``, ``attend``, ``token``), ``None`` without."""
        return getattr(self.transformer, "query_expansion", None) if self.multi_vector else None

    def expansion_id(self, tokenizer) -> int | None:
        """The id that fills a query's expansion positions (``[MASK]``, else EOS, as PyLate)."""
        exp = self.expansion
        if not exp:
            return None
        if exp.get("token") is not None:
            return tokenizer.convert_tokens_to_ids(exp["token"])
        return tokenizer.mask_token_id if tokenizer.mask_token_id is not None else tokenizer.eos_token_id

    def token_vectors(self, hidden: Tensor, attention_mask: Tensor, input_ids: Tensor,
                      expansion: Tensor | None, role: str) -> tuple[Tensor, Tensor]:
        """A ColBERT model's token modules on the last hidden state ``[R, T, H]``: its token
        vectors ``[R, T, D]`` and the mask ``[R, T]`` of the tokens it scores with (the query's
        expansion tokens included, the document's skiplist left out)."""
        features: dict[str, Any] = {"token_embeddings": hidden, "attention_mask": attention_mask,
                                    "input_ids": input_ids}
        if expansion is not None:
            features["query_expansion_positions"] = expansion.bool()
        with torch.inference_mode():
            for m in self.token_modules:
                kwargs = {"task": role} if "task" in getattr(m, "forward_kwargs", ()) else {}
                features = m(features, **kwargs)
        vectors = features["token_embeddings"].float()
        if self.truncate_dim:
            vectors = torch.nn.functional.normalize(vectors[..., : self.truncate_dim], dim=-1)
        return vectors, features["attention_mask"].long()
