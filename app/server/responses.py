"""Fast JSON responses: orjson writes numpy vectors directly (no ``tolist()``).

Every answer renders, whatever a collection holds: values that orjson cannot write -- only a
collection written before stored values were checked (``index.check_document``), or edited on
disk, holds them -- are answered as text, once, here (:func:`renderable`; docs/api.md, "What can
be stored"). An integer outside -2^63 .. 2^64-1 is its decimal string (``"18446744073709551616"``:
lossless), an object or array nested deeper than :data:`RENDER_DEPTH` levels its JSON text. (orjson
writes NaN and infinities as ``null``, as JavaScript's ``JSON.stringify`` does.)
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import orjson
from starlette.responses import Response

#: the deepest nesting :func:`renderable` keeps as JSON: orjson writes at most 254 levels
RENDER_DEPTH = 250
_ORJSON_INTS = (-(1 << 63), (1 << 64) - 1)


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # orjson takes C-contiguous arrays only
        return np.ascontiguousarray(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def dumps(content: Any) -> bytes:
    try:
        return orjson.dumps(content, default=_default, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError:  # orjson.JSONEncodeError: an integer past 64 bits, too deep (stored before checks)
        return orjson.dumps(renderable(content), default=_default, option=orjson.OPT_SERIALIZE_NUMPY)


def renderable(value: Any, depth: int = 1) -> Any:
    """``value`` with what orjson cannot write as text: integers outside its 64-bit range as
    their decimal strings, containers deeper than :data:`RENDER_DEPTH` as their JSON text."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return value if _ORJSON_INTS[0] <= value <= _ORJSON_INTS[1] else str(value)
    if isinstance(value, (dict, list, tuple)):
        if depth > RENDER_DEPTH:
            return json.dumps(value, ensure_ascii=False)
        if isinstance(value, dict):
            return {k: renderable(v, depth + 1) for k, v in value.items()}
        return [renderable(v, depth + 1) for v in value]
    return value


class JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


#: the OpenAPI description of an error in OpenAI's shape (``/v1/`` routes)
OPENAI_ERROR = {"description": "OpenAI error shape: {\"error\": {\"message\", \"type\", \"param\", \"code\"}}"}


def ranks(ranking: Any, texts: list[str], return_text: bool) -> list[dict[str, Any]]:
    """TEI's rerank answer for an :class:`app.server.engine.Ranking`: ``[{index, score[, text]}]``,
    best first (``/rerank`` and ``/tei/rerank``)."""
    return [{"index": int(i), "score": float(ranking.scores[i]), **({"text": texts[i]} if return_text else {})}
            for i in ranking.order]
