"""`/executions`: the executions still running, one of them, and killing one; each caller sees its own.

The ownership rule is `metaagent.tenancy`'s: with API keys a caller lists, reads and kills only the
executions its key started (an operator's key: all of them), and another caller's id is the same 404 as
an id that never existed.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from metaagent.access import caller_of
from metaagent.api.body import StrictJsonRoute
from metaagent.api.deps import services
from metaagent.api.errors import error_responses
from metaagent.executions import Execution, ExecutionInfo, ExecutionList, ExecutionRegistry, KillResult
from metaagent.fleet.routing import forwarded
from metaagent.tenancy import check_access, visible_to

router = APIRouter(prefix="/executions", tags=["executions"], route_class=StrictJsonRoute)


def _owner(execution: Execution) -> str | None:
    return execution.caller


def _own_execution(request: Request, execution_id: str) -> tuple[ExecutionRegistry, Execution]:
    registry = services(request).executions
    execution = registry.get(execution_id)  # 404 when it is not running
    check_access(caller_of(request), execution, _owner(execution), lambda: registry.not_found(execution_id))
    return registry, execution


@router.get("", summary="Every execution of the caller still running")
async def list_executions(request: Request) -> ExecutionList:
    """In a fleet, every live replica's (this one asks the others for theirs)."""
    caller, svc = caller_of(request), services(request)
    mine = [e.info() for e in visible_to(caller, svc.executions.all(), _owner)]
    if svc.peers is not None and not forwarded(request):
        found = await svc.peers.gather("/executions", caller, "executions")
        mine += [ExecutionInfo.model_validate(item) for item in found]
    return ExecutionList(executions=mine)


@router.get("/{execution_id}", summary="One running execution", responses=error_responses(404))
async def get_execution(execution_id: str, request: Request) -> ExecutionInfo:
    return _own_execution(request, execution_id)[1].info()


@router.delete("/{execution_id}", summary="Kill a running execution now", responses=error_responses(404))
async def kill_execution(execution_id: str, request: Request) -> KillResult:
    registry, execution = _own_execution(request, execution_id)
    return registry.kill(execution.execution_id)
