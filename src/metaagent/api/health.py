"""`/health` (open to probes, even with API keys) and `/metrics` (Prometheus text).

Until the start-up checks have run once (`started`), `/health` answers 503 `{"status": "starting"}` to
every caller. With API keys, a request to `/health` without a key gets only `{"status"}`; a key's caller gets the
checks, with counts of its own work; an operator's key (and a service without keys, whose one caller
owns everything) also gets the service-wide counts. `/metrics`, all service-wide, needs an operator's key.

Each served language has an image and a warm pool (a lane of the code interpreter). `sandbox_image` and
`warm_pool` keep JavaScript's at their top level, as before there were lanes, and list every served
language's under `languages` (JavaScript's again among them). The service is degraded while any
served language's image is not there (its requests answer 503), even when JavaScript's is.
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
from metaagent.fleet.state import LocalState, SharedState, SharedStateUnavailable
from metaagent.languages import JAVASCRIPT
from metaagent.sandbox.engine import Engine, EngineUnavailable
from metaagent.services import Services
from metaagent.tenancy import Caller, visible_to
from metaagent.tools.code_interpreter import Lane

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
    images_ok = all(image["ok"] for image in checks["sandbox_image"]["languages"].values())
    status = "ok" if images_ok and all(c["ok"] for c in checks.values()) else "degraded"
    if request.app.state.keys and caller.key_id is None:  # a probe without a key: the status alone
        return {"status": status}
    return {"status": status, "version": __version__, "checks": checks}


def started(svc: Services) -> bool:
    """Whether every check that runs once after start-up has run: every served language's image looked
    for, and the isolation runtime chosen by its self-test (or its choice put off: no engine, no image).
    The others run live."""
    lanes = svc.interpreter.lanes.values()
    return all(lane.image.checked for lane in lanes) and svc.interpreter.runtime.has_run


async def _checks(svc: Services, caller: Caller) -> dict[str, Any]:
    """Every check; the service-wide counts (others' work) only for an operator or a service without keys."""
    whole_service = caller.key_id is None or caller.operator
    executions: dict[str, Any] = {"ok": True, "capacity": svc.interpreter.admission.capacity}
    if whole_service:
        executions |= {"running": svc.interpreter.admission.running, "queued": svc.interpreter.admission.waiting}
    else:  # a tenant's own work only
        executions["yours"] = len(visible_to(caller, svc.executions.all(), lambda e: e.caller))
    lanes = svc.interpreter.lanes
    images = {name: _image_check(lane) for name, lane in lanes.items()}
    pools = {name: _pool_check(lane, whole_service) for name, lane in lanes.items()}
    return {
        "egress_allowlist": {"ok": True, "patterns": len(svc.allowlist)},
        "container_engine": {
            **await _engine_check(svc.engine),
            # The isolation runtime in force (null until its self-test has run) and why it is that one.
            "runtime": runtime.runtime.name if (runtime := svc.interpreter.runtime).runtime else None,
            "runtime_reason": runtime.reason,
        },
        # JavaScript's at the top level (as before lanes), every served language's under `languages`.
        "sandbox_image": {**images[JAVASCRIPT.name], "languages": images},
        "executions": executions,
        "warm_pool": {**pools[JAVASCRIPT.name], "languages": pools},
        # The service's own background tasks (warm pool, sessions, their reaper): not ok while one is not
        # running (it failed and waits to be restarted), which it names.
        "background_tasks": svc.background_tasks.check(),
        "fleet": await _fleet_check(svc.fleet, whole_service),
    }


async def _fleet_check(fleet: SharedState, whole_service: bool) -> dict[str, Any]:
    """One machine (state in memory), or this replica's node in a fleet and whether Redis answers; the
    live replicas' count for an operator (or a service without keys)."""
    if isinstance(fleet, LocalState):
        return {"ok": True, "shared_state": "memory"}
    check: dict[str, Any] = {"ok": True, "shared_state": "redis", "node_id": fleet.node_id}
    try:
        with anyio.fail_after(3):
            nodes = await fleet.nodes()
    except (SharedStateUnavailable, TimeoutError) as exc:
        message = exc.message if isinstance(exc, SharedStateUnavailable) else "Redis did not answer in 3 s"
        return {**check, "ok": False, "error": message}
    if whole_service:
        check["replicas"] = len(nodes)
    return check


def _image_check(lane: Lane) -> dict[str, Any]:
    image = lane.image
    return {
        "ok": image.image_id is not None,
        "tag": image.tag,
        "building": image.building,
        **({"error": image.error} if image.error else {}),
    }


def _pool_check(lane: Lane, whole_service: bool) -> dict[str, Any]:
    pool = lane.pool
    check: dict[str, Any] = {
        "ok": True,
        "floor": pool.limits.floor,
        "ceiling": pool.limits.ceiling,
        "memory_budget_mb": pool.limits.memory_budget_mb,  # this lane's share of the service's budget
    }
    if whole_service:  # `size` is the target now: it follows demand between floor and ceiling.
        check |= {"ready": pool.ready, "size": pool.size, "served": pool.served}
        # What a start costs here and how many a second the machine sustains (null before the first start).
        rate = pool.start_cost.rate()
        check["starts"] = None if rate is None else rate.as_dict()
    return check


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
