"""``POST /tokenize``: TEI's token list (id, text, special, start, stop) per input, and with
``pooler`` the windows that pooler's tokenization plan feeds the model.

Offsets are character offsets into the input (Python string indices; TEI's are bytes, the same
for ASCII). The whole input is tokenized, without truncation, so the list shows how long it is;
``windows`` show what is kept: one truncated window (standard plan), consecutive windows
(``tokens:window=true``, ``cluster:window=true``) or landmark windows (``landmark:g=N``). The
windows come from :meth:`poolers.FrozenEncoder.windows`, the tokenization ``/embed`` encodes.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends
from starlette.concurrency import run_in_threadpool

from embedpool.app.server.auth import require_api_key
from embedpool.app.server.deps import get_engines
from embedpool.app.server.limits import check_inputs, check_tokens
from embedpool.app.server.responses import JSON
from embedpool.app.server.schemas import SimpleToken, TokenizeRequest, TokenizeWindows
from embedpool.app.server.engine import Engine, Engines
from embedpool.errors import InvalidError

router = APIRouter(tags=["tokenize"], dependencies=[Depends(require_api_key)])


@router.post("/tokenize", response_model=list[list[SimpleToken]] | TokenizeWindows,
             responses={413: {"description": "too many inputs, an input too long, or more tokens than "
                                    "max_request_tokens"},
                        422: {"description": "invalid field"}})
async def tokenize(body: TokenizeRequest, engines: Engines = Depends(get_engines)) -> JSON:
    """The tokens of each input, TEI's shape: `[[{id, text, special, start, stop}, ...], ...]`
    (`prompt_name` or `role` prepend the model's prompt; its tokens have null offsets). With
    `pooler`, an object: `tokens` as above, plus per input the `windows` that pooler encodes
    (`ids` as the model sees them, `tokens` [first, end) of the token list, `start`/`stop`
    characters of the input, landmark positions)."""
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    spec, plan, tokens, windows = await token_lists(
        engines.pick(body.model), texts, add_special_tokens=body.add_special_tokens, prompt_name=body.prompt_name, role=body.role,
        pooler=body.pooler, truncation_direction=body.truncation_direction)
    if plan is None:
        return JSON(tokens)
    return JSON({"pooler": spec, "plan": plan.key, "tokens": tokens, "windows": windows})


async def token_lists(engine: Engine, texts: list[str], *, add_special_tokens: bool = True,
                      prompt_name: str | None = None, role: str | None = None, pooler: str | None = None,
                      truncation_direction: str = "right") -> tuple[str | None, Any, list, list]:
    """``(pooler spec, plan, token lists, windows)`` of ``texts``, with the limits checked: the
    work of ``/tokenize`` and TEI's ``/tei/tokenize`` (no pooler: no plan and no windows)."""
    check_inputs(texts, engine.settings, "inputs")
    engine.require()
    engine.check_prompt(prompt_name)
    spec = plan = None
    if pooler is not None:
        spec, _ = engine.pooler(pooler)
        plan = engine.embedder.pooler(spec).plan
    tokens, windows = await run_in_threadpool(
        _tokenize, engine.embedder.encoder, texts, engine.settings, plan, add_special_tokens=add_special_tokens,
        prompt_name=prompt_name, role=role, truncation_direction=truncation_direction)
    return spec, plan, tokens, windows


def _tokenize(encoder: Any, texts: list[str], settings: Any, plan: Any, *, add_special_tokens: bool,
              prompt_name: str | None, role: str | None, truncation_direction: str) -> tuple[list, list]:
    prompt = encoder.prompt_for(role, prompt_name)
    enc = encoder.run_tokenizer([prompt + t for t in texts], add_special_tokens=add_special_tokens,
                                return_offsets_mapping=True, return_special_tokens_mask=True,
                                return_attention_mask=False, return_token_type_ids=False, verbose=False)
    # the answer holds an object per token: bounded like the tokens an embedding may run
    check_tokens(sum(len(ids) for ids in enc["input_ids"]), settings, "inputs", "in its token lists")
    tokens = [_tokens(encoder, text, prompt, ids, offsets, special)
              for text, ids, offsets, special in zip(texts, enc["input_ids"], enc["offset_mapping"],
                                                     enc["special_tokens_mask"])]
    if plan is None:
        return _public(tokens), []
    try:
        rows = encoder.windows(texts, plan, role, truncate=True, prompt_name=prompt_name,
                               truncation_direction=truncation_direction)
    except ValueError as exc:
        raise InvalidError(f"pooler: {exc}", param="pooler") from None
    windows = []
    for row, toks in zip(rows, tokens):
        pos = [i for i, t in enumerate(toks) if "_content" in t]  # content token k is toks[pos[k]]
        windows.append([_window(w, toks, pos) for w in row])
    return _public(tokens), windows


def _public(tokens: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    for toks in tokens:
        for t in toks:
            t.pop("_content", None)
    return tokens


def _tokens(encoder: Any, text: str, prompt: str, ids: list[int], offsets: list[tuple[int, int]],
            special: list[int]) -> list[dict[str, Any]]:
    """TEI's token entries; ``_content`` (dropped from the answer) numbers the non-special ones."""
    out, pieces, n = [], encoder.tokenizer.convert_ids_to_tokens(ids), 0
    cut = len(prompt)
    for tid, (a, b), sp, piece in zip(ids, offsets, special, pieces):
        if sp:
            out.append({"id": tid, "text": piece, "special": True, "start": None, "stop": None})
            continue
        if b <= cut:  # a token of the prompt
            entry = {"id": tid, "text": piece, "special": False, "start": None, "stop": None}
        else:
            a, b = max(a - cut, 0), b - cut
            entry = {"id": tid, "text": text[a:b], "special": False, "start": a, "stop": b}
        entry["_content"] = n
        n += 1
        out.append(entry)
    return out


def _window(w: Any, toks: list[dict[str, Any]], pos: list[int]) -> dict[str, Any]:
    """A window's ids, its [first, end) in the token list and its characters of the input."""
    lo, hi = w.span
    first, end = (pos[lo], pos[hi - 1] + 1) if hi > lo else (0, 0)
    # the first and last tokens with offsets (prompt tokens, which have none, lead a first window)
    a = next((i for i in range(first, end) if toks[i]["start"] is not None), None)
    b = next((i for i in range(end - 1, first - 1, -1) if toks[i]["start"] is not None), None)
    return {"ids": w.ids, "tokens": [first, end],
            "start": None if a is None else toks[a]["start"], "stop": None if b is None else toks[b]["stop"],
            "landmarks": [i for i, f in enumerate(w.landmark) if f]}
