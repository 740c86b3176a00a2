"""`/health` (open to probes, even with API keys) and `/metrics` (Prometheus text)."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import APIRouter, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import Response

from metaagent import __version__
from metaagent.api.deps import services
from metaagent.sandbox.engine import Engine, EngineUnavailable

router = APIRouter(tags=["service"])


@router.get("/health", summary="Liveness and the state of each dependency")
async def health(request: Request) -> dict[str, Any]:
    svc = services(request)
    checks: dict[str, Any] = {
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
        "executions": {
            "ok": True,
            "running": svc.interpreter.admission.running,
            "queued": svc.interpreter.admission.waiting,
            "capacity": svc.interpreter.admission.capacity,
        },
        "warm_pool": {
            "ok": True,
            "ready": (pool := svc.interpreter.pool).ready,
            "size": pool.size,  # the target now: it follows demand between floor and ceiling
            "served": pool.served,
            "floor": pool.limits.floor,
            "ceiling": pool.limits.ceiling,
            "memory_budget_mb": pool.limits.memory_budget_mb,
        },
        # The service's own background tasks (warm pool, sessions, their reaper): not ok while one is not
        # running (it failed and waits to be restarted), which it names.
        "background_tasks": svc.supervisor.check(),
    }
    status = "ok" if all(c["ok"] for c in checks.values()) else "degraded"
    return {"status": status, "version": __version__, "checks": checks}


# An explicit route: mounting prometheus-client's ASGI app would redirect /metrics to /metrics/.
@router.get("/metrics", include_in_schema=False)
async def metrics() -> Response:
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)


async def _engine_check(engine: Engine) -> dict[str, Any]:
    try:
        with anyio.fail_after(3):
            await engine.ping()
    except (EngineUnavailable, TimeoutError) as exc:
        message = exc.message if isinstance(exc, EngineUnavailable) else "the container engine did not answer in 3 s"
        return {"ok": False, "error": message}
    return {"ok": True}
