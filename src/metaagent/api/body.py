"""The route class of every router: its JSON request bodies are read by `metaagent.request_json`.

FastAPI decides when a body is JSON (a JSON content type and a non-empty body) and calls the request's
`json()`; here that is the strict decoder, so a route of these routers cannot read a body any other way
(`tests/test_bad_input.py` sends every JSON route of the OpenAPI description bodies it must refuse).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from metaagent.request_json import read_request_json


class StrictJsonRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_strict_json"):
            self._strict_json = await read_request_json(await self.body())
        return self._strict_json


class StrictJsonRoute(APIRoute):
    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def strict_handler(request: Request) -> Response:
            return await handler(StrictJsonRequest(request.scope, request.receive))

        return strict_handler
