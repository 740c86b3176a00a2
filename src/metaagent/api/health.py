"""`/health` (open to probes, even with API keys) and `/metrics` (Prometheus text).

Until the start-up checks have run once (`started`), `/health` answers 503 `{"status": "starting"}` to
every caller. With API keys, a request to `/health` without a key gets only `{"status"}`; a key's caller gets the
checks, with counts of its own work; an operator's key (and a service without keys, whose one caller
owns everything) also gets the service-wide counts. `/metrics`, all service-wide, needs an operator's key.
"""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import JSONResponse, Response

from metaagent import __version__
from metaagent.access import caller_of
from metaagent.api.body import StrictJsonRoute
from metaagent.api.deps import services
from metaagent.errors import Forbidden
from metaagent.sandbox.engine import Engine, EngineUnavailable
from metaagent.services import Services
from metaagent.tenancy import Caller, visible_to

router = APIRouter(tags=["service"], route_class=StrictJsonRoute)


@router.get(
    "/health",
    summary="Liveness and the state of each dependency",
    responses={503: {"description": 'Starting: a start-up check has not run yet (`{"status": "starting"}`)'}},
)
async def health(request: Request) -> Any:
    svc, caller = services(request), caller_of(request)
    if not started(svc):  # no check is reported, failed or ok, before it has run
        return JSONResponse({"status": "starting"}, status_code=503)
    checks = await _checks(svc, caller)
    status = "ok" if all(c["ok"] for c in checks.values()) else "degraded"
    if request.app.state.keys and caller.key_id is None:  # a probe without a key: the status alone
        return {"status": status}
    return {"status": status, "version": __version__, "checks": checks}


def started(svc: Services) -> bool:
    """Whether every check that runs once after start-up has run: the image looked for, and the isolation
    runtime chosen by its self-test (or its choice put off: no engine, no image). The others run live."""
    return svc.image.checked and svc.interpreter.runtime.has_run


async def _checks(svc: Services, caller: Caller) -> dict[str, Any]:
    """Every check; the service-wide counts (others' work) only for an operator or a service without keys."""
    whole_service = caller.key_id is None or caller.operator
    executions: dict[str, Any] = {"ok": True, "capacity": svc.interpreter.admission.capacity}
    pool = svc.interpreter.pool
    warm_pool: dict[str, Any] = {
        "ok": True,
        "floor": pool.limits.floor,
        "ceiling": pool.limits.ceiling,
        "memory_budget_mb": pool.limits.memory_budget_mb,
    }
    if whole_service:
        executions |= {"running": svc.interpreter.admission.running, "queued": svc.interpreter.admission.waiting}
        # `size` is the target now: it follows demand between floor and ceiling.
        warm_pool |= {"ready": pool.ready, "size": pool.size, "served": pool.served}
    else:  # a tenant's own work only
        executions["yours"] = len(visible_to(caller, svc.executions.all(), lambda e: e.caller))
    return {
        "egress_allowlist": {"ok": True, "patterns": len(svc.allowlist)},
        "container_engine": {
            **await _engine_check(svc.engine),
            # The isolation runtime in force (null until its self-test has run) and why it is that one.
            "runtime": runtime.runtime.name if (runtime := svc.interpreter.runtime).runtime else None,
            "runtime_reason": runtime.reason,
        },
        "sandbox_image": {
            "ok": svc.image.image_id is not None,
            "tag": svc.image.tag,
            "building": svc.image.building,
            **({"error": svc.image.error} if svc.image.error else {}),
        },
        "executions": executions,
        "warm_pool": warm_pool,
        # The service's own background tasks (warm pool, sessions, their reaper): not ok while one is not
        # running (it failed and waits to be restarted), which it names.
        "background_tasks": svc.background_tasks.check(),
    }


# An explicit route: mounting prometheus-client's ASGI app would redirect /metrics to /metrics/.
@router.get("/metrics", include_in_schema=False)
async def metrics(request: Request) -> Response:
    caller = caller_of(request)
    if request.app.state.keys and not caller.operator:
        raise Forbidden(
            "GET /metrics shows the whole service's figures, so it needs an operator's key "
            "(name:key:admin in METAAGENT_API_KEYS); GET /health shows a tenant's own"
        )
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _engine_check(engine: Engine) -> dict[str, Any]:
    try:
        with anyio.fail_after(3):
            await engine.ping()
    except (EngineUnavailable, TimeoutError) as exc:
        message = exc.message if isinstance(exc, EngineUnavailable) else "the container engine did not answer in 3 s"
        return {"ok": False, "error": message}
    return {"ok": True}
