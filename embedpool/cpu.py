"""This CPU: its feature flags and torch's kernel capability, read one way for every layer.

Both layers choose a path for the CPU they run on -- the encoder's precision
(:func:`embedpool.poolers.precision.choose`) and the MaxSim kernel
(:func:`embedpool.index.kernels.choose`) -- and both choices are pure functions of a
:class:`CpuFeatures`, so tests pin every decision by injecting flags. :func:`cpu_features` reads
the real ones: ``/proc/cpuinfo``'s flags, and ``torch.backends.cpu.get_cpu_capability()`` where
torch is already loaded (the encoder loads it) or where the flags cannot be read. torch is never
imported just for this, so the storage side stays free of it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from importlib.util import find_spec
from pathlib import Path

NOT_READ = "not read"  # the capability where torch was not consulted

_SUMMARY_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni",
                  "amx_tile", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class CpuFeatures:
    """What decides a CPU-dependent path: the CPU's flags and torch's kernel capability."""

    flags: frozenset[str]
    capability: str = "unknown"  # torch.backends.cpu.get_cpu_capability(): AVX512, AVX2, DEFAULT, ...

    @classmethod
    def of(cls, flags: Iterable[str], capability: str = "unknown") -> "CpuFeatures":
        return cls(frozenset(flags), capability)

    @property
    def isa(self) -> str:
        """The vector-instruction tier, best first: ``amx``, ``avx512_bf16``, ``avx512_vnni``,
        ``avx512``, ``avx_vnni``, ``avx2`` or ``unknown``."""
        f = self.flags
        if {"amx_bf16", "amx_int8", "amx_tile"} & f and "avx512f" in f:
            return "amx"
        if "avx512_bf16" in f:
            return "avx512_bf16"
        if "avx512_vnni" in f:
            return "avx512_vnni"
        if "avx512f" in f:
            return "avx512"
        if "avx_vnni" in f and "avx2" in f:
            return "avx_vnni"
        if "avx2" in f or self.capability.upper().startswith("AVX2"):
            return "avx2"
        return "unknown"

    def summary(self) -> str:
        found = [k for k in _SUMMARY_FLAGS if k in self.flags]
        return f"isa={self.isa} torch={self.capability} flags={','.join(found) or 'none'}"


def read_cpu_flags(path: str | Path = "/proc/cpuinfo") -> frozenset[str]:
    """The ``flags`` (``Features`` on ARM) of the first CPU in ``/proc/cpuinfo``; empty where
    there is none."""
    try:
        for line in Path(path).read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


@lru_cache(maxsize=1)
def _flags() -> frozenset[str]:
    return read_cpu_flags()


def _torch_capability(load: bool) -> str:
    if "torch" not in sys.modules and not (load and find_spec("torch") is not None):
        return NOT_READ
    try:
        import torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # pragma: no cover - a broken or very old torch
        return "unknown"


def cpu_features() -> CpuFeatures:
    """This CPU's :class:`CpuFeatures` (the flags read once; torch asked where it is loaded, or
    where there are no flags to read)."""
    flags = _flags()
    return CpuFeatures(flags, _torch_capability(load=not flags))
