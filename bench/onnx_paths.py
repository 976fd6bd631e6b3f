"""ONNX Runtime encoder paths for ``bench/encode.py``: the exported fp32 graph and ONNX Runtime's
own quantizers (``quantize_dynamic``: per-channel int8 weights, dynamic activations;
``quantize_static``: QDQ int8, calibrated). The benchmark compares them with embedpool's paths;
none is a setting of embedpool (they miss the quality bar: see docs/ on encoding), so they live
here, not in ``poolers/``. Built on the shared helpers of :mod:`embedpool.poolers.runtimes`
(cache folder, calibration feeds, export wrapper)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from embedpool.poolers import runtimes

#: path name -> (library, what it is), beside ``embedpool.precisions.ENCODER_PATHS``
PATHS = {
    "onnx-int8": ("onnxruntime", "ONNX Runtime quantize_dynamic: per-channel int8 weights, dynamic activations"),
    "onnx-qdq": ("onnxruntime", "ONNX Runtime quantize_static: QDQ int8, calibrated"),
}

ONNX_MODES = ("fp32", "qint8", "qdq")


def _export_onnx(model, tokenizer, path: Path) -> None:
    tt = runtimes.has_token_types(tokenizer)
    names = ["input_ids", "attention_mask"] + (["token_type_ids"] if tt else [])
    ex = runtimes.example_inputs(tokenizer, tt)
    axes = {n: {0: "batch", 1: "seq"} for n in names}
    axes["last_hidden_state"] = {0: "batch", 1: "seq"}
    with torch.inference_mode():
        torch.onnx.export(runtimes.LastHidden(model, tt).eval(), tuple(ex[n] for n in names), str(path),
                          input_names=names, output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)


class _Reader:
    """``onnxruntime.quantization.CalibrationDataReader`` over prepared feeds."""

    def __init__(self, feeds):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):  # pragma: no cover - not used by MinMax
        pass


def _onnx_build(model, tokenizer, folder: Path, mode: str, calibration: Sequence[str], max_length: int) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quant_pre_process, quantize_dynamic, quantize_static

    raw = folder / "fp32.onnx"
    _export_onnx(model, tokenizer, raw)
    if mode == "fp32":
        os.replace(raw, folder / "model.onnx")
        return
    pre = folder / "pre.onnx"
    quant_pre_process(str(raw), str(pre), skip_symbolic_shape=True)
    if mode == "qint8":
        quantize_dynamic(str(pre), str(folder / "model.onnx"), weight_type=QuantType.QInt8, per_channel=True)
    else:
        tt = runtimes.has_token_types(tokenizer)
        feeds = runtimes.calibration_batches(tokenizer, calibration, tt, max_length)
        quantize_static(str(pre), str(folder / "model.onnx"), _Reader(feeds), quant_format=QuantFormat.QDQ,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, per_channel=True,
                        op_types_to_quantize=["MatMul"],
                        extra_options={"ActivationSymmetric": False, "WeightSymmetric": True})
    for p in (raw, pre):
        p.unlink(missing_ok=True)
    for p in folder.glob("*.data"):
        p.unlink()


class OnnxForward:
    """An ONNX Runtime CPU session (threads sleep between runs: see the batcher's notes)."""

    def __init__(self, path: Path, threads: int | None = None) -> None:
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.intra_op_num_threads = int(threads or torch.get_num_threads())
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.path = path
        self.session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        self.names = [i.name for i in self.session.get_inputs()]

    def __call__(self, input_ids, attention_mask, token_type_ids=None, output_hidden_states=False, **_):
        if output_hidden_states:
            raise ValueError("the ONNX Runtime paths give the last layer alone; a pooler over all hidden "
                             "layers runs on the torch and OpenVINO paths")
        feed = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        feed = {n: runtimes.as_int64(feed[n] if feed[n] is not None else torch.zeros_like(input_ids)) for n in self.names}
        return runtimes.Output(torch.from_numpy(self.session.run(None, feed)[0]))


def load_onnx(model, tokenizer, mode: str, isa: str, calibration: Sequence[str] | None = None,
              max_length: int = 256, threads: int | None = None,
              cache_dir: str | Path | None = None) -> OnnxForward:
    """ONNX Runtime path: ``fp32`` (exported graph), ``qint8`` (``quantize_dynamic``, per-channel
    int8 weights) or ``qdq`` (``quantize_static``, QDQ, calibrated)."""
    import onnxruntime as ort

    if mode not in ONNX_MODES:
        raise ValueError(f"ONNX Runtime mode must be one of {', '.join(ONNX_MODES)}, got {mode!r}")
    texts = list(calibration or runtimes.CALIBRATION_TEXTS)
    extra = runtimes.calibration_hash(texts) if mode == "qdq" else ""
    folder = runtimes.artifact_dir(model, f"onnx-{mode}", ort.__version__, isa, extra, cache_dir)
    path = runtimes.build_once(folder, "model.onnx", lambda tmp: _onnx_build(model, tokenizer, tmp, mode, texts, max_length))
    return OnnxForward(path, threads)


def load_path(path: str, model, tokenizer, max_length: int = 256, calibration=None, cache_dir=None):
    """The forward of ``path``: one of :data:`PATHS` here, else embedpool's own
    (:func:`embedpool.poolers.precision.load_forward`)."""
    from embedpool.cpu import cpu_features
    from embedpool.poolers.precision import load_forward

    if path not in PATHS:
        return load_forward(path, model, tokenizer, max_length, calibration, cache_dir)
    mode = {"onnx-int8": "qint8", "onnx-qdq": "qdq"}[path]
    return load_onnx(model, tokenizer, mode, cpu_features().isa, calibration, max_length, cache_dir=cache_dir)
