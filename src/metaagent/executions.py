"""The registry of executions still running: what `GET/DELETE /executions` show and stop."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Literal

import anyio
from pydantic import BaseModel

from metaagent.errors import NotFound
from metaagent.fleet.state import LocalState, SharedState
from metaagent.latch import Latch

State = Literal["starting", "running", "stopping"]


def new_execution_id() -> str:
    return f"exe_{secrets.token_hex(12)}"


class ExecutionInfo(BaseModel):
    execution_id: str
    container_id: str | None
    started_at: datetime
    timeout_s: int
    memory_mb: int
    state: State
    caller: str | None = None
    session_id: str | None = None


class ExecutionList(BaseModel):
    executions: list[ExecutionInfo]


class KillResult(BaseModel):
    execution_id: str
    killed: bool


@dataclass
class Execution:
    execution_id: str
    timeout_s: int
    memory_mb: int
    caller: str | None = None
    container_id: str | None = None
    session_id: str | None = None  # a call into a session
    state: State = "starting"
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    kill_requested: Latch = field(default_factory=Latch)

    def info(self) -> ExecutionInfo:
        return ExecutionInfo(
            execution_id=self.execution_id,
            container_id=self.container_id,
            started_at=self.started_at,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            state=self.state,
            caller=self.caller,
            session_id=self.session_id,
        )


class ExecutionRegistry:
    """This replica's running executions; each is also published in the fleet's shared state, which says
    to the other replicas that this one holds it."""

    def __init__(self, fleet: SharedState | None = None) -> None:
        self.fleet = fleet or LocalState()
        self._running: dict[str, Execution] = {}
        self._empty = anyio.Event()
        self._empty.set()

    async def add(self, execution: Execution) -> None:
        if not self._running:
            self._empty = anyio.Event()
        self._running[execution.execution_id] = execution
        await self.fleet.publish("execution", execution.execution_id, execution.caller, {})

    async def discard(self, execution: Execution) -> None:
        self._running.pop(execution.execution_id, None)
        if not self._running:
            self._empty.set()
        with anyio.CancelScope(shield=True):  # on the way out of a cancelled call too
            await self.fleet.withdraw("execution", execution.execution_id)

    async def wait_empty(self) -> None:
        await self._empty.wait()

    def get(self, execution_id: str) -> Execution:
        try:
            return self._running[execution_id]
        except KeyError:
            raise self.not_found(execution_id) from None

    @staticmethod
    def not_found(execution_id: str) -> NotFound:
        """The 404 of an id that is not running, also answered for another caller's (`metaagent.tenancy`)."""
        return NotFound(f"No running execution {execution_id!r}; it may have finished already")

    def all(self) -> list[Execution]:
        return list(self._running.values())

    def kill(self, execution_id: str) -> KillResult:
        self.get(execution_id).kill_requested.set()
        return KillResult(execution_id=execution_id, killed=True)

    def kill_all(self) -> None:
        for execution in self.all():
            execution.kill_requested.set()
