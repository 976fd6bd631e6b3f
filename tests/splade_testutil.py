"""A tiny SPLADE model for tests: a random-weight BertForMaskedLM (a 90-entry vocabulary, 2 layers
of 32 units) wrapped and saved by sentence-transformers itself as a ``SparseEncoder``
(``MLMTransformer`` + ``SpladePooling("max")``)."""

from __future__ import annotations

from pathlib import Path

WORDS = ("the a of and to in is for on with cat dog sat mat stock market fell rain storm weekend "
         "investors sold shares heavy").split()


def make_splade_model(folder: Path):
    """``(path of the saved SparseEncoder, the SparseEncoder)``."""
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.sparse_encoder.models import MLMTransformer, SpladePooling
    from transformers import BertConfig, BertForMaskedLM, BertTokenizerFast

    vocab = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + list("abcdefghijklmnopqrstuvwxyz.,!?")
             + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"] + WORDS)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64)
    mlm = BertForMaskedLM(config).eval()
    with torch.no_grad():  # a visible MLM bias, and (tied) word embeddings that set texts apart
        mlm.cls.predictions.bias.normal_(-4.0, 1.0)  # most weights 0: sparse
        mlm.bert.embeddings.word_embeddings.weight.normal_(0, 1.0)
    mlm.save_pretrained(folder / "mlm")
    BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)}, do_lower_case=True).save_pretrained(folder / "mlm")
    st = SparseEncoder(modules=[MLMTransformer(str(folder / "mlm")), SpladePooling("max")], device="cpu")
    st.save(str(folder / "splade"))
    return str(folder / "splade"), st
