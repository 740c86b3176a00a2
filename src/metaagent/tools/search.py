"""The search tool: Google results through Serper (`POST <base>/<type>` with the key in `X-API-KEY`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field, ValidationError

from metaagent.egress.guard import EgressGuard
from metaagent.redaction import TooDeep
from metaagent.settings import Settings
from metaagent.tools import Effects, ToolSpec
from metaagent.tools._upstream import AnswerBounds, JsonApi, require_key
from metaagent.validation import ToolRequest

if TYPE_CHECKING:
    from metaagent.services import Services

log = logging.getLogger("metaagent.search")

SearchType = Literal["search", "news", "images"]

# The list that holds the results in Serper's answer, per type.
_RESULT_LISTS: dict[str, str] = {"search": "organic", "news": "news", "images": "images"}
# A real answer of 100 results holds a few thousand JSON values and nests about 5 deep.
MAX_ANSWER_VALUES = 100_000
MAX_ANSWER_DEPTH = 32


class SearchRequest(ToolRequest):
    """Search the web (Google, through Serper): pages, news or images, plus the answer box and knowledge graph."""

    q: str = Field(min_length=1, max_length=2048, description="The search query.")
    num: int = Field(default=10, ge=1, le=100, description="How many results to return.")
    gl: str | None = Field(
        default=None, pattern=r"^[A-Za-z]{2}$", description="Country to search from (ISO 3166 code, e.g. us)."
    )
    hl: str | None = Field(
        default=None,
        pattern=r"^[A-Za-z]{2,3}(-[A-Za-z0-9]{2,8})?$",
        description="Interface language (e.g. en, pt-br).",
    )
    type: SearchType = Field(default="search", description="search (web pages), news or images.")


class SearchResult(BaseModel):
    title: str
    link: str
    snippet: str
    position: int
    date: str | None = None
    source: str | None = None
    imageUrl: str | None = None
    thumbnailUrl: str | None = None


class SearchResponse(BaseModel):
    type: SearchType
    results: list[SearchResult]
    answerBox: dict[str, Any] | None = None
    knowledgeGraph: dict[str, Any] | None = None
    peopleAlsoAsk: list[dict[str, Any]] = Field(default_factory=list)
    relatedSearches: list[str] = Field(default_factory=list)
    redacted: int = Field(
        default=0, description="How many copies of the service's keys were removed from Serper's answer."
    )


class _SerperItem(BaseModel):
    """One entry of Serper's organic, news or images list; what we do not use is ignored."""

    title: str = ""
    link: str
    snippet: str = ""
    position: int | None = None
    date: str | None = None
    source: str | None = None
    imageUrl: str | None = None
    thumbnailUrl: str | None = None


class SearchTool:
    def __init__(self, guard: EgressGuard, settings: Settings) -> None:
        self._key = settings.serper_api_key
        self._bounds = AnswerBounds(settings.search_max_response_bytes, MAX_ANSWER_VALUES, MAX_ANSWER_DEPTH)
        self._api = JsonApi.from_settings(
            guard, settings, tool="search", upstream="Serper", base_url=settings.serper_base_url
        )

    async def aclose(self) -> None:
        await self._api.aclose()

    async def __call__(self, request: SearchRequest) -> SearchResponse:
        key = require_key(self._key, "SERPER_API_KEY", "search")
        payload: dict[str, Any] = {"q": request.q, "num": request.num}
        if request.gl:
            payload["gl"] = request.gl.lower()
        if request.hl:
            payload["hl"] = request.hl.lower()
        data = await self._api.post(request.type, payload, {"X-API-KEY": key}, bounds=self._bounds)
        response = self._response(request, data)
        # Every string the caller gets, object keys included, without the service's keys.
        try:
            clean, redacted = self._api.redactor.scrub_tree(response.model_dump(), MAX_ANSWER_DEPTH)
        except TooDeep as exc:
            raise self._api.malformed(str(exc)) from None
        if redacted:
            log.warning("Serper's answer held the service's keys %d time(s); they were redacted", redacted)
        return SearchResponse.model_validate({**clean, "redacted": redacted})

    def _response(self, request: SearchRequest, data: Any) -> SearchResponse:
        if not isinstance(data, dict):
            raise self._api.malformed("expected a JSON object")
        list_name = _RESULT_LISTS[request.type]
        items = data.get(list_name) or []
        if not isinstance(items, list):
            raise self._api.malformed(f"{list_name!r} is not a list")
        results: list[SearchResult] = []
        skipped = 0
        for item in items:
            try:
                entry = _SerperItem.model_validate(item)
            except ValidationError:
                skipped += 1
                continue
            fields = entry.model_dump(exclude={"position"})
            results.append(SearchResult(**fields, position=entry.position or len(results) + 1))
        if skipped:
            log.warning("Serper sent %d %s result(s) without a usable title or link; skipped", skipped, list_name)
        if items and not results:
            raise self._api.malformed(f"no entry of {list_name!r} has a link")
        return SearchResponse(
            type=request.type,
            results=results[: request.num],
            answerBox=_object(data.get("answerBox")),
            knowledgeGraph=_object(data.get("knowledgeGraph")),
            peopleAlsoAsk=[q for q in _list(data.get("peopleAlsoAsk")) if isinstance(q, dict)],
            relatedSearches=[
                r["query"]
                for r in _list(data.get("relatedSearches"))
                if isinstance(r, dict) and isinstance(r.get("query"), str)
            ],
        )


def _object(value: Any) -> dict[str, Any] | None:
    return value if isinstance(value, dict) and value else None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


async def _invoke(svc: Services, request: SearchRequest) -> SearchResponse:
    return await svc.search(request)


SEARCH = ToolSpec(
    "search",
    "/tools/search",
    SearchRequest,
    SearchResponse,
    "Search the web (Google, through Serper)",
    _invoke,
    error_statuses=(400, 422, 502, 503, 504),
    effects=Effects(read_only=True, idempotent=True, open_world=True),
)
