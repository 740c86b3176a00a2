"""`POST /tools/<name>` for every tool of the catalogue, and `GET /tools` (OpenAI function schemas).

A tool that streams (`ToolSpec.stream`) answers `Accept: text/event-stream` with `metaagent.api.events`.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

import anyio
from fastapi import APIRouter, Request, Response
from pydantic import BaseModel

from metaagent.api.deps import services
from metaagent.api.errors import error_responses
from metaagent.api.events import OPENAPI_RESPONSE, event_stream, wants_event_stream
from metaagent.errors import ClientGone
from metaagent.tools import ToolSpec


def tools_router(tools: Sequence[ToolSpec]) -> APIRouter:
    router = APIRouter()
    for spec in tools:
        _add_tool_route(router, spec)

    @router.get("/tools", tags=["service"], summary="The tools, as OpenAI-style function schemas")
    async def list_tools() -> dict[str, Any]:
        return {"tools": [spec.function_schema() for spec in tools]}

    return router


def _add_tool_route(router: APIRouter, spec: ToolSpec) -> None:
    """`POST <spec.path>`: the body is validated by the tool's request model, the answer is its response model."""

    async def endpoint(body: BaseModel, request: Request) -> BaseModel | Response:
        stream = spec.stream
        if stream is not None and wants_event_stream(request.headers.get("accept", "")):
            svc = services(request)
            return event_stream(lambda sink: stream(svc, body, sink))
        # A caller that hangs up cancels its call: an execution's container is then killed and removed.
        result: list[BaseModel] = []
        failure: list[Exception] = []
        async with anyio.create_task_group() as group:

            async def watch_disconnect() -> None:
                # The body is read already, so the next ASGI message can only be the disconnect.
                while (await request.receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(watch_disconnect)
            try:
                result.append(await spec.invoke(services(request), body))
            except Exception as exc:  # carried out of the task group unwrapped, for the error handlers
                failure.append(exc)
            group.cancel_scope.cancel()
        if failure:
            raise failure[0]
        if not result:
            raise ClientGone("The client disconnected before the answer was ready")
        return result[0]

    # FastAPI reads the body's type from the signature; the model differs per tool, so it is set here.
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # read by FastAPI
        [
            inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=spec.request_model),
            inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
        ]
    )
    router.add_api_route(
        spec.path,
        endpoint,
        methods=["POST"],
        response_model=spec.response_model,
        tags=["tools"],
        summary=spec.summary,
        description=spec.description,
        operation_id=f"tool_{spec.name}",
        responses={**error_responses(*spec.error_statuses), **(OPENAPI_RESPONSE if spec.stream else {})},
    )
