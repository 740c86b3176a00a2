"""The HTTP service: `create_app(settings)` builds it; nothing starts until the lifespan runs."""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from metaagent import __version__, metrics
from metaagent.access import ExecutionQuota, KeyRing, RequireApiKey, current_caller
from metaagent.audit import AuditLog
from metaagent.body_limit import LimitRequestBody
from metaagent.egress.allowlist import AllowList
from metaagent.egress.guard import EgressGuard
from metaagent.errors import AtCapacity, ClientGone, MetaAgentError, describe_validation_errors
from metaagent.executions import ExecutionInfo, ExecutionList, ExecutionRegistry, KillResult
from metaagent.mcp_server import build_server, mount_mcp
from metaagent.packages.install import check_registry
from metaagent.packages.policy import PackagePolicy
from metaagent.packages.store import PackageStore, package_store
from metaagent.sandbox.engine import Engine, EngineUnavailable
from metaagent.sandbox.network import NetworkLimits, SandboxNetwork, read_extra_ca_certs
from metaagent.sandbox.pool import WarmPool
from metaagent.sandbox.provision import SandboxImage
from metaagent.services import Services
from metaagent.settings import Settings
from metaagent.tools import ToolSpec
from metaagent.tools.code_interpreter import CodeInterpreter, CodeInterpreterRequest, CodeInterpreterResponse
from metaagent.tools.embeddings import EMBEDDINGS, EmbeddingsTool
from metaagent.tools.http import HttpRequest, HttpResponse, HttpTool
from metaagent.tools.search import SEARCH, SearchTool

log = logging.getLogger("metaagent")

EMPTY_ALLOWLIST_WARNING = (
    "ALLOW_HTTP_HOSTS is empty: every outbound request is blocked. "
    'Set it to a JSON array of hosts, e.g. ALLOW_HTTP_HOSTS=\'["api.openai.com", "*.example.com"]\''
)


async def _invoke_http(svc: Services, request: HttpRequest) -> HttpResponse:
    return await svc.http(request)


async def _invoke_code_interpreter(svc: Services, request: CodeInterpreterRequest) -> CodeInterpreterResponse:
    return await metrics.observe_execution(_execute_as_caller(svc, request))


async def _execute_as_caller(svc: Services, request: CodeInterpreterRequest) -> CodeInterpreterResponse:
    caller = current_caller()  # the API key's id, set by the access check
    with svc.execution_quota.hold(caller):
        return await svc.interpreter(request, caller=caller)


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(
        "http", "/tools/http", HttpRequest, HttpResponse, "Make an HTTP request to an allow-listed host", _invoke_http
    ),
    ToolSpec(
        "code_interpreter",
        "/tools/code-interpreter",
        CodeInterpreterRequest,
        CodeInterpreterResponse,
        "Run JavaScript in a fresh, isolated container",
        _invoke_code_interpreter,
        error_statuses=(400, 422, 429, 502, 503, 504),
    ),
    SEARCH,
    EMBEDDINGS,
)


def services(request: Request) -> Services:
    found: Services = request.app.state.services
    return found


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    allowlist = AllowList.parse(settings.allow_http_hosts)  # validation only: a ConfigError stops start-up
    keys = KeyRing.from_settings(settings)  # read once; only their hashes are kept
    package_policy = PackagePolicy.parse(settings.npm_allowed_packages)
    check_registry(settings.npm_registry)
    extra_ca_pem = read_extra_ca_certs(settings.sandbox_extra_ca_certs)

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
        engine = Engine()
        image = SandboxImage(engine, tag=settings.sandbox_image, cache_dir=settings.sandbox_cache_dir)
        executions = ExecutionRegistry()
        for entry in package_policy.blocked_entries:
            log.warning("METAAGENT_NPM_ALLOWED_PACKAGES lists %s, which is on the block list: it stays refused", entry)
        packages = package_store(settings, package_policy, engine, audit)
        interpreter = CodeInterpreter(
            engine,
            image,
            executions,
            audit,
            capacity=settings.effective_concurrency(os.cpu_count() or 1),
            queue_size=settings.execution_queue_size,
            cpus=settings.sandbox_cpus,
            grace_s=settings.kill_grace_s,
            pool_size=settings.effective_pool_size(os.cpu_count() or 1),
            packages=packages,
            network=SandboxNetwork(
                engine,
                guard,
                NetworkLimits(settings.sandbox_max_tunnels, settings.sandbox_max_tunnel_bytes),
                extra_ca_pem,
            ),
        )
        search, embeddings = SearchTool(guard, settings), EmbeddingsTool(guard, settings)
        metrics.watch_admission(interpreter.admission)
        metrics.watch_pool(interpreter.pool)
        app.state.services = Services(
            settings,
            allowlist,
            audit,
            guard,
            http,
            engine,
            image,
            executions,
            interpreter,
            search,
            embeddings,
            ExecutionQuota(settings.max_executions_per_key),
        )
        app.state.stop_executions = functools.partial(_begin_stop, interpreter, executions)
        async with anyio.create_task_group() as background:
            background.start_soon(_prepare_sandbox, engine, image, interpreter.pool, settings.sandbox_build_on_start)
            try:
                async with mcp_sessions.run():
                    yield
            finally:
                await _stop_executions(interpreter, executions)
                with anyio.move_on_after(30):
                    await interpreter.pool.stopped.wait()
                await _remove_package_volumes(packages)
                await http.aclose()
                await search.aclose()
                await embeddings.aclose()
                engine.close()
                # Last: cancelling this task group's scope also cancels every await above in this task.
                background.cancel_scope.cancel()

    app = FastAPI(
        title="MetaAgent tools",
        version=__version__,
        description="Tools for AI agents that cannot endanger the machine they run on.",
        lifespan=lifespan,
    )
    _install_error_handlers(app)
    app.state.keys = keys
    # Outermost last: the key check runs first, so a caller without a key gets a 401 before any body is read.
    app.add_middleware(LimitRequestBody, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(RequireApiKey, keys=keys)
    metrics.add_route(app)

    for spec in TOOLS:
        _add_tool_route(app, spec)
    app.state.mcp_server = build_server(TOOLS, lambda: app.state.services)
    mcp_sessions = mount_mcp(app, app.state.mcp_server, settings.mcp_allowed_hosts)

    @app.get("/executions", tags=["executions"], summary="Every execution still running")
    async def list_executions(request: Request) -> ExecutionList:
        return ExecutionList(executions=[e.info() for e in services(request).executions.all()])

    @app.get(
        "/executions/{execution_id}",
        tags=["executions"],
        summary="One running execution",
        responses=_error_responses(404),
    )
    async def get_execution(execution_id: str, request: Request) -> ExecutionInfo:
        return services(request).executions.get(execution_id).info()

    @app.delete(
        "/executions/{execution_id}",
        tags=["executions"],
        summary="Kill a running execution now",
        responses=_error_responses(404),
    )
    async def kill_execution(execution_id: str, request: Request) -> KillResult:
        return services(request).executions.kill(execution_id)

    @app.get("/health", tags=["service"], summary="Liveness and the state of each dependency")
    async def health(request: Request) -> dict[str, Any]:
        svc = services(request)
        checks: dict[str, Any] = {
            "egress_allowlist": {"ok": True, "patterns": len(svc.allowlist)},
            "container_engine": await _engine_check(svc.engine),
            "sandbox_image": {
                "ok": svc.image.image_id is not None,
                "tag": svc.image.tag,
                "building": svc.image.building,
                **({"error": svc.image.error} if svc.image.error else {}),
            },
            "executions": {
                "ok": True,
                "running": svc.interpreter.admission.running,
                "queued": svc.interpreter.admission.waiting,
                "capacity": svc.interpreter.admission.capacity,
            },
            "warm_pool": {
                "ok": True,
                "ready": svc.interpreter.pool.ready,
                "size": svc.interpreter.pool.size,
                "served": svc.interpreter.pool.served,
            },
        }
        status = "ok" if all(c["ok"] for c in checks.values()) else "degraded"
        return {"status": status, "version": __version__, "checks": checks}

    @app.get("/tools", tags=["service"], summary="The tools, as OpenAI-style function schemas")
    async def list_tools() -> dict[str, Any]:
        return {"tools": [spec.function_schema() for spec in TOOLS]}

    return app


async def _prepare_sandbox(engine: Engine, image: SandboxImage, pool: WarmPool, build: bool) -> None:
    """Removes what a dead service left, makes sure of the image, then keeps the warm pool filled."""
    try:
        removed = await engine.remove_orphans()
    except EngineUnavailable as exc:
        log.warning("%s", exc.message)
    else:
        if removed:
            log.warning("removed %d container(s) or volume(s) of a service that stopped without cleaning up", removed)
        await image.refresh(build=build)
    await pool.run()


def _begin_stop(interpreter: CodeInterpreter, executions: ExecutionRegistry) -> None:
    """Refuses new executions, empties the warm pool and asks every running one to be killed."""
    interpreter.close()
    executions.kill_all()


async def _stop_executions(interpreter: CodeInterpreter, executions: ExecutionRegistry) -> None:
    """Stops new work, kills every running execution and waits (bounded) for their containers to go."""
    _begin_stop(interpreter, executions)
    with anyio.move_on_after(30):
        await executions.wait_empty()


async def _remove_package_volumes(packages: PackageStore) -> None:
    with anyio.move_on_after(30):
        try:
            await packages.close()
        except EngineUnavailable as exc:
            log.warning("package volumes were not removed: %s", exc.message)


async def _engine_check(engine: Engine) -> dict[str, Any]:
    try:
        with anyio.fail_after(3):
            await engine.ping()
    except (EngineUnavailable, TimeoutError) as exc:
        message = exc.message if isinstance(exc, EngineUnavailable) else "the container engine did not answer in 3 s"
        return {"ok": False, "error": message}
    return {"ok": True}


def _add_tool_route(app: FastAPI, spec: ToolSpec) -> None:
    """`POST <spec.path>`: the body is validated by the tool's request model, the answer is its response model."""

    async def endpoint(body: BaseModel, request: Request) -> BaseModel:
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
        message, details = describe_validation_errors(exc.errors())
        return JSONResponse({"error": message, "details": details}, status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail)
        # FastAPI's body parser says only "There was an error parsing the body"; its cause says what to fix.
        if isinstance(exc.__cause__, UnicodeDecodeError):
            message = f"The request body is not valid UTF-8 ({exc.__cause__.reason}); send JSON encoded as UTF-8"
        elif isinstance(exc.__cause__, RecursionError):
            message = "The request body nests arrays or objects too deeply to parse; send flatter JSON"
        return JSONResponse({"error": message}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def on_unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unexpected error", exc_info=exc)
        return JSONResponse({"error": "Internal error; the service log has the details"}, status_code=500)
