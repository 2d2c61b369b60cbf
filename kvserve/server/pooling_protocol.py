"""The bodies of the pooling endpoints (vLLM's): /v1/embeddings and /pooling (prompts or a conversation in, one
vector a prompt or a prompt token's out), /score and /v1/score (text pairs in, their embeddings' cosine
similarity out), /rerank, /v1/rerank and /v2/rerank (a query and documents in, the documents by relevance out).

As on the generation endpoints, a field kvserve does not know is refused by name; vLLM's fields for what
kvserve does not serve (multimodal content, ``encoding_format`` "bytes", ``embed_dtype``) are refused too.
"""

from __future__ import annotations

import base64
import time
from typing import Any, Generic, Literal, Sequence, TypeVar

import torch
from pydantic import BaseModel, Field, StrictBool, StrictInt, field_validator, model_validator

from kvserve.engine.scoring import check_score_pairs
from kvserve.pooling_params import PoolingParams
from kvserve.sampling_params import InvalidParameter
from kvserve.server.chat_protocol import ChatMessage
from kvserve.server.completion_protocol import MAX_BATCH_SAMPLES, Prompt, prompt_batch
from kvserve.server.protocol import RequestBody, Text, Usage, check_request_id
from kvserve.utf8 import check_utf8


class PoolingBody(RequestBody):
    """What every pooling endpoint takes beside its input: vLLM's common pooling fields."""

    model: str | None = None
    user: str | None = None  # OpenAI's end-user identifier: informational, as on the generation endpoints
    truncate_prompt_tokens: StrictInt | None = None
    priority: StrictInt = 0
    request_id: Text | None = None
    cache_salt: Text | None = None  # checked with the prompt, as a generation's (``input_processor``)

    @model_validator(mode="after")
    def _check_request_id(self) -> PoolingBody:
        check_request_id(self.request_id)
        return self

    @model_validator(mode="after")
    def _check_params(self) -> PoolingBody:
        self.pooling_params()  # a value out of range is a 400 naming its field, as the body's own are
        return self

    def pooling_params(self) -> PoolingParams:
        """The engine's params: a score's and a rerank's embed their texts."""
        return PoolingParams(task="embed", truncate_prompt_tokens=self.truncate_prompt_tokens)

    @property
    def prompt_field(self) -> str:
        """The field(s) the engine's prompts came in."""
        return "input"

    def named_as_sent(self, error: ValueError) -> ValueError:
        """``error`` told of the prompt (the engine's ``prompt``, ``prompt_token_ids``) by the field it came in."""
        if isinstance(error, InvalidParameter) and error.param in ("prompt", "prompt_token_ids"):
            return error.renamed(self.prompt_field)
        return error


class EncodingBody(PoolingBody):
    """A prompt (``input``: text, token ids, or a batch of either) or a conversation (``messages``, rendered with
    the chat template) to pool, and how the vectors come back: JSON numbers, or ``base64`` (OpenAI's: the
    little-endian float32 bytes)."""

    input: Prompt | None = None
    messages: list[ChatMessage] | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None  # the engine's to refuse: no model kvserve serves is matryoshka-trained
    normalize: StrictBool | None = None  # None: the engine's default (normalized)
    # the tokenizer's special tokens (BOS): added to a prompt, not to messages (whose template holds those it
    # wants), unless this says otherwise (vLLM's defaults)
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool = False  # messages only, as vLLM's pooling requests render them
    continue_final_message: StrictBool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> EncodingBody:
        if (self.input is None) == (self.messages is None):
            raise InvalidParameter("input", "give exactly one of input or messages")
        if self.messages is not None:
            if not self.messages:
                raise InvalidParameter("messages", "messages must not be empty")
            if self.add_generation_prompt and self.continue_final_message:
                raise InvalidParameter("continue_final_message", "continue_final_message and add_generation_prompt "
                                       "cannot both be true")
            return self
        chat_options = {"add_generation_prompt": self.add_generation_prompt,
                        "continue_final_message": self.continue_final_message,
                        "chat_template_kwargs": self.chat_template_kwargs is not None}
        misplaced = next((name for name, given in chat_options.items() if given), None)
        if misplaced is not None:
            raise InvalidParameter(misplaced, f"{misplaced} applies to messages, not to input")
        if self.input == [] or any(p == [] or p == "" for p in self.prompts):
            raise InvalidParameter("input", "input must not be empty")
        check_batch_size("input", len(self.prompts))
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch of ``input``: one text or token-id list per entry (none for ``messages``)."""
        return [] if self.input is None else prompt_batch(self.input)

    @property
    def template_options(self) -> dict[str, Any]:
        """How ``messages`` render (``InputProcessor.apply_chat_template``'s keywords)."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "add_special_tokens": bool(self.add_special_tokens),
                "continue_final_message": self.continue_final_message, "template_kwargs": self.chat_template_kwargs}

    def pooling_params(self) -> PoolingParams:
        return PoolingParams(task=self.pooling_task, normalize=self.normalize, dimensions=self.dimensions,
                             truncate_prompt_tokens=self.truncate_prompt_tokens)

    @property
    def pooling_task(self) -> str:
        return "embed"

    @property
    def prompt_field(self) -> str:
        return "messages" if self.messages is not None else super().prompt_field


class EmbeddingRequest(EncodingBody):
    """POST /v1/embeddings: OpenAI's body (``input``, ``encoding_format``, ``dimensions``, ``user``) with vLLM's
    extras, or vLLM's chat form (``messages``)."""


class PoolingRequest(EncodingBody):
    """POST /pooling: vLLM's body; ``task`` says what comes back: one vector a prompt (``embed``) or one a prompt
    token (``token_embed``). Left out, the model's pooling task (``embed``), as vLLM's default."""

    task: Literal["embed", "token_embed"] = "embed"

    @property
    def pooling_task(self) -> str:
        return self.task


def check_batch_size(name: str, num_prompts: int) -> None:
    """InvalidParameter naming ``name`` where a request would queue more than ``MAX_BATCH_SAMPLES`` prompts: a
    batch is admitted under ``--max-waiting`` as one request."""
    if num_prompts > MAX_BATCH_SAMPLES:
        raise InvalidParameter(name, f"{name}: a batch of {num_prompts:,} prompts; at most {MAX_BATCH_SAMPLES:,} a "
                                     "request")


# vLLM's names of the two sides of a score request, newest first: any one pair is taken
SCORE_PAIRS = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


def score_texts(name: str, value: Any) -> list[str]:
    """One side of a score or rerank request (a text or a list of texts) as a list; InvalidParameter naming
    ``name`` for another kind, multimodal content among them (vLLM's content parts), which kvserve does not take."""
    texts = [value] if isinstance(value, str) else value
    if isinstance(value, dict) or (isinstance(texts, list) and any(isinstance(t, (dict, list)) for t in texts)):
        raise InvalidParameter(name, f"{name}: multimodal content is not supported by kvserve: send text")
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise InvalidParameter(name, f"{name} must be a text or a list of texts")
    if not texts or any(not t for t in texts):
        raise InvalidParameter(name, f"{name} must not be empty, nor hold an empty text")
    return [check_utf8(t, name) for t in texts]


class ScoreRequest(PoolingBody):
    """POST /score and /v1/score: each text of one side paired with the other's (1 to 1, 1 to N or N to N, as
    vLLM pairs them), under any of vLLM's names for the two sides (``SCORE_PAIRS``)."""

    queries: Any = None
    documents: Any = None
    items: Any = None
    data_1: Any = None
    data_2: Any = None
    text_1: Any = None
    text_2: Any = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = [name for name in ("queries", "documents", "items", "data_1", "data_2", "text_1", "text_2")
                 if getattr(self, name) is not None]
        if not any(set(pair) == set(given) for pair in SCORE_PAIRS):
            names = " or ".join(f"{first} and {second}" for first, second in reversed(SCORE_PAIRS))
            raise InvalidParameter(given[0] if given else "text_1",
                                   f"give one pair of texts to score: {names} (got {', '.join(given) or 'none'})")
        first, second = self.pair_names
        num_first, num_second = map(len, self.pairs())  # each side's own refusal names it
        try:
            check_score_pairs(num_first, num_second)
        except ValueError as error:
            raise InvalidParameter(second, f"{first} and {second}: {error}") from None
        check_batch_size(second, num_first + num_second)
        return self

    @property
    def prompt_field(self) -> str:
        return " or ".join(self.pair_names)

    @property
    def pair_names(self) -> tuple[str, str]:
        return next(pair for pair in SCORE_PAIRS if all(getattr(self, name) is not None for name in pair))

    def pairs(self) -> tuple[list[str], list[str]]:
        """The two sides' texts; a first side of one text is scored against each of the second's."""
        first, second = self.pair_names
        return score_texts(first, getattr(self, first)), score_texts(second, getattr(self, second))


class RerankRequest(PoolingBody):
    """POST /rerank, /v1/rerank, /v2/rerank (vLLM's, after Jina's and Cohere's): ``documents`` ranked by their
    relevance to ``query``, the ``top_n`` most relevant (0 or left out: all); ``return_documents`` (Cohere's) false
    leaves each result's text out."""

    query: Any
    documents: Any
    top_n: StrictInt = 0
    return_documents: StrictBool = True

    @property
    def prompt_field(self) -> str:
        return "query or documents"

    @field_validator("query")
    @classmethod
    def _one_query(cls, query: Any) -> str:
        if isinstance(query, list):
            raise InvalidParameter("query", "query must be one text")
        return score_texts("query", query)[0]

    @field_validator("documents")
    @classmethod
    def _texts(cls, documents: Any) -> list[str]:
        if isinstance(documents, str):
            raise InvalidParameter("documents", "documents must be a list of texts")
        texts = score_texts("documents", documents)
        check_batch_size("documents", 1 + len(texts))  # the query is embedded beside them
        return texts

    @field_validator("top_n")
    @classmethod
    def _not_negative(cls, top_n: int) -> int:
        if top_n < 0:
            raise InvalidParameter("top_n", f"top_n must be >= 0 (0: every document), got {top_n}")
        return top_n


# ---- answers ----

def encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | list[list[float]] | str:
    """A pooled vector (or a matrix: one row a token) as JSON numbers, or as base64 of its little-endian float32
    bytes, row after row (OpenAI's encoding, which its SDK decodes)."""
    if encoding_format == "float":
        return vector.tolist()
    data = vector.to(torch.float32).contiguous().numpy().astype("<f4", copy=False).tobytes()
    return base64.b64encode(data).decode("ascii")


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


DataT = TypeVar("DataT")


class ListResponse(BaseModel, Generic[DataT]):
    """vLLM's answer of a pooling endpoint: a list of one entry per prompt (or pair), and the usage."""

    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[DataT]
    usage: Usage


EmbeddingResponse = ListResponse[EmbeddingData]


class PoolingData(BaseModel):
    object: Literal["pooling"] = "pooling"
    index: int
    data: list[float] | list[list[float]] | str


PoolingResponse = ListResponse[PoolingData]


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


ScoreResponse = ListResponse[ScoreData]


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    document: RerankDocument | None = None  # left out of the JSON under return_documents false
    relevance_score: float


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]


def ranked(query_scores: Sequence[float], documents: list[str], top_n: int,
           return_documents: bool) -> list[RerankResult]:
    """The documents by relevance, most relevant first (ties in input order), the first ``top_n`` (0: all)."""
    order = sorted(range(len(documents)), key=lambda i: -query_scores[i])
    return [RerankResult(index=i, relevance_score=query_scores[i],
                         document=RerankDocument(text=documents[i]) if return_documents else None)
            for i in order[:top_n or None]]
