"""The HTTP service: `create_app(settings)` builds it; nothing starts until the lifespan runs."""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from metaagent import __version__
from metaagent.audit import AuditLog
from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard
from metaagent.errors import AtCapacity, MetaAgentError
from metaagent.services import Services
from metaagent.settings import Settings
from metaagent.tools import ToolSpec
from metaagent.tools.http import HttpRequest, HttpResponse, HttpTool

log = logging.getLogger("metaagent")

EMPTY_ALLOWLIST_WARNING = (
    "ALLOW_HTTP_HOSTS is empty: every outbound request is blocked. "
    'Set it to a JSON array of hosts, e.g. ALLOW_HTTP_HOSTS=\'["api.openai.com", "*.example.com"]\''
)


async def _invoke_http(svc: Services, request: HttpRequest) -> HttpResponse:
    return await svc.http(request)


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "http", "/tools/http", HttpRequest, HttpResponse, "Make an HTTP request to an allow-listed host", _invoke_http
    ),
)


def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    allowlist = AllowList.parse(settings.allow_http_hosts)  # validation only: a ConfigError stops start-up

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not allowlist:
            log.warning(EMPTY_ALLOWLIST_WARNING)
        audit = AuditLog(settings.audit_log)
        guard = EgressGuard(allowlist, allow_private_networks=settings.allow_private_networks, audit=audit)
        http = HttpTool(
            guard,
            max_response_bytes=settings.http_max_response_bytes,
            max_redirects=settings.http_max_redirects,
        )
        app.state.services = Services(settings, allowlist, audit, guard, http)
        try:
            yield
        finally:
            await http.aclose()

    app = FastAPI(
        title="MetaAgent tools",
        version=__version__,
        description="Tools for AI agents that cannot endanger the machine they run on.",
        lifespan=lifespan,
    )
    _install_error_handlers(app)

    for spec in TOOLS:
        _add_tool_route(app, spec)

    @app.get("/health", tags=["service"], summary="Liveness and the state of each dependency")
    async def health(request: Request) -> dict[str, Any]:
        svc = services(request)
        checks: dict[str, Any] = {
            "egress_allowlist": {"ok": True, "patterns": len(svc.allowlist)},
        }
        status = "ok" if all(c["ok"] for c in checks.values()) else "degraded"
        return {"status": status, "version": __version__, "checks": checks}

    @app.get("/tools", tags=["service"], summary="The tools, as OpenAI-style function schemas")
    async def list_tools() -> dict[str, Any]:
        return {"tools": [spec.function_schema() for spec in TOOLS]}

    return app


def _add_tool_route(app: FastAPI, spec: ToolSpec) -> None:
    """`POST <spec.path>`: the body is validated by the tool's request model, the answer is its response model."""

    async def endpoint(body: BaseModel, request: Request) -> BaseModel:
        return await spec.invoke(services(request), body)

    # FastAPI reads the body's type from the signature; the model differs per tool, so it is set here.
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # read by FastAPI
        [
            inspect.Parameter("body", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=spec.request_model),
            inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Request),
        ]
    )
    app.add_api_route(
        spec.path,
        endpoint,
        methods=["POST"],
        response_model=spec.response_model,
        tags=["tools"],
        summary=spec.summary,
        description=spec.description,
        operation_id=f"tool_{spec.name}",
        responses=_error_responses(*spec.error_statuses),
    )


def _error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    schema = {"type": "object", "properties": {"error": {"type": "string"}}, "required": ["error"]}
    return {s: {"description": "Error", "content": {"application/json": {"schema": schema}}} for s in statuses}


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(MetaAgentError)
    async def on_metaagent_error(_request: Request, exc: MetaAgentError) -> JSONResponse:
        headers = {"Retry-After": str(exc.retry_after_s)} if isinstance(exc, AtCapacity) else None
        if exc.status_code >= 500 and exc.status_code not in (502, 503, 504):
            log.error("internal error: %s", exc.message)
        return JSONResponse(exc.body(), status_code=exc.status_code, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        details = [
            {"field": ".".join(str(p) for p in e["loc"] if p != "body") or "body", "message": e["msg"]}
            for e in exc.errors()
        ]
        summary = "; ".join(f"{d['field']}: {d['message']}" for d in details[:5])
        return JSONResponse({"error": f"Invalid request: {summary}", "details": details}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": str(exc.detail)}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error", exc_info=exc)
        return JSONResponse({"error": "Internal error; the service log has the details"}, status_code=500)
