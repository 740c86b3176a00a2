"""`/executions`: the executions still running, one of them, and killing one."""

from __future__ import annotations

from fastapi import APIRouter, Request

from metaagent.api.deps import services
from metaagent.api.errors import error_responses
from metaagent.executions import ExecutionInfo, ExecutionList, KillResult

router = APIRouter(prefix="/executions", tags=["executions"])


@router.get("", summary="Every execution still running")
async def list_executions(request: Request) -> ExecutionList:
    return ExecutionList(executions=[e.info() for e in services(request).executions.all()])


@router.get("/{execution_id}", summary="One running execution", responses=error_responses(404))
async def get_execution(execution_id: str, request: Request) -> ExecutionInfo:
    return services(request).executions.get(execution_id).info()


@router.delete("/{execution_id}", summary="Kill a running execution now", responses=error_responses(404))
async def kill_execution(execution_id: str, request: Request) -> KillResult:
    return services(request).executions.kill(execution_id)
