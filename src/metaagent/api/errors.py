"""Every error answer is JSON `{"error": ...}`: the handlers that make it so, and its OpenAPI shape."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from metaagent.errors import AtCapacity, MetaAgentError, describe_validation_errors

log = logging.getLogger("metaagent")


class ErrorResponse(JSONResponse):
    """A JSON error answer that any message can be put in: a lone surrogate a caller or an upstream sent,
    quoted back, is written as its JSON escape instead of failing the answer (a 500)."""

    def render(self, content: Any) -> bytes:
        text = json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The OpenAPI `responses` entry for routes that may answer these error statuses."""
    schema = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
    return {s: {"description": "Error", "content": {"application/json": {"schema": schema}}} for s in statuses}


def error_status_and_body(exc: Exception) -> tuple[int, dict[str, Any]]:
    """The status and JSON body that answer `exc`: a MetaAgentError's own, else a 500 (logged, details kept back)."""
    if isinstance(exc, MetaAgentError):
        if exc.status_code >= 500 and exc.status_code not in (502, 503, 504, 507):
            log.error("internal error: %s", exc.message)
        return exc.status_code, exc.body()
    log.error("unexpected error", exc_info=exc)
    return 500, {"error": "Internal error; the service log has the details"}


def error_response(exc: Exception) -> JSONResponse:
    """The JSON answer to `exc`, as the handlers below give it (with `Retry-After` on a 429)."""
    status, body = error_status_and_body(exc)
    headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, AtCapacity) else None
    return ErrorResponse(body, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MetaAgentError)
    async def on_metaagent_error(_request: Request, exc: MetaAgentError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        message, details = describe_validation_errors(exc.errors())
        return ErrorResponse({"error": message, "details": details}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's body reader answers any failure of the JSON decoder with "There was an error parsing
        # the body" (400); the decoder's own refusal (metaagent.request_json, a 422 naming the field) is
        # its cause.
        if isinstance(exc.__cause__, MetaAgentError):
            return error_response(exc.__cause__)
        return ErrorResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)
