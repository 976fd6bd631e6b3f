"""Request and response bodies of the HTTP API (they also make the OpenAPI document)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    AfterValidator,
    BeforeValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from embedpool.index import ALL_MODES, FUSIONS, LANGUAGES, SEARCH_MODES, check_unicode
from embedpool.precisions import OUTPUT_PRECISIONS, STORAGE_PRECISIONS


#: A text field: a JSON string that is valid Unicode (:func:`index.check_unicode`: JSON's
#: ``\\ud800`` escape decodes to a lone surrogate).
Text = Annotated[StrictStr, AfterValidator(check_unicode)]

Role = Literal["query", "document"]
PoolerSpec = Annotated[StrictStr, Field(min_length=1, max_length=256,
                                        examples=["mean"],
                                        description="pooler spec, e.g. `mean`, `cls`, `max`, "
                                                    "`landmark:g=32`, `cluster:pool_factor=2`, `tokens`; "
                                                    "`auto` = the model's own pooling")]
Vector = list[float]


def _at_least_one(v: str | list[str]) -> str | list[str]:
    if isinstance(v, list) and not v:
        raise ValueError("empty list: give at least one text")
    return v


#: a text or a non-empty list of texts
TextOrTexts = Annotated[Text | list[Text], AfterValidator(_at_least_one)]
OutputPrecision = Literal[OUTPUT_PRECISIONS]  # type: ignore[valid-type]
TruncationDirection = Literal["right", "left"]
PRECISION_DOC = ("output precision, with the semantics of sentence-transformers' `quantize_embeddings`: "
                 "`float32`, `float16`, `int8` / `uint8` (per-dimension ranges, see `ranges`), `binary` / "
                 "`ubinary` (1 bit per dimension, packed 8 per byte: `int8` / `uint8` codes)")
RANGES_DOC = ("int8 / uint8: the per-dimension `[[minimum...], [maximum...]]` the codes span (each list as long "
              "as the output vectors). Default `[-1, 1]` in every dimension, fixed whatever else is in the "
              "request (the bounds of a normalized vector's coordinates), so a text always gets the same codes; "
              "send your own, e.g. calibrated once on your corpus, for finer steps. Required with "
              "`normalize: false`")
Ranges = Annotated[list[Annotated[list[float], Field(min_length=1, max_length=65536)]],
                   Field(min_length=2, max_length=2, description=RANGES_DOC)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def exactly_one(model: BaseModel, a: str, a_is: str, b: str, b_is: str) -> Any:
    """``model`` if exactly one of its fields ``a`` and ``b`` is given (a model validator's check)."""
    if (getattr(model, a) is None) == (getattr(model, b) is None):
        raise ValueError(f"give exactly one of {a!r} ({a_is}) or {b!r} ({b_is})")
    return model


MODEL_DOC = ("which served model answers: its name (`--model NAME=...`), its id or an alias (GET /v1/models "
             "lists them); default: the server's first model. An unknown one is a 404 naming the served ones")


# ---------------------------------------------------------------------- /embed
class EmbedRequest(Strict):
    inputs: TextOrTexts = Field(
        ..., description="a text or a list of texts", examples=[["A sentence to embed.", "Another one."]])
    model: StrictStr | None = Field(None, max_length=512, description=MODEL_DOC)
    pooler: PoolerSpec | None = Field(None, description="one pooler spec (default: the server's)")
    poolers: list[PoolerSpec] | None = Field(
        None, min_length=1, max_length=16,
        description="several pooler specs; one result per pooler, all from one forward pass")
    role: Role = Field("document", description="`query` or `document`: selects the model's prompt, if any")
    normalize: StrictBool = Field(True, description="L2-normalize each vector")
    dimensions: StrictInt | None = Field(None, ge=1, description="Matryoshka: keep the first N dimensions, then normalize")
    truncate: StrictBool = Field(True, description="cut inputs at the model's window; false: over-long inputs are a 422")
    truncation_direction: TruncationDirection = Field(
        "right", description="TEI: which end `truncate` cuts (`left` keeps the end of the text; a prompt is kept)")
    prompt_name: StrictStr | None = Field(
        None, max_length=256, description="TEI / sentence-transformers: the model's prompt of this name (a key of "
                                          "its `prompts`), instead of the `role`'s")
    precision: OutputPrecision = Field("float32", description=PRECISION_DOC)
    ranges: Ranges | None = None
    encoding_format: Literal["float", "base64"] = Field(
        "float", description="`base64`: each input's codes as one base64 string of little-endian bytes, row-major")

    @model_validator(mode="after")
    def _one_pooler_field(self) -> "EmbedRequest":
        if self.pooler is not None and self.poolers is not None:
            raise ValueError("give either 'pooler' or 'poolers', not both")
        return self


class Usage(BaseModel):
    tokens: int = Field(..., description="tokens of the inputs (after truncation), special tokens included")


class SparseEmbedding(BaseModel):
    indices: list[int] = Field(..., description="vocabulary ids of the non-zero weights, ascending")
    values: list[float] = Field(..., description="their weights")


Embeddings = Annotated[list[Vector] | list[list[Vector]] | list[str] | list[SparseEmbedding], Field(
    description="per input: a vector (single-vector poolers) or a list of vectors (multi-vector), as numbers, "
                "or with `encoding_format: base64` one base64 string; a sparse pooler (`splade`) gives "
                "`{indices, values}`")]


class EmbedResponse(BaseModel):
    model: str
    pooler: str = Field(..., description="canonical spec of the pooler used")
    multi_vector: bool = Field(..., description="true: each embedding is a list of vectors")
    precision: OutputPrecision = "float32"
    embeddings: Embeddings
    usage: Usage


class PoolerResult(BaseModel):
    pooler: str
    multi_vector: bool
    embeddings: Embeddings


class MultiEmbedResponse(BaseModel):
    model: str
    precision: OutputPrecision = "float32"
    results: list[PoolerResult] = Field(..., description="one per requested pooler, in request order")
    usage: Usage


# ---------------------------------------------------------------------- /v1/embeddings
class OpenAIEmbeddingRequest(BaseModel):
    """OpenAI's request (unknown fields are ignored, as OpenAI clients send extra ones)."""

    model_config = ConfigDict(extra="ignore")

    input: TextOrTexts = Field(..., description="a text or a list of texts (token arrays are not supported)")
    model: StrictStr | None = Field(None, max_length=512, description=(
        "which served model answers (as `model` of POST /embed); a server of one model answers any name, as "
        "OpenAI clients always send one"))
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = Field(None, ge=1)
    user: StrictStr | None = None
    pooler: PoolerSpec | None = Field(None, description="extension: a single-vector pooler spec")
    input_type: Literal["query", "passage", "document"] | None = Field(
        None, description="extension (NVIDIA NIM's name): `query` embeds in the query role (the model's query "
                          "prompt, if any); `passage` / `document` (default) as documents")
    role: Role | None = Field(None, description="extension: embedpool's name for `input_type` (`query` or `document`)")
    precision: OutputPrecision = Field("float32", description="extension: " + PRECISION_DOC + ". With "
                                       "`encoding_format: base64` only float32 (what OpenAI clients decode)")
    ranges: Ranges | None = None

    @model_validator(mode="after")
    def _one_role(self) -> "OpenAIEmbeddingRequest":
        if self.input_type is not None and self.role is not None:
            asked = "query" if self.input_type == "query" else "document"
            if asked != self.role:
                raise ValueError(f"input_type {self.input_type!r} and role {self.role!r} disagree; give one of them")
        return self

    @property
    def embed_role(self) -> str:
        if self.role is not None:
            return self.role
        return "query" if self.input_type == "query" else "document"


class OpenAIEmbedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: Vector | str = Field(..., description="numbers, or base64 of little-endian float32")


class OpenAIUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class OpenAIEmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[OpenAIEmbedding]
    model: str
    usage: OpenAIUsage


# ---------------------------------------------------------------------- /rerank
class RerankRequest(Strict):
    """TEI's rerank request, plus `pooler` and `truncation_direction`."""

    query: Text = Field(..., examples=["What is deep learning?"])
    texts: Annotated[list[Text], AfterValidator(_at_least_one)] = Field(..., examples=[["Deep learning is a kind of machine learning.", "Paris is in France."]])
    model: StrictStr | None = Field(None, max_length=512, description=MODEL_DOC)
    pooler: PoolerSpec | None = Field(
        None, description="default `tokens`: a multi-vector pooler scores by MaxSim (late interaction, as ColBERT), "
                          "a single-vector one by cosine")
    raw_scores: StrictBool = Field(False, description="a reranker (cross-encoder): its logit before the model's "
                                                      "activation; MaxSim: the raw sum over query vectors instead of "
                                                      "its mean (cosine poolers: no difference)")
    return_text: StrictBool = Field(False, description="include each text in the answer")
    truncate: StrictBool = Field(False, description="TEI's default: an input over the model's window is a 422; "
                                                    "true: cut it")
    truncation_direction: TruncationDirection = "right"


class Rank(BaseModel):
    index: int = Field(..., description="position of the text in the request's `texts`")
    score: float = Field(..., description="a reranker's score (its activation of the logit unless `raw_scores`), "
                                          "else MaxSim (mean over query vectors unless `raw_scores`) or cosine")
    text: str | None = Field(None, description="with `return_text`")


# ---------------------------------------------------------------------- /tokenize
class TokenizeRequest(Strict):
    """TEI's tokenize request, plus `role`, `pooler` and `truncation_direction`."""

    inputs: TextOrTexts = Field(..., examples=["A sentence to tokenize."])
    model: StrictStr | None = Field(None, max_length=512, description=MODEL_DOC)
    add_special_tokens: StrictBool = True
    prompt_name: StrictStr | None = Field(None, max_length=256, description="the model's prompt of this name")
    role: Role | None = Field(None, description="the role's prompt, as /embed applies it (default: no prompt, as TEI)")
    pooler: PoolerSpec | None = Field(
        None, description="also answer the windows this pooler's tokenization encodes: `tokens:window=true` "
                          "(consecutive windows), `landmark:g=32` (landmark windows), any other (the truncated "
                          "window); the answer is then an object")
    truncation_direction: TruncationDirection = "right"


class SimpleToken(BaseModel):
    id: int
    text: str = Field(..., description="the text's characters of the token (specials: the token itself)")
    special: bool
    start: int | None = Field(None, description="character offset in the input (null: special or prompt token)")
    stop: int | None = None


class TokenWindow(BaseModel):
    ids: list[int] = Field(..., description="the window's token ids as the model sees them (specials included)")
    tokens: list[int] = Field(..., description="[first, end) of this input's token list that the window holds")
    start: int | None = Field(None, description="first character of the input in the window")
    stop: int | None = Field(None, description="end (exclusive) of the window's characters")
    landmarks: list[int] = Field(default_factory=list, description="positions in `ids` of landmark [SEP]s")


class TokenizeWindows(BaseModel):
    pooler: str
    plan: str = Field(..., description="`standard` (truncated), `windowed` or `landmark:g=N`")
    tokens: list[list[SimpleToken]]
    windows: list[list[TokenWindow]] = Field(..., description="per input, its windows in order")


# ---------------------------------------------------------------------- the TEI surface (/tei)
class TEIRequest(BaseModel):
    """TEI's requests ignore unknown fields (serde's default), so ours do too."""

    model_config = ConfigDict(extra="ignore")


#: TEI takes a text or a list of texts; an empty list is TEI's 400 ``Empty``, answered by the
#: route (token-id inputs are not supported: a 422).
TEIInputs = Annotated[Text | list[Text], Field(description="a text or a list of texts (token ids are not "
                                                           "supported)", examples=["What is Deep Learning?"])]
TEITruncate = Annotated[StrictBool | None, Field(
    None, description="cut inputs at the model's window (null: the server's `auto_truncate`, true as in TEI); "
                      "false: an input over the window is a 422")]
#: TEI accepts `Left` / `Right` in either case
TEITruncationDirection = Annotated[TruncationDirection, BeforeValidator(
    lambda v: v.lower() if isinstance(v, str) and v in ("Left", "Right") else v)]
TEIPromptName = Annotated[StrictStr | None, Field(None, max_length=256,
                                                  description="the model's prompt of this name")]


class TEIEmbedRequest(TEIRequest):
    inputs: TEIInputs
    truncate: TEITruncate = None
    truncation_direction: TEITruncationDirection = "right"
    prompt_name: TEIPromptName = None
    normalize: StrictBool = True
    dimensions: StrictInt | None = Field(None, ge=0, description="Matryoshka: keep the first N dimensions "
                                                                 "(0 is TEI's 422)")
    pooler: PoolerSpec | None = Field(None, description="embedpool extension: a single-vector pooler (default: "
                                                        "the server's)")


class TEIEmbedSparseRequest(TEIRequest):
    inputs: TEIInputs
    truncate: TEITruncate = None
    truncation_direction: TEITruncationDirection = "right"
    prompt_name: TEIPromptName = None
    pooler: PoolerSpec | None = Field(None, description="embedpool extension: a sparse pooler (default `splade`, "
                                                        "e.g. `splade:top_k=64`)")


class SparseValue(BaseModel):
    index: int
    value: float


class TEIEmbedAllRequest(TEIRequest):
    inputs: TEIInputs
    truncate: TEITruncate = None
    truncation_direction: TEITruncationDirection = "right"
    prompt_name: TEIPromptName = None
    pooler: PoolerSpec | None = Field(None, description="embedpool extension: a multi-vector pooler (default "
                                                        "`tokens`: every token's vector, L2-normalized; e.g. "
                                                        "`cluster:pool_factor=2`)")


class TEIRerankRequest(TEIRequest):
    query: Text = Field(..., examples=["What is Deep Learning?"])
    texts: list[Text] = Field(..., examples=[["Deep Learning is ..."]])
    truncate: TEITruncate = None
    truncation_direction: TEITruncationDirection = "right"
    raw_scores: StrictBool = False
    return_text: StrictBool = False
    pooler: PoolerSpec | None = Field(None, description="embedpool extension, as on POST /rerank (default "
                                                        "`tokens`: MaxSim)")


class TEITokenizeRequest(TEIRequest):
    inputs: TEIInputs
    add_special_tokens: StrictBool = True
    prompt_name: TEIPromptName = None


class TEIError(BaseModel):
    error: str
    error_type: str = Field(..., description="TEI's type: `Validation`, `Empty`, `Overloaded`, `Unhealthy`, "
                                             "`Backend`; embedpool adds `Unauthorized`, `NotFound`, ...")


class TEIEmbeddingModel(BaseModel):
    pooling: str


class TEIClassifierModel(BaseModel):
    id2label: dict[str, str]
    label2id: dict[str, int]


class TEIModelType(BaseModel):
    embedding: TEIEmbeddingModel | None = None
    reranker: TEIClassifierModel | None = Field(None, description="a cross-encoder (TEI's reranker model type)")


class TEIInfo(BaseModel):
    model_id: str
    model_sha: str | None = None
    model_dtype: str
    served_model_name: str
    model_type: TEIModelType
    max_concurrent_requests: int
    max_input_length: int
    max_batch_tokens: int
    max_batch_requests: int | None = None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int
    version: str
    sha: str | None = None
    docker_label: str | None = None


# ---------------------------------------------------------------------- /v1/rerank (Cohere, Jina, Infinity)
class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: Text


class CohereRerankRequest(BaseModel):
    """Cohere's rerank request (v1 and v2; Jina's and Infinity's are the same). Unknown fields
    (``max_tokens_per_doc``, ``rank_fields``, ``priority``, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")

    query: Text = Field(..., examples=["What is deep learning?"])
    documents: Annotated[list[Text | RerankDocument], AfterValidator(_at_least_one)] = Field(
        ..., description="strings or `{\"text\": ...}` objects",
        examples=[["Deep learning is a kind of machine learning.", "Paris is in France."]])
    model: StrictStr | None = Field(None, max_length=512, description=(
        "which served model answers (as `model` of POST /rerank); a server of one model answers any name"))
    top_n: StrictInt | None = Field(None, ge=1, description="answer the best N (default: all)")
    return_documents: StrictBool | None = Field(False, description="include each document as `{\"text\": ...}`")
    pooler: PoolerSpec | None = Field(None, description="extension, as on POST /rerank (default `tokens`: MaxSim)")
    raw_scores: StrictBool = Field(False, description="Infinity's: a reranker's logit before its activation "
                                                      "(as on POST /rerank)")

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class CohereRerankResult(BaseModel):
    index: int = Field(..., description="position of the document in the request")
    relevance_score: float = Field(..., description="a reranker's score, or MaxSim (mean over query vectors) or "
                                                    "cosine, as POST /rerank")
    document: RerankDocument | None = Field(None, description="with `return_documents`")


class CohereRerankResponse(BaseModel):
    id: str
    model: str
    results: list[CohereRerankResult] = Field(..., description="best first")
    usage: OpenAIUsage


# ---------------------------------------------------------------------- /v1/models
class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    root: str = Field(..., description="the served model's id (an alias names it here)")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------------- collections
CollectionName = Annotated[StrictStr, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
                                            examples=["scifact"],
                                            description="letters, digits, '.', '_' or '-'")]


class CollectionCreate(Strict):
    name: CollectionName
    model: StrictStr | None = Field(None, max_length=512, description=(
        "the served model whose vectors it holds (default: the server's first); every upsert and search of the "
        "collection is embedded with it"))
    pooler: PoolerSpec | None = Field(None, description="default: the server's pooler")
    kind: Literal["single", "multi", "sparse"] | None = Field(
        None, description="default: `multi` for multi-vector poolers, `sparse` for sparse ones (`splade`: the non-zero "
                          "weights stored as (token id, weight) rows; `single` stores them dense), else `single`")
    factory: StrictStr = Field("IDMap2,Flat", max_length=256, description=(
        "single: FAISS index factory string; sparse: `auto` (what the default means: exact while the rows take at "
        "most 64 MiB, then Seismic), `exact`, or `seismic[:n_postings=3500,summary_energy=0.4,centroid_fraction=0.1,"
        "query_cut=20,heap_factor=0.9]`"))
    metric: Literal["ip", "l2"] = "ip"
    normalized: StrictBool | None = Field(None, description=(
        "store L2-normalized vectors. Default: true, but false for a sparse pooler (`splade`), whose weights are "
        "scored by dot product as they are (true for one is a 422)"))
    precision: Literal[STORAGE_PRECISIONS] = Field(  # type: ignore[valid-type]
        "float32", description="multi: token vector storage")
    token_factory: StrictStr = Field("HNSW32", max_length=256, description="multi: FAISS factory of the token ANN index")
    companion_pooler: PoolerSpec | None = Field(
        None, validation_alias=AliasChoices("companion_pooler", "companion"),
        description="multi: pooler of the companion -- the single vectors the collection keeps for `two_stage` "
                    "candidates, written with every upsert and delete: `mean`, `fde:...`, a per-window form "
                    "(`mean:per_window=true`: one row per window of a long document), `auto` (a per-window "
                    "mean for poolers that window long documents, else `mean`) or `none`. Default: `auto`, as "
                    "`embedpool index` gives (a single-vector collection has none). (`companion` is its older name.)")
    companion_factory: StrictStr = Field("IDMap2,Flat", max_length=256,
                                         description="multi: FAISS factory of the companion index")
    analyzer: StrictStr = Field("english", max_length=64, description=(
        "the lexical (BM25) index's analyzer: a language (" + ", ".join(LANGUAGES) + ") with its stemmer and "
        "stopwords, options `:stem=false`, `:stopwords=false`; or `none` for no lexical index"))


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
    companion_pooler: str | None = Field(None, description="pooler of the companion vectors the collection keeps")
    companion_dim: int = 0
    companion_rows: str = Field("document", description="`document` (one companion vector per document) or "
                                                        "`window` (one per window)")
    companion_factory: str = "IDMap2,Flat"
    encoder_precision: str | None = Field(None, description="encoder path the vectors were made with (recorded only)")
    analyzer: str = Field("none", description="the lexical (BM25) index's analyzer (`none`: no lexical index)")
    documents: int
    created: str | None = None
    updated: str | None = None
    stats: dict[str, Any] | None = None


class CollectionList(BaseModel):
    collections: list[CollectionInfo]


class Deleted(BaseModel):
    deleted: str


class DocumentIn(Strict):
    """A document to upsert; its id and metadata are checked by the route against what every
    backend stores (:func:`index.check_document`: docs/api.md, "What can be stored")."""

    id: Text = Field(..., min_length=1, max_length=512, description="1 to 512 characters, at most 512 bytes as UTF-8")
    text: Text
    metadata: dict[str, Any] | None = Field(None, description=(
        "a JSON object: integers within -2^63 .. 2^63-1, finite numbers, nested at most `max_metadata_depth` levels, "
        "at most `max_metadata_bytes` bytes as compact JSON (/info lists both); the top-level key `_embedpool_dates` "
        "is reserved"))


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


FILTER_DOC = ("metadata filter, applied inside the search (k hits whenever k documents match): "
              "`{\"tenant\": \"acme\", \"year\": {\"$gte\": 2020}, \"$or\": [...]}` -- operators $eq $ne $in $nin "
              "$gt $gte $lt $lte (numbers, ISO 8601 dates) $exists $and $or (docs/api.md#metadata-filters)")


class SearchRequest(Strict):
    query: Text | None = Field(None, description="one query (answer: `hits`)")
    queries: list[Text] | None = Field(None, min_length=1, description="several queries (answer: `results`)")
    model: StrictStr | None = Field(None, max_length=512, description=(
        "optional: the model the caller expects; a collection is always searched with its own model, and another "
        "one named here is a 409"))
    k: StrictInt = Field(10, ge=1, le=1000)
    mode: Literal[ALL_MODES] = Field(
        "exhaustive", description="`bm25`: the collection's lexical index; `hybrid`: BM25 fused with `vector_mode`; "
                                  "multi-vector collections: exact MaxSim (`exhaustive`), token-ANN candidates "
                                  "(`tokens`) or candidates from the companion (`two_stage`)")
    filter: dict[str, Any] | None = Field(None, description=FILTER_DOC)
    vector_mode: Literal[SEARCH_MODES] = Field("exhaustive", description="hybrid on a multi-vector collection: "
                                                                         "the vector mode fused with BM25")
    fusion: Literal[FUSIONS] | None = Field(None, description=(
        "hybrid: reciprocal rank fusion (`rrf`), min-max (`score`) or z-score (`zscore`) normalized score fusion; "
        "default: the fusion tuned for the collection (`embedpool eval`), else `rrf`"))
    weight: float | None = Field(None, ge=0.0, le=1.0, description=(
        "hybrid: the vector side's weight (Weaviate's alpha): 1 vectors only, 0 BM25 only; default: the weight "
        "tuned for the collection, else 0.5"))
    candidates: StrictInt = Field(100, ge=1, le=10000, description="two_stage: candidates from the companion")
    k_token: StrictInt = Field(32, ge=1, le=1024, description="tokens: neighbours per query token")
    include_text: StrictBool = True
    rerank_model: StrictStr | None = Field(None, max_length=512, description=(
        "a served reranker (a cross-encoder, `kind: reranker` in GET /info): the best `rerank_candidates` of the "
        "search (any mode) are scored by it with the query, and the best `k` of them answered with its scores"))
    rerank_candidates: StrictInt | None = Field(None, ge=1, le=1000, description=(
        "with `rerank_model`: how many of the search's best documents it scores (default 100, at least `k`)"))

    @model_validator(mode="after")
    def _one_query_field(self) -> "SearchRequest":
        if self.rerank_candidates is not None and self.rerank_model is None:
            raise ValueError("rerank_candidates: takes rerank_model (the reranker that scores the candidates)")
        return exactly_one(self, "query", "a string", "queries", "a list of strings")


class DocumentsDelete(Strict):
    ids: list[Annotated[StrictStr, Field(min_length=1, max_length=512)]] | None = Field(
        None, min_length=1, description="delete these documents (all must exist)")
    filter: dict[str, Any] | None = Field(None, description="delete every document that matches this metadata "
                                                           "filter (the syntax of search's `filter`)")

    @model_validator(mode="after")
    def _one_field(self) -> "DocumentsDelete":
        return exactly_one(self, "ids", "a list of document ids", "filter", "a metadata filter")


class DocumentsDeleted(BaseModel):
    deleted: int = Field(..., description="documents deleted")
    documents: int = Field(..., description="documents in the collection now")


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
class StorageHealth(BaseModel):
    backend: str
    status: Literal["ok", "unreachable"]
    location: str | None = None
    version: str | None = Field(None, description="the Milvus that answers (e.g. `Milvus 2.3.5`)")
    error: str | None = None


class Health(BaseModel):
    status: Literal["ready", "loading", "failed"]
    model: str | None = None
    error: str | None = None
    models: dict[str, Literal["ready", "loading", "failed"]] | None = Field(
        None, description="several models served: each one's status, by name")
    storage: StorageHealth | None = Field(
        None, description="whether the collections' storage answers now (a Milvus server may be down while "
                          "embedding still works: the status stays 200, collection requests answer 503)")


class PoolerInfo(BaseModel):
    name: str
    options: dict[str, str]
    multi_vector: bool | None = None
    learned: bool = Field(False, description="pools with trained weights (`weights=`); untrained it is `mean`")
    all_layers: bool = Field(False, description="reads every hidden layer (from the same forward pass)")


class ModelInfo(BaseModel):
    name: str = Field(..., description="what requests call it (`model`)")
    status: str
    kind: Literal["embedding", "reranker"] | None = Field(
        None, description="`embedding`, or `reranker` for a cross-encoder (it answers the rerank routes only); "
                          "null while it loads")
    model: str | None = Field(None, description="its id (a Hugging Face id or folder)")
    dim: int | None = Field(None, description="its vectors' size (null for a reranker)")
    max_length: int | None = Field(None, description="its window (a reranker's: query and document together)")
    precision: str
    precision_reason: str | None = None
    default_pooler: str | None = Field(None, description="null for a reranker")
    num_labels: int | None = Field(None, description="a reranker's head: 1 (one logit) or 2 (two logits)")
    error: str | None = None


class Info(BaseModel):
    status: str
    version: str
    model: str | None
    dim: int | None
    max_length: int | None
    precision: str = Field(description="encoder path in use (auto resolved: fp32, openvino-bf16, ...)")
    precision_requested: str | None = None
    precision_reason: str | None = Field(None, description="why this path was chosen on this CPU")
    cpu: str | None = Field(None, description="CPU features that decided it")
    default_pooler: str | None
    models: list[ModelInfo] = Field(default_factory=list, description="every served model, the default first")
    poolers: list[PoolerInfo]
    collections: list[str]
    limits: dict[str, Any]
