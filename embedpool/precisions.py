"""The three precisions of embedpool: three settings, each with its own name, defined here once.

* **encoder precision** (:data:`ENCODER_PRECISIONS`; ``--precision``, ``EMBEDPOOL_PRECISION``):
  the path the encoder's forward pass runs on (:data:`ENCODER_PATHS`), or ``auto``, the fastest
  one within the quality bar on this CPU (chosen by :mod:`embedpool.poolers.precision`).
* **storage precision** (:data:`STORAGE_PRECISIONS`; ``--storage-precision``, a collection's
  ``precision``): how a multi-vector collection stores its token vectors
  (:func:`embedpool.index.maxsim.quantize`).
* **output precision** (:data:`OUTPUT_PRECISIONS`; a request's ``precision`` on ``/embed`` and
  ``/v1/embeddings``): how vectors are returned, with the semantics of sentence-transformers'
  ``quantize_embeddings`` (:mod:`embedpool.poolers.quantization`).

Plain names, no torch: the settings and the HTTP schemas (``app/``) read them without loading
the model side, and every layer may import this module (it imports nothing from embedpool).
"""

from __future__ import annotations

#: encoder path -> (library, what it is). Every path is selectable by name.
ENCODER_PATHS: dict[str, tuple[str, str]] = {
    "fp32": ("torch", "transformers forward in float32 (SDPA attention)"),
    "bf16": ("torch", "bf16 CPU autocast (matmuls in bf16, LayerNorm/softmax in fp32)"),
    "bf16-weights": ("torch", "a bf16 copy of the model (everything in bf16)"),
    "openvino-fp32": ("openvino", "OpenVINO CPU plugin, f32 inference precision"),
    "openvino-bf16": ("openvino", "OpenVINO CPU plugin, bf16 inference precision (AMX / AVX-512-BF16)"),
    "openvino-int8": ("openvino", "NNCF post-training static int8 (transformer preset, SmoothQuant; FFN down "
                      "projections in float) on OpenVINO"),
    "openvino-int8-weights": ("openvino", "NNCF int8 weights, activations quantized per group of 32 at run time"),
}
#: older names of encoder paths (the library int8 path replaced the hand-written graph)
ENCODER_ALIASES: dict[str, str] = {"int8": "openvino-int8"}
#: what ``--precision`` accepts: ``auto``, every path, and the aliases
ENCODER_PRECISIONS: tuple[str, ...] = ("auto", *ENCODER_PATHS, *ENCODER_ALIASES)

#: how a multi-vector collection stores its token vectors
STORAGE_PRECISIONS: tuple[str, ...] = ("float32", "float16", "int8")

#: how the HTTP API returns vectors (sentence-transformers' ``quantize_embeddings`` precisions)
OUTPUT_PRECISIONS: tuple[str, ...] = ("float32", "float16", "int8", "uint8", "binary", "ubinary")
