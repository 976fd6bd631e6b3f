"""The model side of embedpool: the frozen encoder, tokenization plans and token poolers."""

from embedpool.poolers import attention, cls, cluster, landmark, max, mean, tokens  # noqa: F401  (register)
from embedpool.poolers.base import REGISTRY, Pooler, PoolerSpecError, build_pooler, parse_spec
from embedpool.poolers.encoder import DEFAULT_MODEL, FrozenEncoder, Plan
from embedpool.poolers.pipeline import Embedder, EmbedResult
from embedpool.poolers.states import TokenStates

__all__ = [
    "DEFAULT_MODEL", "REGISTRY", "Embedder", "EmbedResult", "FrozenEncoder", "Plan", "Pooler",
    "PoolerSpecError", "TokenStates", "build_pooler", "parse_spec",
]
