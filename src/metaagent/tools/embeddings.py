"""The embeddings tool: OpenAI's `POST <base>/embeddings`, or any server that speaks it (`OPENAI_BASE_URL`).

Inputs are sent in batches within the upstream's limits (inputs and bytes per request), one batch after
the other, and the vectors come back in input order whatever order the upstream answered in. Vectors are
requested base64-encoded (float32, as OpenAI's own client does: a quarter of the bytes of JSON numbers);
servers that answer with plain lists of numbers are understood too.
"""

from __future__ import annotations

import base64
import binascii
import math
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import BaseModel, Field

from metaagent.egress.guard import EgressGuard
from metaagent.settings import Settings
from metaagent.text import well_formed
from metaagent.tools import Effects, ToolSpec
from metaagent.tools._upstream import AnswerBounds, JsonApi, require_key
from metaagent.validation import ToolRequest

if TYPE_CHECKING:
    from metaagent.services import Services

Text = Annotated[str, Field(min_length=1)]
# Without `dimensions`, no vector may be longer than this (OpenAI's longest has 3072 numbers); with it,
# none longer than asked. A batch's answer is bounded by what its vectors can need: a number written as
# JSON takes at most about 24 bytes, in base64 under 6, plus a little per embedding and per answer.
MAX_VECTOR_LENGTH = 16_384
_BYTES_PER_NUMBER = 24
_BYTES_PER_EMBEDDING = 1024
_VALUES_PER_EMBEDDING = 32
_ANSWER_SLACK_BYTES = 64 * 1024
_ANSWER_SLACK_VALUES = 1024


class EmbeddingsRequest(ToolRequest):
    """Turn text into embedding vectors with OpenAI's embeddings API: one vector per input, in input order."""

    input: Text | Annotated[list[Text], Field(min_length=1)] = Field(
        description="A text, or a list of texts, to embed (none empty)."
    )
    model: str = Field(default="text-embedding-3-small", min_length=1, max_length=256, description="Embedding model.")
    dimensions: int | None = Field(
        default=None, ge=1, le=65536, description="Length of the vectors, for models that can shorten them."
    )


class Embedding(BaseModel):
    index: int
    embedding: list[float]


class EmbeddingsUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingsResponse(BaseModel):
    model: str
    data: list[Embedding]
    usage: EmbeddingsUsage
    redacted: int = Field(
        default=0, description="How many copies of the service's keys were removed from the upstream's answer."
    )


def batches(texts: Sequence[str], max_items: int, max_bytes: int) -> list[slice]:
    """Consecutive slices of `texts`, each with at most `max_items` texts and `max_bytes` UTF-8 bytes.

    A single text larger than `max_bytes` still goes alone: the upstream judges it and says why it refuses.
    """
    result: list[slice] = []
    start = size = 0
    for i, text in enumerate(texts):
        length = len(text.encode())
        if i > start and (i - start >= max_items or size + length > max_bytes):
            result.append(slice(start, i))
            start, size = i, 0
        size += length
    if texts:
        result.append(slice(start, len(texts)))
    return result


class EmbeddingsTool:
    def __init__(self, guard: EgressGuard, settings: Settings) -> None:
        self._key = settings.openai_api_key
        self._batch_size = settings.embeddings_batch_size
        self._batch_bytes = settings.embeddings_batch_max_bytes
        self._max_bytes = settings.embeddings_max_response_bytes
        self._api = JsonApi.from_settings(
            guard, settings, tool="embeddings", upstream="OpenAI", base_url=settings.openai_base_url
        )

    async def aclose(self) -> None:
        await self._api.aclose()

    async def __call__(self, request: EmbeddingsRequest) -> EmbeddingsResponse:
        key = require_key(self._key, "OPENAI_API_KEY", "embeddings")
        texts = [request.input] if isinstance(request.input, str) else request.input
        vectors: list[list[float]] = []
        usage = EmbeddingsUsage()
        model: str | None = None
        for part in batches(texts, self._batch_size, self._batch_bytes):
            payload: dict[str, Any] = {"input": texts[part], "model": request.model, "encoding_format": "base64"}
            if request.dimensions is not None:
                payload["dimensions"] = request.dimensions
            bounds = self._bounds(len(texts[part]), request.dimensions)
            data = await self._api.post("embeddings", payload, {"Authorization": f"Bearer {key}"}, bounds=bounds)
            batch_vectors, batch_model, batch_usage = self._parse(data, len(texts[part]), request.dimensions)
            vectors.extend(batch_vectors)
            model = model or batch_model
            usage.prompt_tokens += batch_usage.prompt_tokens
            usage.total_tokens += batch_usage.total_tokens
        # The model's name is the one string of the answer the caller gets; the vectors are numbers.
        shown, redacted = self._api.redactor.scrub(well_formed(model or request.model))
        return EmbeddingsResponse(
            model=shown,
            data=[Embedding(index=i, embedding=v) for i, v in enumerate(vectors)],
            usage=usage,
            redacted=redacted,
        )

    def _bounds(self, inputs: int, dimensions: int | None) -> AnswerBounds:
        """What the answer to a batch of `inputs` texts can need, within METAAGENT_EMBEDDINGS_MAX_RESPONSE_BYTES."""
        numbers = inputs * (dimensions or MAX_VECTOR_LENGTH)
        size = numbers * _BYTES_PER_NUMBER + inputs * _BYTES_PER_EMBEDDING + _ANSWER_SLACK_BYTES
        values = numbers + inputs * _VALUES_PER_EMBEDDING + _ANSWER_SLACK_VALUES
        return AnswerBounds(max_bytes=min(size, self._max_bytes), max_values=values)

    def _parse(
        self, data: Any, expected: int, dimensions: int | None
    ) -> tuple[list[list[float]], str | None, EmbeddingsUsage]:
        if not isinstance(data, dict) or not isinstance(data.get("data"), list):
            raise self._api.malformed("expected an object with a 'data' list")
        slots: list[list[float] | None] = [None] * expected
        for item in data["data"]:
            index = item.get("index") if isinstance(item, dict) else None
            if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < expected:
                raise self._api.malformed(f"an embedding has no valid index (sent {expected} inputs)")
            if slots[index] is not None:
                raise self._api.malformed(f"index {index} appears twice")
            slots[index] = self._vector(item.get("embedding"), dimensions or MAX_VECTOR_LENGTH)
        vectors = [v for v in slots if v is not None]
        if len(vectors) != expected:
            raise self._api.malformed(f"{expected} inputs sent but {len(vectors)} embeddings returned")
        model = data.get("model") if isinstance(data.get("model"), str) else None
        raw_usage = data.get("usage")
        usage = EmbeddingsUsage()
        if isinstance(raw_usage, dict):
            usage = EmbeddingsUsage(
                prompt_tokens=_count(raw_usage.get("prompt_tokens")), total_tokens=_count(raw_usage.get("total_tokens"))
            )
        return vectors, model, usage

    def _vector(self, value: Any, longest: int) -> list[float]:
        if isinstance(value, str):
            if len(value) > 4 * ((4 * longest + 2) // 3):  # base64 of `longest` float32 values
                raise self._api.malformed(f"an embedding has more than {longest} numbers")
            try:
                raw = base64.b64decode(value, validate=True)
            except binascii.Error:
                raise self._api.malformed("an embedding is not valid base64") from None
            if not raw or len(raw) % 4:
                raise self._api.malformed("an embedding is not a whole number of float32 values")
            vector = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        elif (
            isinstance(value, list)
            and value
            and all(isinstance(x, int | float) and not isinstance(x, bool) for x in value)
        ):
            vector = [float(x) for x in value]  # ints were parsed within 20 digits: this cannot overflow
        else:
            raise self._api.malformed("an embedding is neither a list of numbers nor base64")
        if len(vector) > longest:
            raise self._api.malformed(f"an embedding has {len(vector)} numbers, more than {longest}")
        if not all(math.isfinite(x) for x in vector):
            raise self._api.malformed("an embedding holds a number that is not finite (NaN or infinity)")
        return vector


def _count(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


async def _invoke(svc: Services, request: EmbeddingsRequest) -> EmbeddingsResponse:
    return await svc.embeddings(request)


EMBEDDINGS = ToolSpec(
    "embeddings",
    "/tools/embeddings",
    EmbeddingsRequest,
    EmbeddingsResponse,
    "Turn text into embedding vectors (OpenAI)",
    _invoke,
    error_statuses=(400, 422, 502, 503, 504),
    effects=Effects(read_only=True, idempotent=True, open_world=True),
)
