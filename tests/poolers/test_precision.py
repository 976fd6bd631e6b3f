"""``precision=auto`` and the encoder paths (poolers/precision.py, poolers/runtimes.py).

The decision is pinned per ISA by injecting CPU flags; every path this machine can run is run on
real texts and compared with fp32 (cosine); built graphs are cached and reused.
"""

from __future__ import annotations

import pytest

from embedpool.cpu import CpuFeatures, cpu_features
from embedpool.poolers.precision import choose, library_available, resolve
from embedpool.precisions import ENCODER_ALIASES, ENCODER_PATHS, ENCODER_PRECISIONS

AVX2 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx avx2 fma f16c bmi2".split()
AVX512 = AVX2 + "avx512f avx512dq avx512cd avx512bw avx512vl".split()
VNNI = AVX512 + ["avx512_vnni"]
BF16 = VNNI + ["avx512_bf16"]
AMX = BF16 + "avx512_fp16 amx_tile amx_bf16 amx_int8 avx_vnni".split()
ALDER = AVX2 + ["avx_vnni"]

BAR = 0.995  # min cosine to fp32 for any path auto may choose (issue 16's quality bar)


@pytest.mark.parametrize("flags, capability, isa, path", [
    (AVX2, "AVX2", "avx2", "openvino-fp32"),
    (ALDER, "AVX2", "avx_vnni", "openvino-fp32"),
    (AVX512, "AVX512", "avx512", "fp32"),
    (VNNI, "AVX512", "avx512_vnni", "fp32"),
    (BF16, "AVX512", "avx512_bf16", "openvino-bf16"),
    (AMX, "AVX512", "amx", "openvino-bf16"),
    ([], "DEFAULT", "unknown", "fp32"),
    (["neon", "asimd"], "DEFAULT", "unknown", "fp32"),
])
def test_auto_decision_per_isa(flags, capability, isa, path):
    feats = CpuFeatures.of(flags, capability)
    assert feats.isa == isa
    chosen, reason = choose(feats)
    assert chosen == path
    assert f"isa={isa}" in reason and f"torch={capability}" in reason and len(reason) > 40


@pytest.mark.parametrize("flags, path", [(AVX2, "fp32"), (VNNI, "fp32"), (BF16, "bf16-weights"),
                                         (AMX, "bf16-weights")])
def test_auto_without_openvino_uses_torch(flags, path):
    assert choose(CpuFeatures.of(flags, "AVX512"), available=[])[0] == path


def test_torch_capability_alone_marks_avx2():
    assert CpuFeatures.of([], "AVX2").isa == "avx2"


def test_resolve_names_and_errors():
    assert resolve("fp32") == ("fp32", "asked for by name")
    assert resolve("int8")[0] == ENCODER_ALIASES["int8"]
    path, reason = resolve("auto", CpuFeatures.of(AVX2, "AVX2"))
    assert path in ENCODER_PATHS and "avx2" in reason
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve("fp8")


def test_each_precision_is_named_once_and_settings_read_it_without_torch():
    """The encoder, storage and output precisions are three settings defined in one torch-free
    module (embedpool/precisions.py): the settings, the CLI and the HTTP schemas accept exactly
    those names, and reading the settings loads no torch."""
    import subprocess
    import sys
    import typing

    from embedpool.app.server import schemas
    from embedpool.app.settings import Settings
    from embedpool.precisions import OUTPUT_PRECISIONS, STORAGE_PRECISIONS

    assert ENCODER_PRECISIONS == ("auto", "fp32", "bf16", "bf16-weights", "openvino-fp32", "openvino-bf16",
                                  "openvino-int8", "openvino-int8-weights", "int8")
    assert STORAGE_PRECISIONS == ("float32", "float16", "int8")
    assert OUTPUT_PRECISIONS == ("float32", "float16", "int8", "uint8", "binary", "ubinary")
    assert typing.get_args(Settings.model_fields["precision"].annotation) == ENCODER_PRECISIONS
    assert Settings().precision == "auto"
    assert typing.get_args(schemas.OutputPrecision) == OUTPUT_PRECISIONS
    assert typing.get_args(schemas.CollectionCreate.model_fields["precision"].annotation) == STORAGE_PRECISIONS
    code = "import sys, embedpool.app.settings as s; s.Settings(); print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


# ---------------------------------------------------------------------------- real paths
TEXTS = [
    "", "ok", "What is the capital of France?", "A man is playing a guitar.",
    "how do i reset my password without access to my email",
    "Ünïcödé text with émojis 🙂 and symbols ±√∞ → ©", "東京は日本の首都であり、世界有数の大都市です。",
    "BRCA1 mutations increase the lifetime risk of breast and ovarian cancer.",
    "Vitamin D supplementation did not reduce the incidence of invasive cancer or cardiovascular "
    "events in a randomized trial of 25,871 adults followed for a median of 5.3 years.",
    "Mitochondrial dysfunction is a hallmark of aging; " * 30,  # over the 256-token window
    "The results were statistically significant (p < 0.001, n = 1,204).",
    "Two dogs run through a snowy field.",
]


def _runnable(path: str) -> bool:
    """This machine runs ``path`` natively: bf16 paths need bf16 hardware (emulated bf16 is very
    slow). OpenVINO, NNCF and ONNX Runtime are dependencies: a missing one fails, not skips."""
    return "bf16" not in path or cpu_features().isa in ("amx", "avx512_bf16")


# every path but fp32 (the reference) that this CPU runs, decided at collection: no silent skips
RUNNABLE = [p for p in ENCODER_PATHS if p != "fp32" and _runnable(p)]


def test_the_runnable_paths_are_every_library_path_and_bf16_where_the_cpu_has_it():
    bf16_hw = cpu_features().isa in ("amx", "avx512_bf16")
    assert set(RUNNABLE) == {p for p in ENCODER_PATHS if p != "fp32" and ("bf16" not in p or bf16_hw)}
    assert all(library_available(ENCODER_PATHS[p][0]) for p in RUNNABLE if ENCODER_PATHS[p][0] != "torch")


# Paths auto never picks get a looser floor: they are measured, not recommended.
_FLOOR = {"openvino-int8": 0.97}


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("runtime-cache")


@pytest.fixture(scope="module")
def fp32_mean(embedder):
    return embedder.embed(TEXTS, ["mean"]).matrix("mean")


@pytest.mark.parametrize("path", RUNNABLE)
def test_every_runnable_path_is_close_to_fp32(path, encoder, fp32_mean, cache_dir, monkeypatch):
    from embedpool.poolers import Embedder
    from embedpool.poolers.precision import load_forward

    monkeypatch.setenv("EMBEDPOOL_CACHE_DIR", str(cache_dir))
    fwd = load_forward(path, encoder.model, encoder.tokenizer, encoder.max_length)
    twin = _encoder_with(encoder, path, fwd)
    got = Embedder(twin).embed(TEXTS, ["mean"]).matrix("mean")
    cos = (got * fp32_mean).sum(1)
    floor = _FLOOR.get(path, BAR)
    assert got.shape == fp32_mean.shape and cos.min() >= floor, f"{path}: min cosine {cos.min():.4f}"
    # a text's vector does not depend on its batch mates beyond float rounding
    alone = Embedder(twin).embed([TEXTS[3]], ["mean"]).matrix("mean")[0]
    assert float(alone @ got[3]) > 0.999


def _encoder_with(encoder, path, forward):
    """A shallow twin of the session's fp32 encoder running ``forward`` (no second model load)."""
    import copy

    twin = copy.copy(encoder)
    twin.stats = type(encoder.stats)()
    twin._forward_fn, twin.precision, twin.precision_reason = forward, path, "test"
    return twin


def test_auto_encoder_reports_its_choice(cache_dir, monkeypatch, caplog):
    from embedpool.poolers import FrozenEncoder

    monkeypatch.setenv("EMBEDPOOL_CACHE_DIR", str(cache_dir))
    with caplog.at_level("INFO", logger="embedpool.poolers.encoder"):
        enc = FrozenEncoder(precision="auto")
    expected, reason = resolve("auto")
    assert enc.requested_precision == "auto" and enc.precision == expected and enc.precision_reason == reason
    assert any(f"encoder precision {expected}" in r.getMessage() for r in caplog.records)


def test_auto_falls_back_to_fp32_when_a_path_cannot_build(monkeypatch):
    """An architecture a converter cannot handle must not stop the server under auto."""
    from embedpool.poolers import FrozenEncoder, precision

    def broken(path, *a, **k):
        if path != "fp32":
            raise RuntimeError("converter does not support this model")
        return a[0]

    monkeypatch.setattr(precision, "resolve", lambda p, f=None: ("openvino-bf16", "test"))
    monkeypatch.setattr(precision, "load_forward", broken)
    enc = FrozenEncoder(precision="auto")
    assert enc.precision == "fp32" and "failed to build" in enc.precision_reason
    with pytest.raises(RuntimeError, match="converter"):
        FrozenEncoder(precision="openvino-bf16")


def test_graphs_are_cached_by_model_path_version_and_isa(encoder, tmp_path):
    from embedpool.poolers import runtimes

    fwd = runtimes.load_openvino(encoder.model, encoder.tokenizer, "fp32", "avx2", cache_dir=tmp_path)
    folder = fwd.path.parent
    mtime = fwd.path.stat().st_mtime_ns
    again = runtimes.load_openvino(encoder.model, encoder.tokenizer, "fp32", "avx2", cache_dir=tmp_path)
    assert again.path == fwd.path and fwd.path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    other = runtimes.artifact_dir(encoder.model, "openvino", runtimes.openvino_version(), "amx", cache_dir=tmp_path)
    assert other != folder and folder.parent == tmp_path / "runtimes"
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".tmp")]


def test_collection_records_the_encoder_path_without_refusing_others(tmp_path):
    """A manifest records the path its vectors were made with; fp32 and a path within the bar
    make compatible vectors, so re-opening with another path is not a conflict."""
    from embedpool.index import CollectionSpec, open_collection

    spec = CollectionSpec(kind="single", model="m", pooler="mean", dim=8, encoder_precision="openvino-bf16")
    open_collection(tmp_path, "c", spec)
    again = open_collection(tmp_path, "c", CollectionSpec(**{**spec.to_dict(), "encoder_precision": "fp32"}))
    assert CollectionSpec.from_dict(again.manifest).encoder_precision == "openvino-bf16"
    assert spec.differences(CollectionSpec(**{**spec.to_dict(), "encoder_precision": "fp32"})) == []
