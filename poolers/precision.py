"""Encoder precisions ("paths", named in :mod:`embedpool.precisions`), the CPU features they
depend on, and ``auto``: the fastest path that meets the quality bar on the CPU the encoder runs on.

The quality bar (measured by ``bench/encode.py`` and ``bench/eval.py --precision``): min cosine to
fp32 ≥ 0.995 on the encode benchmark's texts and SciFact test nDCG@10 within 0.3 points of fp32.
:func:`choose` is pure (CPU features in, path and reason out), so tests pin every decision by
injecting flags; :func:`embedpool.cpu.cpu_features` reads the real ones (``/proc/cpuinfo`` flags and
``torch.backends.cpu.get_cpu_capability()``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from embedpool.cpu import CpuFeatures, cpu_features
from embedpool.errors import InvalidError
from embedpool.precisions import ENCODER_ALIASES, ENCODER_PATHS, ENCODER_PRECISIONS

log = logging.getLogger(__name__)


def library_available(library: str) -> bool:
    from importlib.util import find_spec

    if library == "openvino":
        return find_spec("openvino") is not None and find_spec("nncf") is not None
    return find_spec(library) is not None


# The decision, per ISA tier: candidates fastest first, each with the rule behind it (the
# measurements that set these rules: bench/encode.py and bench/serve.py, docs/ on encoding).
# The first whose library is installed wins.
_DECISIONS: dict[str, list[tuple[str, str]]] = {
    "amx": [("openvino-bf16", "AMX bf16 tiles: OpenVINO bf16 (as fast as torch bf16 weights in-process, faster "
             "in a server: its forward releases the GIL throughout); static int8 misses the quality bar"),
            ("bf16-weights", "AMX bf16 tiles, no OpenVINO: torch with bf16 weights"),
            ("fp32", "AMX, torch only: fp32")],
    "avx512_bf16": [("openvino-bf16", "AVX-512-BF16: OpenVINO bf16 (the AMX choice: the same bf16 kernels "
                     "without tiles)"),
                    ("bf16-weights", "AVX-512-BF16, no OpenVINO: torch with bf16 weights")],
    "avx512_vnni": [("fp32", "AVX-512 VNNI without bf16: static int8 misses the quality bar, and int8 weights "
                     "or OpenVINO f32 are not faster than torch fp32 on AVX-512")],
    "avx512": [("fp32", "AVX-512 without VNNI/BF16: torch fp32 (OpenVINO f32 is not faster on AVX-512)")],
    "avx_vnni": [("openvino-fp32", "AVX-VNNI (256-bit) without bf16: static int8 misses the quality bar; "
                  "OpenVINO's fused f32 kernels"),
                 ("fp32", "AVX-VNNI without bf16, no OpenVINO: fp32")],
    "avx2": [("openvino-fp32", "AVX2 only: no bf16 hardware (emulated bf16 is slow) and static int8 misses "
              "the quality bar; OpenVINO's fused f32 kernels"),
             ("fp32", "AVX2 only, no OpenVINO: fp32 (bf16 is emulated, int8 loses accuracy)")],
    "unknown": [("fp32", "unknown CPU features: fp32, the path that is exact everywhere")],
}


def choose(features: CpuFeatures, available: Iterable[str] | None = None) -> tuple[str, str]:
    """``(path, reason)`` for ``precision=auto`` on a CPU with ``features``.

    Args:
        features: the CPU's flags and torch capability (inject them in tests).
        available: libraries installed (``torch``, ``openvino``); default: all.
    """
    libs = set(available) if available is not None else {"torch", "openvino"}
    libs.add("torch")
    for path, why in _DECISIONS[features.isa]:
        if ENCODER_PATHS[path][0] in libs:
            return path, f"{why} [{features.summary()}]"
    return "fp32", f"fallback [{features.summary()}]"  # pragma: no cover - torch is always there


def resolve(precision: str, features: CpuFeatures | None = None) -> tuple[str, str]:
    """The concrete path for a requested precision, with the reason it was chosen."""
    if precision not in ENCODER_PRECISIONS:
        raise InvalidError(f"precision must be one of {', '.join(ENCODER_PRECISIONS)}, got {precision!r}", param="precision")
    if precision == "auto":
        feats = features or cpu_features()
        libs = [lib for lib in ("openvino",) if library_available(lib)]
        return choose(feats, libs)
    if precision in ENCODER_ALIASES:
        return ENCODER_ALIASES[precision], f"{precision} is {ENCODER_ALIASES[precision]}"
    return precision, "asked for by name"


def load_forward(path: str, model, tokenizer, max_length: int = 256, calibration=None, cache_dir=None,
                 packing: bool = True):
    """The forward callable of ``path`` for a loaded transformers ``model`` (see
    :mod:`poolers.runtimes`); ``fp32`` and ``bf16`` (autocast, applied by the encoder) are the
    model itself. ``packing=False``: the caller never packs rows (no 4D-mask graph is built)."""
    from embedpool.poolers import runtimes

    if path not in ENCODER_PATHS:
        raise InvalidError(f"unknown precision path {path!r}; use one of {', '.join(ENCODER_PATHS)}", param="precision")
    if path in ("fp32", "bf16"):
        return model
    if path == "bf16-weights":
        return runtimes.bf16_weights(model)
    isa = cpu_features().isa
    mode = path.removeprefix("openvino-")
    return runtimes.load_openvino(model, tokenizer, mode, isa, calibration, max_length, cache_dir=cache_dir,
                                  packing=packing)


def openvino_unsafe(model, max_length: int) -> str | None:
    """Why the OpenVINO graph of ``model`` gives wrong states, or ``None``. ModernBERT's local
    (sliding-window) attention layers, converted, turn a padding position whose window holds
    no real token into NaN (softmax over keys that are all masked); the next layers multiply
    those NaN values by zero attention weights, and every vector of that text becomes NaN.
    Any batch with a text shorter than another by more than half the local window has such
    positions (bench/families.py: 24 of 128 SciFact documents NaN on openvino-bf16 and -fp32).
    transformers' torch paths keep those rows finite."""
    local = getattr(model.config, "local_attention", None)
    if isinstance(local, int) and local // 2 < max_length:
        return (f"its local attention window ({local} tokens, {type(model).__name__}) turns padded "
                "positions into NaN in the converted OpenVINO graph")
    return None


def build_path(precision: str, model, tokenizer, max_length: int, calibration=None, *, cpu: bool = True,
               packing: bool = True):
    """``(forward, path, reason)`` for a loaded transformers ``model``: ``precision`` resolved
    (``auto``: from this CPU's features; not a CPU: fp32) and its forward built
    (:func:`load_forward`). Under ``auto``, a path that cannot run the model
    (:func:`openvino_unsafe`) or fails to build (an architecture a converter does not handle)
    falls back to fp32 with the reason logged; a path asked for by name raises instead."""
    path, reason = resolve(precision) if cpu else ("fp32", "not a CPU device")
    unsafe = openvino_unsafe(model, max_length) if path.startswith("openvino") else None
    if unsafe and precision != "auto":
        raise InvalidError(f"precision {path} cannot run this model: {unsafe}; use fp32, bf16 or auto",
                           param="precision")
    if unsafe:
        log.warning("precision path %s not used: %s; using fp32", path, unsafe)
        path, reason = "fp32", f"fp32: {path} not used: {unsafe}"
    try:
        forward = load_forward(path, model, tokenizer, max_length, calibration, packing=packing)
    except Exception as exc:
        if precision != "auto" or path == "fp32":
            raise
        log.warning("precision path %s failed to build (%s); using fp32", path, exc)
        path, reason = "fp32", f"{path} failed to build: {exc}"
        forward = model
    return forward, path, reason
