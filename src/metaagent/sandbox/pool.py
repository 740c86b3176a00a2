"""Warm containers: fresh, single-use sandboxes started ahead of demand.

Starting a container and node inside it is most of a small execution's latency. The pool pays that in
the background: each pooled container is created, attached and started with the production spec, and
its runner loads node and the module gate and then waits, idle, for the payload on stdin. An execution
takes one, hands it the code and removes it afterwards, exactly as on the cold path; nothing goes back
into the pool. So the pool changes when a container starts, never what runs in it or how often it is
used. An execution that finds the pool empty while a start is in flight waits for that container
(`take_or_wait`): it is nearer to ready than any cold start begun then.

How many containers it holds follows demand, within a floor, a ceiling and a memory budget: see
`metaagent.sandbox.sizing`. Every take, wait, miss and end is told to the sizer; the loop starts what the
target is missing, removes idle containers above it when it decays, and never holds more idle, starting
or being removed than the budget allows.
"""

from __future__ import annotations

import logging
import os
import select
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from metaagent import metrics
from metaagent.errors import Unavailable
from metaagent.executions import new_execution_id
from metaagent.sandbox.engine import ContainerSpec, Engine
from metaagent.sandbox.execute import Prepared, prepare, wait_ready
from metaagent.sandbox.provision import SandboxImage
from metaagent.sandbox.sizing import DECAY_STEP_S, DEMAND_WINDOW_S, PoolLimits, PoolSizer, StartCost

log = logging.getLogger("metaagent.pool")

# Container starts are CPU-bound in the engine; more in parallel would only slow the executions running.
PARALLEL_STARTS = 2
_MAX_BACKOFF_S = 5.0
# How long an execution that found the pool empty waits for a start in flight before it goes cold.
_TAKE_WAIT_S = 10.0


@dataclass(frozen=True)
class Warm:
    """A started container whose runner waits for its one payload, and the execution id it was made for."""

    execution_id: str
    spec: ContainerSpec
    prepared: Prepared


def _still_waiting(warm: Warm) -> bool:
    """A waiting runner writes nothing after its ready line; more output or EOF means it died."""
    poller = select.poll()  # not select(): a busy service has descriptors past FD_SETSIZE
    poller.register(warm.prepared.sock, select.POLLIN)
    return not poller.poll(0)


@dataclass(eq=False)
class _Taker:
    image_tag: str
    handed: anyio.Event = field(default_factory=anyio.Event)
    warm: Warm | None = None


class WarmPool:
    """Keeps warm containers of `make_spec`'s configuration while the service runs, as many as demand
    asks for within `limits` (`window_s`, `decay_s` and `clock`: see `PoolSizer`)."""

    def __init__(
        self,
        engine: Engine,
        image: SandboxImage,
        *,
        limits: PoolLimits,
        memory_mb: int,
        make_spec: Callable[[str, str], Awaitable[ContainerSpec]],
        window_s: float = DEMAND_WINDOW_S,
        decay_s: float = DECAY_STEP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine = engine
        self.image = image
        self.limits = limits
        self.memory_mb = memory_mb  # the one configuration served warm; other requests take the cold path
        idle_max = limits.memory_budget_mb // memory_mb
        self._sizer = PoolSizer(limits.floor, limits.ceiling, idle_max, window_s=window_s, decay_s=decay_s, clock=clock)
        self._make_spec = make_spec
        # What this machine's starts cost, from the pool's own: GET /health and the metrics report the pace.
        self.start_cost = StartCost(PARALLEL_STARTS, os.cpu_count() or 1)
        self._ready: deque[Warm] = deque()
        self._starting = 0
        self._removing = 0  # discarded or retired containers whose removal is under way: they still hold memory
        self._lent = 0  # taken by executions still running: replaced once they end (see `finished`)
        self._changed = anyio.Event()
        self._failures = 0
        self._retry_at = 0.0
        self._group: TaskGroup | None = None
        self._unremoved: set[str] = set()  # containers whose removal failed (engine down): retried
        self.closed = False
        self.stopped = anyio.Event()  # set once closed and empty
        self._running = False
        self.served = 0
        # Executions that found the pool empty while starts were in flight, in arrival order: each takes
        # the next container that becomes ready (at most one taker per start in flight).
        self._takers: deque[_Taker] = deque()

    @property
    def ready(self) -> int:
        return len(self._ready)

    @property
    def size(self) -> int:
        """The containers the pool aims to hold now, lent ones included: demand's target, within what the
        memory budget lets it hold besides the lent ones."""
        target = self._sizer.target(self._lent + len(self._takers))
        return min(target, self._lent + self._sizer.idle_max)

    def starts_per_second(self) -> float:
        """The pace of starts this machine sustains, from the pool's recent ones (0 before the first)."""
        rate = self.start_cost.rate()
        return 0.0 if rate is None else rate.per_second

    def _held(self) -> int:
        """The containers the pool itself holds, which the memory budget bounds (lent ones are not)."""
        return self.ready + self._starting + self._removing + len(self._unremoved)

    def take(self, image_tag: str) -> Warm | None:
        """A warm container for one execution, or None (the caller takes the cold path)."""
        warm = self._take_ready(image_tag)
        if warm is None:
            self._missed()
        return warm

    def _missed(self) -> None:
        """An execution that asked for a container goes cold: demand the pool may grow for."""
        self._sizer.left()
        self._wake()

    def _take_ready(self, image_tag: str) -> Warm | None:
        while self._ready and not self.closed:
            warm = self._ready.popleft()
            waiting = _still_waiting(warm)
            if warm.spec.image == image_tag and waiting:
                return self._lend(warm)
            if not waiting:
                metrics.pool_start_retry(self.image.language.name)
                self._discard(warm, died=True)
            else:
                self._discard(warm)  # an image rebuilt since
            self._wake()
        return None

    async def take_or_wait(self, image_tag: str) -> Warm | None:
        """`take`, or when the pool is empty but a container is starting, that container once it is ready.

        A start in flight is always nearer to ready than a cold start begun now (which would also
        compete with it for the CPU), so waiting for it is the faster path; if it fails, or takes longer
        than `_TAKE_WAIT_S`, the caller takes the cold path after all.
        """
        warm = self._take_ready(image_tag)
        if warm is not None:
            return warm
        if self.closed or len(self._takers) >= self._starting:
            self._missed()
            return None
        taker = _Taker(image_tag)
        self._takers.append(taker)
        self._wake()  # one more waiting: demand rises at once
        try:
            with anyio.move_on_after(_TAKE_WAIT_S):
                await taker.handed.wait()
        except BaseException:  # cancelled (the caller hung up): what it was handed goes back, unused
            if not taker.handed.is_set():
                self._takers.remove(taker)
            elif taker.warm is not None:
                self._give_back(taker.warm)
            self._sizer.left()
            raise
        if not taker.handed.is_set():  # waited long enough: the cold path
            self._takers.remove(taker)
        if taker.warm is None:
            self._missed()
        return taker.warm

    def _hand_over(self, warm: Warm) -> bool:
        """Gives a container that just became ready to the longest-waiting taker; False if none waits."""
        if not self._takers:
            return False
        taker = self._takers.popleft()
        if warm.spec.image == taker.image_tag:
            taker.warm = self._lend(warm)
        else:
            self._discard(warm)  # an image rebuilt since the start began: the taker goes cold
        taker.handed.set()
        return True

    def _lend(self, warm: Warm) -> Warm:
        """Counts a container handed to an execution (replaced once it ends, see `finished`)."""
        self.served += 1
        self._lent += 1
        return warm

    def _give_back(self, warm: Warm) -> None:
        """Undoes `_lend` for a container its taker never used."""
        self.served -= 1
        self._lent -= 1
        self._ready.appendleft(warm)
        self._wake()

    def _release_takers_beyond_starts(self) -> None:
        """Takers that no start in flight will serve (one failed, or the pool closed) go cold now."""
        while len(self._takers) > (0 if self.closed else self._starting):
            self._takers.pop().handed.set()

    def retire(self, container_id: str) -> bool:
        """Removes, in the background, a container an execution is done with (warm or cold), counted
        against the memory budget until it is gone; False when the pool is not running (the caller then
        removes it)."""
        if self._group is None:
            return False
        self._removing += 1
        self._group.start_soon(self._retire_container, container_id)
        return True

    def finished(self) -> None:
        """The execution on a taken container ended: its container no longer counts against the target.
        (Starts that demand asks for meanwhile run at a starting container's low CPU weight.)"""
        self._lent -= 1
        self._sizer.left()
        self._wake()

    async def run(self) -> None:
        """Refills the pool until `close`; removes the containers it still holds on the way out. Run
        again after a failure (the supervisor restarts it), it starts over with what the pool holds."""
        self._running = True
        if self.stopped.is_set() and not self.closed:
            self.stopped = anyio.Event()
        try:
            async with anyio.create_task_group() as group:
                self._group = group
                while not self.closed:
                    if self._unremoved and self._retry_at <= time.monotonic():
                        retry, self._unremoved = self._unremoved, set()
                        for container_id in retry:
                            self.retire(container_id)
                    self._trim()
                    missing = self._missing()
                    wait_s = self._retry_at - time.monotonic()
                    if wait_s <= 0 and missing > 0 and self._starting < PARALLEL_STARTS:
                        self._starting += 1
                        group.start_soon(self._add_one)
                        continue
                    # Asleep until something changes, the backoff ends or the target may step down.
                    waits = [s for s in (wait_s if wait_s > 0 else None, self._sizer.next_step_in()) if s is not None]
                    self._changed = anyio.Event()
                    with anyio.move_on_after(min(waits) if waits else None):
                        await self._changed.wait()
                # Starts in flight finish (and see `closed`): one cut off halfway would leave its container.
        finally:
            self._group = None  # its retirements are done: the group waited for them
            with anyio.CancelScope(shield=True):
                await self._drain()
            self.stopped.set()

    def close(self) -> None:
        """Stops refilling and hands out nothing more; `run` then removes what the pool holds."""
        self.closed = True
        self._release_takers_beyond_starts()
        self._wake()
        if not self._running:
            self.stopped.set()

    async def _add_one(self) -> None:
        try:
            warm = await self._start_one()
            if warm is not None and self.closed:
                await self._remove(warm)
            elif warm is not None and not self._hand_over(warm):
                self._ready.append(warm)
        finally:
            self._starting -= 1
            self._release_takers_beyond_starts()
            self._wake()

    async def _start_one(self) -> Warm | None:
        try:
            tag = await self.image.require()
            execution_id = new_execution_id()
            spec = await self._make_spec(execution_id, tag)
            began = time.monotonic()
            prepared = await prepare(self.engine, spec, start=True)
            try:
                ready = await wait_ready(prepared)
                if ready:
                    self.record_start(time.monotonic() - began, self.engine.cpu_control.used_s(prepared.container_id))
                    await prepared.limit_cpus(self.engine)  # idle at its limit, as every execution runs
            except BaseException:  # cancelled (a shutdown) while the runner started: nobody else knows it
                await self._remove(Warm(execution_id, spec, prepared))
                raise
            if not ready:  # a crash at start (no code was handed over): counted, and another is started
                metrics.pool_start_retry(self.image.language.name)
                how = await self._how_it_ended(prepared.container_id)
                await self._remove(Warm(execution_id, spec, prepared))
                await self.engine.remove_runtime_leftovers([prepared.container_id])  # a failed start's
                raise Unavailable(f"the runner did not start ({how}): {prepared.output.stderr.text()[:300]!r}")
        except Exception as exc:  # a background worker: whatever failed, back off and try again
            self._failures += 1
            self._retry_at = time.monotonic() + min(_MAX_BACKOFF_S, 0.25 * 2**self._failures)
            if self._failures == 1:
                reason = exc.message if isinstance(exc, Unavailable) else repr(exc)
                log.warning("the warm pool cannot start containers (%s); retrying in the background", reason)
            return None
        if self._failures:
            log.info("the warm pool is starting containers again")
        self._failures = 0
        return Warm(execution_id, spec, prepared)

    def record_start(self, wall_s: float, cpu_s: float | None) -> None:
        """One more start's cost, which also sets how long demand is counted over (`PoolSizer`)."""
        self.start_cost.record(wall_s, cpu_s)
        rate = self.start_cost.rate()
        if rate is not None:
            self._sizer.count_demand_over(rate.wall_s)

    async def _how_it_ended(self, container_id: str) -> str:
        """A failed start's exit, for the log: the stream ends a moment before the engine reports the exit."""
        try:
            with anyio.move_on_after(5):
                await self.engine.wait(container_id)
            state = await self.engine.state(container_id)
        except Unavailable:
            return "the engine did not say how it ended"
        if state.exit_code is None:
            return "still starting at the start timeout"
        return f"exit {state.exit_code}{', OOM-killed' if state.oom_killed else ''}"

    def _missing(self) -> int:
        """Starts the target and the memory budget want now (containers being removed still count)."""
        return self.size - self._held() - self._lent  # `size` already leaves the budget's room

    def _trim(self) -> None:
        """Removes the idle containers above a target that decayed (the newest: takes go oldest first).
        Starts in flight finish, and are removed once ready unless a taker wants them first."""
        surplus = self.ready + self._starting + self._lent - self.size
        for _ in range(min(surplus, self.ready)):
            self._discard(self._ready.pop())

    def _discard(self, warm: Warm, *, died: bool = False) -> None:
        if self._group is not None:
            self._removing += 1
            self._group.start_soon(self._retire, warm, died)

    async def _retire(self, warm: Warm, died: bool) -> None:
        """Removes a discarded container, counted as the pool's until it is gone."""
        try:
            await (self._remove_dead if died else self._remove)(warm)
        finally:
            self._removing -= 1
            self._wake()

    async def _retire_container(self, container_id: str) -> None:
        try:
            await self._remove_container(container_id)
        finally:
            self._removing -= 1
            self._wake()

    async def _remove_dead(self, warm: Warm) -> None:
        """A runner that ended while it waited: said in the log with how it ended, then removed (whatever
        happens to the telling: a shutdown that cancels it still removes the container)."""
        try:
            with anyio.move_on_after(2):  # what it wrote as it ended (nothing reads a waiting container's stream)
                while await warm.prepared.read_some():
                    pass
            how = await self._how_it_ended(warm.prepared.container_id)
            log.warning(
                "warm container %s: the runner ended while it waited (%s): %r",
                warm.prepared.container_id[:12],
                how,
                warm.prepared.output.stderr.text()[:300],
            )
        finally:
            await self._remove(warm)

    async def _remove(self, warm: Warm) -> None:
        warm.prepared.sock.close()
        await self._remove_container(warm.prepared.container_id)

    async def _remove_container(self, container_id: str) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.engine.remove(container_id)
            except Unavailable as exc:
                if not self._unremoved:
                    log.warning("could not remove warm container %s (%s); will retry", container_id[:12], exc.message)
                self._unremoved.add(container_id)
                self._retry_at = max(self._retry_at, time.monotonic() + 1.0)

    async def _drain(self) -> None:
        async with anyio.create_task_group() as group:
            while self._ready:
                group.start_soon(self._remove, self._ready.popleft())
            retry, self._unremoved = self._unremoved, set()
            for container_id in retry:
                group.start_soon(self._remove_container, container_id)

    def _wake(self) -> None:
        self._changed.set()
