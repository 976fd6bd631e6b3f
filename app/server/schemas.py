"""Request and response bodies of the HTTP API (they also make the OpenAPI document)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    field_validator,
    model_validator,
)


def _unicode(value: str) -> str:
    """Refuse a string that is not valid Unicode: JSON's ``\\ud800`` escape (a lone surrogate)
    decodes to one, and no tokenizer, store or JSON encoder downstream can take it."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"not valid Unicode: a lone surrogate {value[e.start]!r} at character {e.start}; "
                         "send UTF-8 text (a \\uXXXX escape outside the BMP needs both halves of its "
                         "surrogate pair)") from None
    return value


def _unicode_tree(value: Any, where: str = "") -> Any:
    """:func:`_unicode` for every key and string of a JSON value (metadata)."""
    if isinstance(value, str):
        try:
            return _unicode(value)
        except ValueError as e:
            raise ValueError(f"{where}: {e}" if where else str(e)) from None
    if isinstance(value, dict):
        for k, v in value.items():
            _unicode_tree(k, f"{where} key {k!r}".strip())
            _unicode_tree(v, f"{where}[{k!r}]")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _unicode_tree(v, f"{where}[{i}]")
    return value


#: A text field: a JSON string that is valid Unicode.
Text = Annotated[StrictStr, AfterValidator(_unicode)]

Role = Literal["query", "document"]
PoolerSpec = Annotated[StrictStr, Field(min_length=1, max_length=256,
                                        examples=["mean"],
                                        description="pooler spec, e.g. `mean`, `cls`, `max`, "
                                                    "`landmark:g=32`, `cluster:pool_factor=2`, `tokens`; "
                                                    "`auto` = the model's own pooling")]
Vector = list[float]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------------- /embed
class EmbedRequest(Strict):
    inputs: Text | list[Text] = Field(
        ..., description="a text or a list of texts", examples=[["A sentence to embed.", "Another one."]])
    pooler: PoolerSpec | None = Field(None, description="one pooler spec (default: the server's)")
    poolers: list[PoolerSpec] | None = Field(
        None, min_length=1, max_length=16,
        description="several pooler specs; one result per pooler, all from one forward pass")
    role: Role = Field("document", description="`query` or `document`: selects the model's prompt, if any")
    normalize: StrictBool = Field(True, description="L2-normalize each vector")
    dimensions: StrictInt | None = Field(None, ge=1, description="Matryoshka: keep the first N dimensions, then normalize")
    truncate: StrictBool = Field(True, description="cut inputs at the model's window; false: over-long inputs are a 422")

    @model_validator(mode="after")
    def _one_pooler_field(self) -> "EmbedRequest":
        if self.pooler is not None and self.poolers is not None:
            raise ValueError("give either 'pooler' or 'poolers', not both")
        return self

    @field_validator("inputs")
    @classmethod
    def _not_empty(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("empty list: give at least one text")
        return v


class Usage(BaseModel):
    tokens: int = Field(..., description="tokens of the inputs (after truncation), special tokens included")


class EmbedResponse(BaseModel):
    model: str
    pooler: str = Field(..., description="canonical spec of the pooler used")
    multi_vector: bool = Field(..., description="true: each embedding is a list of vectors")
    embeddings: list[Vector] | list[list[Vector]]
    usage: Usage


class PoolerResult(BaseModel):
    pooler: str
    multi_vector: bool
    embeddings: list[Vector] | list[list[Vector]]


class MultiEmbedResponse(BaseModel):
    model: str
    results: list[PoolerResult] = Field(..., description="one per requested pooler, in request order")
    usage: Usage


# ---------------------------------------------------------------------- /v1/embeddings
class OpenAIEmbeddingRequest(BaseModel):
    """OpenAI's request (unknown fields are ignored, as OpenAI clients send extra ones)."""

    model_config = ConfigDict(extra="ignore")

    input: Text | list[Text] = Field(..., description="a text or a list of texts (token arrays are not supported)")
    model: StrictStr | None = Field(None, description="accepted for compatibility; the server's model is used")
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None
    pooler: PoolerSpec | None = Field(None, description="extension: a single-vector pooler spec")

    @field_validator("input")
    @classmethod
    def _not_empty(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and not v:
            raise ValueError("empty list: give at least one text")
        return v


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Vector | str = Field(..., description="floats, or base64 of little-endian float32")


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


# ---------------------------------------------------------------------- collections
CollectionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                            examples=["scifact"],
                                            description="letters, digits, '.', '_' or '-'")]


class CollectionCreate(Strict):
    name: CollectionName
    pooler: PoolerSpec | None = Field(None, description="default: the server's pooler")
    kind: Literal["single", "multi"] | None = Field(
        None, description="default: `multi` for multi-vector poolers, else `single`")
    factory: StrictStr = Field("IDMap2,Flat", max_length=256, description="single: FAISS index factory string")
    metric: Literal["ip", "l2"] = "ip"
    normalized: StrictBool = True
    precision: Literal["float32", "float16", "int8"] = Field("float32", description="multi: token vector storage")
    token_factory: StrictStr = Field("HNSW32", max_length=256, description="multi: FAISS factory of the token ANN index")
    companion: CollectionName | None = Field(None, description="multi: single-vector collection for `two_stage` search")


class CollectionInfo(BaseModel):
    name: str
    kind: str
    model: str
    pooler: str
    dim: int
    metric: str
    normalized: bool
    factory: str
    precision: str
    token_factory: str
    companion: str | None
    documents: int
    created: str | None = None
    updated: str | None = None
    stats: dict[str, Any] | None = None


class CollectionList(BaseModel):
    collections: list[CollectionInfo]


class Deleted(BaseModel):
    deleted: str


class DocumentIn(Strict):
    id: Text = Field(..., min_length=1, max_length=512)
    text: Text
    metadata: dict[str, Any] | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_unicode(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return _unicode_tree(v)


class DocumentsIn(Strict):
    documents: list[DocumentIn] = Field(..., min_length=1)


class DocumentsUpserted(BaseModel):
    upserted: int
    documents: int = Field(..., description="documents in the collection now")
    usage: Usage


class DocumentOut(BaseModel):
    id: str
    text: str | None
    metadata: dict[str, Any] | None
    vector: list[float] | list[Vector] | None = None


class SearchRequest(Strict):
    query: Text | None = Field(None, description="one query (answer: `hits`)")
    queries: list[Text] | None = Field(None, min_length=1, description="several queries (answer: `results`)")
    k: StrictInt = Field(10, ge=1, le=1000)
    mode: Literal["exhaustive", "tokens", "two_stage"] = Field(
        "exhaustive", description="multi-vector collections: exact MaxSim, token-ANN candidates, or "
                                  "candidates from the companion collection")
    candidates: StrictInt = Field(100, ge=1, le=10000, description="two_stage: candidates from the companion")
    k_token: StrictInt = Field(32, ge=1, le=1024, description="tokens: neighbours per query token")
    include_text: StrictBool = True

    @model_validator(mode="after")
    def _one_query_field(self) -> "SearchRequest":
        if (self.query is None) == (self.queries is None):
            raise ValueError("give exactly one of 'query' (a string) or 'queries' (a list of strings)")
        return self


class Hit(BaseModel):
    id: str
    score: float
    text: str | None = None
    metadata: dict[str, Any] | None = None


class SearchResponse(BaseModel):
    hits: list[Hit] | None = Field(None, description="for `query`")
    results: list[list[Hit]] | None = Field(None, description="for `queries`, one list per query")
    usage: Usage


# ---------------------------------------------------------------------- health, info
class Health(BaseModel):
    status: Literal["ready", "loading", "failed"]
    model: str | None = None
    error: str | None = None


class PoolerInfo(BaseModel):
    name: str
    options: dict[str, str]
    multi_vector: bool | None = None


class Info(BaseModel):
    status: str
    version: str
    model: str | None
    dim: int | None
    max_length: int | None
    precision: str
    default_pooler: str
    poolers: list[PoolerInfo]
    collections: list[str]
    limits: dict[str, Any]
