"""`POST /tools/<name>` for every tool of the catalogue, and `GET /tools` (OpenAI function schemas).

A tool that streams (`ToolSpec.stream`) answers `Accept: text/event-stream` with `metaagent.api.events`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from metaagent.api.body import StrictJsonRoute
from metaagent.api.deps import services, until_disconnect
from metaagent.api.errors import error_responses
from metaagent.api.events import OPENAPI_RESPONSE, event_stream, wants_event_stream
from metaagent.hints import Face, speaking
from metaagent.sandbox.output import OutputSink
from metaagent.tools import ToolSpec


def tools_router(tools: Sequence[ToolSpec]) -> APIRouter:
    router = APIRouter(route_class=StrictJsonRoute)
    for spec in tools:
        # Every tool by its name, so that a function-calling loop needs no table of routes; the older
        # paths (/tools/code-interpreter) stay.
        by_name = f"/tools/{spec.name}"
        if spec.path is not None:
            _add_tool_route(router, spec, spec.path, f"tool_{spec.name}")
        if spec.path != by_name:
            _add_tool_route(
                router, spec, by_name, f"tool_{spec.name}" if spec.path is None else f"tool_{spec.name}_by_name"
            )

    # The schemas follow from the request models alone, so each form is made once: generating them took
    # 6-8 ms of the event loop per request, and an agent loop may ask at every turn.
    listings: dict[bool, bytes] = {}

    @router.get(
        "/tools",
        tags=["service"],
        summary="The tools, as OpenAI-style function schemas",
        response_model=dict[str, Any],
    )
    async def list_tools(strict: bool = False) -> Response:
        """With `strict=true`, each tool in the form OpenAI's strict mode requires, where its shape allows it."""
        if strict not in listings:
            listing = {"tools": [spec.function_schema(strict=strict) for spec in tools]}
            listings[strict] = bytes(JSONResponse(listing).body)
        return Response(listings[strict], media_type="application/json")

    return router


def _add_tool_route(router: APIRouter, spec: ToolSpec, path: str, operation_id: str) -> None:
    """`POST <path>`: the body is validated by the tool's request model, the answer is its response model.

    At the tool's own name (`/tools/{name}`, function calling) hints in errors name tools; at an older
    path (`/tools/code-interpreter`, an HTTP client's) they name routes, as on the resource routes."""
    face = Face.TOOLS if path == f"/tools/{spec.name}" else Face.ROUTES

    async def endpoint(body: BaseModel, request: Request) -> Response:
        stream = spec.stream
        if stream is not None and wants_event_stream(request.headers.get("accept", "")):
            svc = services(request)

            async def streamed(sink: OutputSink) -> BaseModel:
                with speaking(face):  # the stream runs in the response's task, after this handler returned
                    return await stream(svc, body, sink)

            return event_stream(streamed)

        async def invoke() -> BaseModel:
            with speaking(face):
                return await spec.invoke(services(request), body)

        result = await until_disconnect(request, invoke)
        # The answer as the tool made it: a call into a session answers more fields than the model shows.
        return JSONResponse(result.model_dump(mode="json"))

    # FastAPI reads the body's type from the signature; the model differs per tool, so it is set here.
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # read by FastAPI
        [
            inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=spec.request_model),
            inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
        ]
    )
    router.add_api_route(
        path,
        endpoint,
        methods=["POST"],
        response_model=spec.response_model,
        tags=["tools"],
        summary=spec.summary,
        description=spec.description,
        operation_id=operation_id,
        responses={**error_responses(*spec.error_statuses), **(OPENAPI_RESPONSE if spec.stream else {})},
    )
