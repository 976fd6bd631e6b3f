"""Fast JSON responses: orjson writes numpy vectors directly (no ``tolist()``)."""

from __future__ import annotations

from typing import Any

import numpy as np
import orjson
from starlette.responses import Response


def _default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):  # orjson takes C-contiguous arrays only
        return np.ascontiguousarray(obj)
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def dumps(content: Any) -> bytes:
    return orjson.dumps(content, default=_default, option=orjson.OPT_SERIALIZE_NUMPY)


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
