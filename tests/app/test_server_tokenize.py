"""``POST /tokenize``: TEI's token list against the model's own tokenizer, and the windows of
the standard, ``windowed`` (``window=true``) and ``landmark`` plans against what ``/embed``
encodes and against the LMK recipe written out here."""

from __future__ import annotations

import numpy as np
import pytest

TEXTS = ["Hello world, tokenize me!", "naïve café 🙂 日本語のテキスト", "", "UPPER lower 12345 tokenization"]
WORDS = "the cat sat on a mat and the dog ran in the park while we were out for a walk".split()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from embedpool.poolers.encoder import default_model_path

    return AutoTokenizer.from_pretrained(default_model_path())


def tokenize(client, **body):
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_tokens_equal_the_tokenizer(client, tokenizer):
    for special in (True, False):
        got = tokenize(client, inputs=TEXTS, add_special_tokens=special)
        ref = tokenizer(TEXTS, add_special_tokens=special, return_offsets_mapping=True)
        assert len(got) == len(TEXTS)
        for text, toks, ids, offsets in zip(TEXTS, got, ref["input_ids"], ref["offset_mapping"]):
            assert [t["id"] for t in toks] == ids
            for t, (a, b), piece in zip(toks, offsets, tokenizer.convert_ids_to_tokens(ids)):
                assert set(t) == {"id", "text", "special", "start", "stop"}
                if t["special"]:
                    assert t["start"] is None and t["text"] == piece
                else:
                    assert (t["start"], t["stop"]) == (a, b) and t["text"] == text[a:b]
    one = tokenize(client, inputs="one text")
    assert isinstance(one, list) and len(one) == 1 and one[0][0]["text"] == "[CLS]"  # TEI: always a list of lists


def test_standard_window_is_what_truncation_keeps(client, tokenizer):
    long = " ".join(f"item{i} costs {i} dollars;" for i in range(200))
    ans = tokenize(client, inputs=[long, "short text"], pooler="mean")
    assert ans["plan"] == "standard" and ans["pooler"] == "mean"
    (win,), (short,) = ans["windows"]
    assert win["ids"] == tokenizer(long, truncation=True, max_length=256)["input_ids"]
    assert win["tokens"] == [1, 255] and win["start"] == 0 and long[win["stop"] - 1] != " "
    assert short["ids"] == [t["id"] for t in ans["tokens"][1]]
    tokenizer.truncation_side = "left"
    try:
        want = tokenizer(long, truncation=True, max_length=256)["input_ids"]
    finally:
        tokenizer.truncation_side = "right"
    (left,), _ = tokenize(client, inputs=[long, "x"], pooler="mean", truncation_direction="left")["windows"]
    n = len(ans["tokens"][0])
    assert left["ids"] == want and left["tokens"] == [n - 255, n - 1] and left["stop"] == len(long)


def test_windowed_plan_windows_are_what_window_true_encodes(client):
    text = " ".join(WORDS[i % len(WORDS)] for i in range(700))  # every word is one token
    ans = tokenize(client, inputs=text, pooler="tokens:window=true")
    assert ans["plan"] == "windowed" and ans["pooler"] == "tokens:window=true"
    windows = ans["windows"][0]
    assert [len(w["ids"]) for w in windows] == [256, 256, 700 - 2 * 254 + 2]
    tokens = ans["tokens"][0]
    assert windows[0]["tokens"][0] == 1 and windows[-1]["tokens"][1] == len(tokens) - 1
    for a, b in zip(windows, windows[1:]):
        assert a["tokens"][1] == b["tokens"][0] and a["stop"] < b["start"]  # consecutive, no overlap
    for w in windows:
        first, end = w["tokens"]
        assert w["ids"] == [101] + [t["id"] for t in tokens[first:end]] + [102]
    # /embed tokens:window=true: one vector per id of every window; window k's vectors are the
    # tokens of the text's characters start..stop of window k, encoded on their own
    full = np.asarray(client.post("/embed", json={"inputs": text, "pooler": "tokens:window=true"}).json()["embeddings"][0])
    assert len(full) == sum(len(w["ids"]) for w in windows)
    at = 0
    for w in windows:
        part = client.post("/embed", json={"inputs": text[w["start"]:w["stop"]], "pooler": "tokens"}).json()
        part = np.asarray(part["embeddings"][0])
        assert np.allclose(full[at:at + len(w["ids"])], part, atol=1e-5)
        at += len(w["ids"])


def lmk_windows(tokenizer, text: str, g: int, max_length: int = 256) -> list[list[int]]:
    """The LMK paper's layout, written out: [CLS] c1 [SEP] c2 [SEP] ... with chunks of g tokens,
    as many whole chunks per window as fit the model's window."""
    toks = tokenizer(text, add_special_tokens=False)["input_ids"]
    chunks = [toks[i:i + g] for i in range(0, len(toks), g)] or [[]]
    per = (max_length - 1) // (g + 1)
    out = []
    for w in range(0, len(chunks), per):
        ids = [tokenizer.cls_token_id]
        for c in chunks[w:w + per]:
            ids += c + [tokenizer.sep_token_id]
        out.append(ids)
    return out


def test_landmark_windows_follow_the_lmk_recipe(client, tokenizer):
    text = " ".join(f"fact {i} about proteins and cells." for i in range(90))
    for g in (32, 8):
        ans = tokenize(client, inputs=[text, ""], pooler=f"landmark:g={g}")
        assert ans["plan"] == f"landmark:g={g}"
        got, empty = ans["windows"]
        assert [w["ids"] for w in got] == lmk_windows(tokenizer, text, g)
        for w in got:
            assert w["landmarks"] == [i for i, t in enumerate(w["ids"]) if t == tokenizer.sep_token_id]
        assert got[0]["start"] == 0 and got[-1]["stop"] == len(text)
        assert [w["ids"] for w in empty] == [[101, 102]] and empty[0]["start"] is None


def test_tokenize_errors(server, client):
    for body, field in (({"inputs": []}, "inputs"), ({"inputs": "x", "prompt_name": "nope"}, "prompt_name"),
                        ({"inputs": "x", "pooler": "landmark:g=300"}, "pooler"),
                        ({"inputs": "x", "pooler": "nope"}, "pooler"), ({"inputs": 3}, "inputs")):
        r = client.post("/tokenize", json=body)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"].startswith(field), r.json()
    assert client.post("/tokenize", json={"inputs": "x" * 100_001}).status_code == 413
    server.alive()


def test_a_20000_token_document(client):
    text = " ".join(WORDS[i % len(WORDS)] for i in range(20_000))
    ans = tokenize(client, inputs=text, pooler="tokens:window=true")
    windows = ans["windows"][0]
    assert len(ans["tokens"][0]) == 20_002 and len(windows) == -(-20_000 // 254)
    assert sum(len(w["ids"]) - 2 for w in windows) == 20_000
    assert windows[0]["start"] == 0 and windows[-1]["stop"] == len(text)
    landmark = tokenize(client, inputs=text, pooler="landmark:g=32")["windows"][0]
    assert sum(len(w["landmarks"]) for w in landmark) == -(-20_000 // 32)
