"""This CPU's features (embedpool/cpu.py): the one reading both layers' CPU-dependent choices use."""

from __future__ import annotations

import subprocess
import sys

from embedpool.cpu import NOT_READ, CpuFeatures, cpu_features, read_cpu_flags


def test_read_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: fpu avx2 avx512f amx_int8\n"
                    "\nprocessor\t: 1\nflags\t\t: fpu avx2\n")
    assert read_cpu_flags(info) == frozenset({"fpu", "avx2", "avx512f", "amx_int8"})
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd asimddp\n")
    assert read_cpu_flags(arm) == frozenset({"fp", "asimd", "asimddp"})
    assert read_cpu_flags(tmp_path / "missing") == frozenset()


def test_this_machine_features_match_cpuinfo_and_torch():
    import torch

    feats = cpu_features()
    assert feats.flags == read_cpu_flags()
    assert feats.capability == torch.backends.cpu.get_cpu_capability()


def test_torch_is_not_imported_to_read_the_flags():
    """The storage side reads the CPU without loading torch (when /proc/cpuinfo has flags)."""
    code = ("import sys; from embedpool.cpu import cpu_features; f = cpu_features(); "
            "print(bool(f.flags), f.capability, 'torch' in sys.modules, sep='|')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip().split("|")
    if out[0] == "True":
        assert out[1:] == [NOT_READ, "False"]
    else:  # no flags to read: torch's capability is what there is
        assert out[1] != NOT_READ


def test_isa_tiers():
    assert CpuFeatures.of("avx2 avx512f amx_tile".split()).isa == "amx"
    assert CpuFeatures.of(["avx2", "avx_vnni"]).isa == "avx_vnni"
    assert CpuFeatures.of([], "AVX2").isa == "avx2"
    assert CpuFeatures.of([], "DEFAULT").isa == "unknown"
    assert CpuFeatures.of(["avx2"], "AVX2").summary() == "isa=avx2 torch=AVX2 flags=avx2"
