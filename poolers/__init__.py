"""The model side of embedpool: the frozen encoder, tokenization plans and token poolers."""

from embedpool.poolers import (  # noqa: F401  (register)
    attention, attnstats, cls, cluster, fde, gem, generalized, glot, landmark, layermean, max, maxpoolbert, mean,
    multilayer, pooling, reinpool, simpool, softpool, splade, tokens,
)
from embedpool.poolers.base import Pooler, REGISTRY, build_pooler, parse_spec
from embedpool.poolers.crossencoder import CrossEncoderModel, is_cross_encoder
from embedpool.poolers.encoder import DEFAULT_MODEL, TRUNCATION_DIRECTIONS, FrozenEncoder, Plan, Window
from embedpool.poolers.quantization import quantize_output, unit_ranges
from embedpool.poolers.pipeline import EmbedOptions, Embedder, EmbedResult, Tokenized, Workload
from embedpool.poolers.splade import sparse_entries
from embedpool.poolers.states import TokenStates

__all__ = [
    "DEFAULT_MODEL", "REGISTRY", "CrossEncoderModel", "EmbedOptions", "Embedder", "EmbedResult", "FrozenEncoder",
    "Plan", "Pooler", "TokenStates", "build_pooler", "is_cross_encoder", "parse_spec", "sparse_entries",
    "TRUNCATION_DIRECTIONS", "Tokenized", "Window", "Workload", "quantize_output",
    "unit_ranges",
]
