"""Encoder forward paths from libraries: torch (fp32, bf16 autocast, bf16 weights) and OpenVINO
(fp32, bf16, NNCF post-training int8). (ONNX Runtime's own quantizers, which the encoding
benchmark compares against, live in ``bench/onnx_paths.py``: no setting reaches them.)

Every path is a callable with the transformers forward's keywords (``input_ids``,
``attention_mask``, ``token_type_ids``, ``output_hidden_states``; torch ``[B, T]`` tensors) that
returns an object with ``last_hidden_state`` (``[B, T, D]``, float32 torch tensor) and, when
``output_hidden_states`` is asked for, ``hidden_states`` (every layer's ``[B, T, D]``, the
embeddings first and ``last_hidden_state`` last, as transformers gives them), so
:class:`FrozenEncoder` runs them all the same way. For models where :func:`packable` holds, every
path also takes transformers' 4D boolean ``attention_mask`` (``[B, 1, T, T]``, True = may attend)
and ``position_ids``: what lets several short rows share one forward row (the encoder's packing);
OpenVINO converts such a model twice, a graph with the plain 2D mask for unpacked batches and one
with the 4D mask for packed ones (the 4D one costs ~17% more per single-row forward: a lone query
must not pay for packing). The OpenVINO graphs carry every hidden layer
as an output of the one converted model; the last-layer-only view compiled from it is what
runs when no layer is asked for. Graphs are converted from the already loaded transformers model (nothing is
downloaded) and cached on disk under ``$EMBEDPOOL_CACHE_DIR`` (default ``~/.cache/embedpool``),
keyed by the model's weights, the path, the library's version and the CPU's instruction set
(:func:`artifact_dir`). Static quantization calibrates on texts the caller passes (e.g. a slice
of the user's corpus) or on the built-in :data:`CALIBRATION_TEXTS`.

Why these and not one hand-written graph: OpenVINO's CPU plugin runs int8 GEMMs on AMX/VNNI and
bf16 on AMX/AVX-512-BF16 with fused attention, and NNCF quantizes with SmoothQuant and
transformer-aware ignored patterns. ``bench/encode.py`` measures each against fp32 and
sentence-transformers.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from embedpool.errors import InvalidError

log = logging.getLogger(__name__)

# A handful of varied built-in texts: the default calibration set for static quantization (no
# data set is read or downloaded). A caller with its own corpus passes a slice of it instead.
CALIBRATION_TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on the stage while the crowd sings along.",
    "Two dogs are running through a field of tall grass.",
    "What is the capital of France?",
    "how do i reset my password if i no longer have access to my email",
    "Stock markets fell sharply on Tuesday after the central bank raised interest rates by half a point.",
    "The patient presented with acute chest pain, elevated troponin levels and ST-segment elevation.",
    "Mitochondrial DNA mutations accumulate with age and are associated with decreased respiratory "
    "chain function in skeletal muscle fibres of elderly subjects.",
    "We report a randomized, double-blind, placebo-controlled trial of 1,204 adults with type 2 "
    "diabetes; the primary endpoint (HbA1c at 24 weeks) improved by 0.8% (95% CI 0.6-1.0, p<0.001).",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Les enfants jouent dans le parc pendant que leurs parents discutent.",
    "Der Zug nach Berlin hat heute zwanzig Minuten Verspätung.",
    "東京は日本の首都です。",
    "Ünïcödé, émojis 🙂 and symbols: ±√∞ ≤ ≥ → ©",
    "",
    "ok",
    "In 1905 Einstein published four papers that changed physics: on the photoelectric effect, "
    "Brownian motion, special relativity and the equivalence of mass and energy. Each of them "
    "would have been enough to make his reputation, and together they laid the foundations of "
    "quantum theory and of modern cosmology. The photoelectric paper, which proposed that light "
    "comes in discrete quanta, earned him the Nobel Prize in 1921, while special relativity "
    "replaced Newton's absolute space and time with a single space-time whose geometry depends "
    "on the observer's motion. Historians still debate how a patent clerk in Bern, working "
    "largely alone, produced such a body of work in a single year, and the correspondence that "
    "survives suggests long walks and conversations with a few close friends.",
    "Gene expression profiling of breast tumours identified five subtypes with distinct clinical "
    "outcomes, and the basal-like subtype was associated with BRCA1 mutations and poor survival.",
    "Vitamin D supplementation did not reduce the incidence of invasive cancer or cardiovascular "
    "events in a randomized trial of 25,871 adults followed for a median of 5.3 years.",
    "A woman is slicing an onion.",
    "The cat sat on the mat and looked out of the window at the rain.",
    "Amyloid-beta plaques and tau tangles are the pathological hallmarks of Alzheimer's disease; "
    "their relation to cognitive decline remains debated.",
    "Please send the invoice to the accounting department by Friday.",
)


@dataclass
class Output:
    last_hidden_state: torch.Tensor
    hidden_states: tuple[torch.Tensor, ...] | None = None
    # ``hidden_states`` already stacked ``[L+1, B, T, D]`` (float32) when a path writes them so
    # (OpenVINO): the encoder then uses it as is instead of stacking a copy
    stacked: torch.Tensor | None = None


Forward = Callable[..., Output]


# ---------------------------------------------------------------------------- cache
def cache_root() -> Path:
    env = os.environ.get("EMBEDPOOL_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "embedpool"


def weights_hash(model) -> str:
    """Hash of the model's config and weights (the part of the cache key that is the model)."""
    h = hashlib.sha256()
    h.update(json.dumps(model.config.to_dict(), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def artifact_dir(model, path: str, library_version: str, isa: str, extra: str = "",
                 cache_dir: str | Path | None = None) -> Path:
    """Cache folder of one built graph: model weights × path × library version × ISA (× an
    optional ``extra`` such as the calibration set's hash)."""
    key = hashlib.sha256(f"{weights_hash(model)}|{path}|{library_version}|{isa}|{extra}".encode()).hexdigest()[:20]
    base = Path(cache_dir).expanduser() if cache_dir else cache_root()
    return base / "runtimes" / f"{path}-{key}"


def build_once(folder: Path, filename: str, build: Callable[[Path], None]) -> Path:
    """``folder/filename`` built by ``build(tmp_folder)`` unless cached; atomic (concurrent
    builders each write a whole folder, the first rename wins)."""
    target = folder / filename
    if target.exists():
        return target
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=folder.name + ".", suffix=".tmp", dir=folder.parent))
    try:
        build(tmp)
        try:
            os.replace(tmp, folder)
        except OSError:  # another process built it meanwhile
            if not target.exists():
                raise
        log.info("built %s", target)
    finally:
        if tmp.exists():
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return target


def calibration_hash(texts: Sequence[str]) -> str:
    return hashlib.sha256("\x00".join(texts).encode()).hexdigest()[:12]


# ---------------------------------------------------------------------------- torch
def has_token_types(tokenizer) -> bool:
    return "token_type_ids" in tokenizer.model_input_names


def packable(model) -> bool:
    """Whether several rows may share one forward row of ``model``: a BERT encoder with absolute
    positions (its ``position_ids`` count from 0 in each row, and transformers takes a 4D mask
    as given), so a block-diagonal 4D mask and positions that restart per row give every row the
    states it has alone. Other architectures (RoBERTa's positions start after the padding index,
    ModernBERT unpads itself, decoders add a causal mask) are not packed."""
    cfg = getattr(model, "config", None)
    return (getattr(cfg, "model_type", None) == "bert" and not getattr(cfg, "is_decoder", False)
            and getattr(cfg, "position_embedding_type", "absolute") == "absolute")


def key_mask_4d(attention_mask: torch.Tensor) -> torch.Tensor:
    """transformers' 2D key mask ``[B, T]`` as the 4D boolean mask ``[B, 1, T, T]`` it stands for."""
    keys = attention_mask.bool()[:, None, None, :]
    return keys.expand(-1, 1, attention_mask.shape[1], -1)


class TorchForward:
    """The transformers model itself, optionally under bf16 autocast."""

    mask_4d = True  # passes a 4D mask and positions through to the model (see packable)

    def __init__(self, model, autocast_bf16: bool = False) -> None:
        self.model = model
        self.autocast_bf16 = autocast_bf16

    def __call__(self, input_ids, attention_mask, token_type_ids=None, output_hidden_states=False,
                 position_ids=None, **_):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if self.autocast_bf16 else torch.autocast("cpu", enabled=False)
        with torch.inference_mode(), ctx:
            out = self.model(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                             position_ids=position_ids, output_hidden_states=output_hidden_states)
        last = out.last_hidden_state.float()
        if not output_hidden_states:
            return Output(last)
        return Output(last, (*(h.float() for h in out.hidden_states[:-1]), last))


def bf16_weights(model) -> TorchForward:
    """A copy of the model with bf16 weights (half the bytes streamed per forward; LayerNorm
    and softmax run in bf16 too, unlike autocast)."""
    twin = copy.deepcopy(model).to(torch.bfloat16).eval()
    return TorchForward(twin)


# ---------------------------------------------------------------------------- export helpers
class LastHidden(torch.nn.Module):
    def __init__(self, model, token_types: bool) -> None:
        super().__init__()
        self.model = model
        self.token_types = token_types

    def forward(self, input_ids, attention_mask, token_type_ids=None):
        kw = {"token_type_ids": token_type_ids} if self.token_types else {}
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kw).last_hidden_state


class _AllHidden(LastHidden):
    """The graph OpenVINO converts: ``last_hidden_state`` first (output 0, what the last-layer
    view keeps), then the embeddings and every layer but the last."""

    def forward(self, input_ids, attention_mask, token_type_ids=None, position_ids=None):
        kw = {"token_type_ids": token_type_ids} if self.token_types else {}
        if position_ids is not None:
            kw["position_ids"] = position_ids
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kw)
        return (out.last_hidden_state, *out.hidden_states[:-1])


def graph_inputs(token_types: bool, packed: bool) -> list[str]:
    """The converted graph's inputs, in :class:`_AllHidden`'s order (a packed graph's
    ``attention_mask`` is the 4D boolean mask, and it takes ``position_ids``)."""
    return ["input_ids", "attention_mask"] + (["token_type_ids"] if token_types else []) + (["position_ids"] if packed else [])


def graph_feed(enc, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """A tokenizer's padded batch as the graph's inputs ``names`` (for a packed graph, the 4D
    mask of its 2D one and positions counting from 0 in every row)."""
    feed = {n: torch.as_tensor(np.asarray(enc[n], dtype=np.int64)) for n in names if n in enc}
    if "position_ids" in names:
        ids = feed["input_ids"]
        feed["position_ids"] = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
        feed["attention_mask"] = key_mask_4d(feed["attention_mask"]).contiguous()
    return feed


def example_inputs(tokenizer, token_types: bool, packed: bool = False) -> dict[str, torch.Tensor]:
    enc = tokenizer(["an example input", "a second, somewhat longer example input"], padding=True,
                    return_tensors="np")
    return graph_feed(enc, graph_inputs(token_types, packed))


def calibration_batches(tokenizer, texts: Sequence[str], token_types: bool, max_length: int,
                         batch: int = 1, packed: bool = False) -> list[dict[str, np.ndarray]]:
    """One feed per text (unpadded, like the fast path sees sorted batches)."""
    names = graph_inputs(token_types, packed)
    out = []
    texts = list(texts) or list(CALIBRATION_TEXTS)
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], padding=True, truncation=True, max_length=max_length,
                        return_tensors="np")
        out.append({n: t.numpy() for n, t in graph_feed(enc, names).items()})
    return out


# ---------------------------------------------------------------------------- OpenVINO
OPENVINO_MODES = ("fp32", "bf16", "int8", "int8-weights")
# int8: NNCF static quantization, except the FFN down projections (GELU outputs, long-tailed):
# quantized, they cost most of the accuracy (bench/encode.py), so they stay in float. int8-weights: int8 weights only; the CPU plugin
# quantizes activations per group of 32 at run time (dynamic, no calibration).


def openvino_version() -> str:
    import openvino as ov

    return ov.get_version()


#: torch's tracer is not thread-safe: two models converted at once (a server loads its models in
#: parallel threads) trace each other's modules ("Graphs differed across invocations")
_CONVERT_LOCK = threading.Lock()


def _ov_convert(model, tokenizer, folder: Path, mode: str, calibration: Sequence[str], max_length: int,
                packed: bool = False) -> None:
    """Convert (and for int8 modes quantize) the model's graph into ``folder``; ``packed``: the
    graph takes the 4D boolean mask and ``position_ids`` (:func:`graph_inputs`). One conversion
    at a time (:data:`_CONVERT_LOCK`)."""
    with _CONVERT_LOCK:
        _ov_convert_locked(model, tokenizer, folder, mode, calibration, max_length, packed)


def _ov_convert_locked(model, tokenizer, folder: Path, mode: str, calibration: Sequence[str], max_length: int,
                       packed: bool) -> None:
    import openvino as ov

    tt = has_token_types(tokenizer)
    wrapped = _AllHidden(model, tt).eval()
    names = graph_inputs(tt, packed)
    shapes = {n: (ov.PartialShape([-1, -1]), ov.Type.i64) for n in names}
    if packed:  # the 4D boolean mask [B, 1, T, T]
        shapes["attention_mask"] = (ov.PartialShape([-1, 1, -1, -1]), ov.Type.boolean)
    with torch.inference_mode():
        ov_model = ov.convert_model(wrapped, example_input=example_inputs(tokenizer, tt, packed),
                                    input=[(n, *shapes[n]) for n in names])
    for inp, n in zip(ov_model.inputs, names):
        inp.get_tensor().set_names({n})
    if mode == "int8":
        import nncf

        feeds = calibration_batches(tokenizer, calibration, tt, max_length, packed=packed)
        ffn_out = [op.get_friendly_name() for op in ov_model.get_ops() if op.get_type_name() == "MatMul"
                   and ".output.dense" in op.get_friendly_name() and "attention" not in op.get_friendly_name()]
        ov_model = nncf.quantize(ov_model, nncf.Dataset(feeds), model_type=nncf.ModelType.TRANSFORMER,
                                 subset_size=len(feeds), ignored_scope=nncf.IgnoredScope(names=ffn_out))
    elif mode == "int8-weights":
        import nncf

        # int8 weights; the CPU plugin quantizes activations per group of 32 at run time
        ov_model = nncf.compress_weights(ov_model, mode=nncf.CompressWeightsMode.INT8_SYM)
    ov.save_model(ov_model, str(folder / "model.xml"), compress_to_fp16=False)


class OpenVINOForward:
    """An OpenVINO CPU compiled model (latency hint, the given threads).

    The graph at ``xml`` has every hidden layer as an output (:class:`_AllHidden`). Two views of
    it are compiled: the last layer alone (what runs unless layers are asked for: the same graph
    as a last-layer export, so a plain request pays nothing for the extra outputs), and, on the
    first call that asks for them, the whole graph: one forward that returns every layer.

    ``packed_xml``: the same model's graph taking the 4D mask and ``position_ids``, compiled
    beside it; a call with a 4D mask (a packed batch) runs it, any other call the graph at
    ``xml``."""

    def __init__(self, xml: Path, mode: str, threads: int | None = None, bf16: bool | None = None,
                 packed_xml: Path | None = None) -> None:
        import threading

        import openvino as ov

        self.path = xml
        core = ov.Core()
        self._core = core
        self._lock = threading.Lock()
        self._layers = None  # (compiled, request) of the whole graph, compiled when first asked for
        if bf16 is None:  # the float parts of the int8 graphs run in bf16 where the CPU has it
            bf16 = mode == "bf16" or (mode != "fp32" and "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"))
        config = {
            "INFERENCE_PRECISION_HINT": "bf16" if bf16 else "f32",
            "PERFORMANCE_HINT": "LATENCY",
            **({"DYNAMIC_QUANTIZATION_GROUP_SIZE": 32} if mode == "int8-weights" else {}),
            "INFERENCE_NUM_THREADS": int(threads or torch.get_num_threads()),
            "CACHE_DIR": str(xml.parent / "compiled"),
        }
        self._config = config
        graph = core.read_model(str(xml))
        results = graph.get_results()
        self._layer_outputs = len(results) > 1
        last = ov.Model(results[:1], graph.get_parameters(), "last_hidden_state") if len(results) > 1 else graph
        self.compiled = core.compile_model(last, "CPU", config)
        del graph, last, results  # the read model's weights (~86 MB for MiniLM) are read again if ever needed
        self.request = self.compiled.create_infer_request()
        self.names = [i.get_any_name() for i in self.compiled.inputs]
        self._graph_4d = "position_ids" in self.names  # a packed graph itself (see graph_inputs)
        self.packed = OpenVINOForward(packed_xml, mode, threads, bf16) if packed_xml is not None else None
        self.mask_4d = self._graph_4d or self.packed is not None  # takes packed batches

    def _all_layers(self):
        with self._lock:
            if self._layers is None:
                if not self._layer_outputs:
                    raise InvalidError(f"the OpenVINO graph {self.path} has no hidden-layer outputs")
                compiled = self._core.compile_model(self._core.read_model(str(self.path)), "CPU", self._config)
                self._layers = compiled, compiled.create_infer_request()
            return self._layers

    def __call__(self, input_ids, attention_mask, token_type_ids=None, output_hidden_states=False,
                 position_ids=None, **_):
        if attention_mask.dim() == 4 and not self._graph_4d:
            if self.packed is None:
                raise InvalidError(f"the OpenVINO graph {self.path} takes a 2D attention mask, not a 4D one")
            return self.packed(input_ids, attention_mask, token_type_ids, output_hidden_states, position_ids)
        if self._graph_4d:
            if attention_mask.dim() == 2:
                attention_mask = key_mask_4d(attention_mask)
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1]).expand_as(input_ids)
        feed = {"input_ids": input_ids, "token_type_ids": token_type_ids, "position_ids": position_ids}
        feed = {n: as_int64(feed[n] if feed[n] is not None else torch.zeros_like(input_ids))
                for n in self.names if n != "attention_mask"}
        feed["attention_mask"] = (np.ascontiguousarray(attention_mask.cpu().numpy(), dtype=np.bool_) if self._graph_4d
                                  else as_int64(attention_mask))
        compiled, request = self._all_layers() if output_hidden_states else (self.compiled, self.request)
        out = request.infer(feed, share_inputs=True)
        if not output_hidden_states:
            return Output(torch.from_numpy(np.array(out[compiled.output(0)], dtype=np.float32, copy=True)))
        # every layer copied once, straight into one [L+1, B, T, D] tensor (embeddings first, the
        # last layer -- output 0 -- last)
        order = [*compiled.outputs[1:], compiled.outputs[0]]
        first = out[order[0]]
        stacked = torch.empty((len(order), *first.shape), dtype=torch.float32)
        for i, o in enumerate(order):
            np.copyto(stacked[i].numpy(), out[o], casting="same_kind")
        return Output(stacked[-1], tuple(stacked), stacked)


def load_openvino(model, tokenizer, mode: str, isa: str, calibration: Sequence[str] | None = None,
                  max_length: int = 256, threads: int | None = None,
                  cache_dir: str | Path | None = None, packing: bool = True) -> OpenVINOForward:
    """OpenVINO path ``mode`` (fp32/bf16 share one converted graph; int8 is NNCF post-training
    quantization calibrated on ``calibration`` or :data:`CALIBRATION_TEXTS`). ``packing=False``:
    no second graph for packed batches, whatever the model."""
    if mode not in OPENVINO_MODES:
        raise InvalidError(f"OpenVINO mode must be one of {', '.join(OPENVINO_MODES)}, got {mode!r}",
                           param="precision")
    texts = list(calibration or CALIBRATION_TEXTS)
    # fp32 and bf16 share the float graph; every layer an output
    extra, graph = "all-layers", "openvino"
    if mode.startswith("int8"):
        import nncf

        graph = f"openvino-{mode}"
        extra += f"|nncf{nncf.__version__}" + (f"|{calibration_hash(texts)}" if mode == "int8" else "")

    def convert(packed: bool) -> Path:
        folder = artifact_dir(model, graph, openvino_version(), isa, extra + ("|mask4d" if packed else ""), cache_dir)
        return build_once(folder, "model.xml",
                          lambda tmp: _ov_convert(model, tokenizer, tmp, mode, texts, max_length, packed))

    # a packable model's packed batches take a second graph with the 4D mask (see the module docstring)
    return OpenVINOForward(convert(False), mode, threads, packed_xml=convert(True) if packing and packable(model) else None)


def as_int64(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.cpu().numpy()
    return np.ascontiguousarray(x, dtype=np.int64)
