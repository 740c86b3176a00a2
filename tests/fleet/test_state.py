"""The fleet's shared state: the same answers from memory and from a real Redis server, admissions that
two replicas cannot both win, leases that die with their replica, and a Redis that forgets everything."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest
from redis.asyncio import Redis

from metaagent.fleet.state import PREFIX, LocalState, RedisState, SharedState, SharedStateUnavailable
from tests.redis_server import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
async def replicas(redis_server: RedisServer) -> AsyncIterator[Callable[..., RedisState]]:
    """Replicas' states over the test's Redis; each started (its first beat) and closed after the test."""
    made: list[RedisState] = []

    def replica(node_id: str | None = None, lost_after_s: float = 20.0) -> RedisState:
        node_id = node_id or uuid.uuid4().hex[:8]
        state = RedisState(redis_server.url, node_id, f"http://{node_id}.test", lost_after_s=lost_after_s)
        made.append(state)
        return state

    yield replica
    for state in made:
        await state.close()


async def _each(kind: str, replicas: Callable[..., RedisState]) -> SharedState:
    if kind == "memory":
        return LocalState()
    state = replicas()
    await state.start()
    return state


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_admission_holds_the_key_share_and_the_total(kind: str, replicas: Callable[..., RedisState]) -> None:
    state = await _each(kind, replicas)
    assert (await state.acquire("sessions", "a1", "alice", per_key=2, total=3)).admitted
    assert (await state.acquire("sessions", "a2", "alice", per_key=2, total=3)).admitted
    refused = await state.acquire("sessions", "a3", "alice", per_key=2, total=3)
    assert (refused.admitted, refused.refused, refused.mine, refused.total) == (False, "per_key", 2, 2)
    assert (await state.acquire("sessions", "b1", "bob", per_key=2, total=3)).admitted
    full = await state.acquire("sessions", "b2", "bob", per_key=2, total=3)
    assert (full.admitted, full.refused, full.mine, full.total) == (False, "total", 1, 3)
    assert (await state.acquire("executions", "e1", "bob", per_key=1, total=None)).admitted  # pools apart
    await state.release("sessions", "a1")
    assert (await state.acquire("sessions", "b2", "bob", per_key=2, total=3)).admitted
    # An operator's key (no share) counts toward the total only; the one caller of a service without keys
    # has a share as a key does.
    assert not (await state.acquire("sessions", "op", "root", per_key=None, total=3)).admitted
    await state.release("sessions", "b2")
    assert (await state.acquire("sessions", "op", "root", per_key=None, total=3)).admitted
    await state.release("sessions", "op")
    assert (await state.acquire("executions", "l1", None, per_key=1, total=None)).admitted
    local = await state.acquire("executions", "l2", None, per_key=1, total=None)
    assert (local.admitted, local.refused, local.mine) == (False, "per_key", 1)


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_records_are_placed_listed_and_withdrawn(kind: str, replicas: Callable[..., RedisState]) -> None:
    state = await _each(kind, replicas)
    await state.publish("session", "ses_1", "alice", {"language": "python"})
    placed = await state.place("session", "ses_1")
    assert placed is not None
    assert (placed.node_id, placed.owner, placed.data, placed.lost) == (
        state.node_id,
        "alice",
        {"language": "python"},
        False,
    )
    assert [p.record_id for p in await state.listing("session")] == ["ses_1"]
    assert await state.listing("execution") == []
    await state.withdraw("session", "ses_1")
    assert await state.place("session", "ses_1") is None
    await state.bury("ses_1", "alice", "killed", keep_s=60)
    tombstone = await state.tombstone("ses_1")
    assert tombstone is not None
    assert (tombstone.owner, tombstone.reason) == ("alice", "killed")
    assert await state.tombstone("ses_2") is None


async def test_two_replicas_admitting_at_once_never_exceed_the_total(replicas: Callable[..., RedisState]) -> None:
    a, b = replicas("a"), replicas("b")
    await a.start()
    await b.start()
    admitted: list[str] = []

    async def take(state: RedisState, lease: str) -> None:
        if (await state.acquire("sessions", lease, f"key{int(lease[1:]) % 3}", per_key=4, total=10)).admitted:
            admitted.append(lease)

    async with anyio.create_task_group() as group:
        for n in range(40):
            group.start_soon(take, a if n % 2 else b, f"{'ab'[n % 2]}{n}")
    assert len(admitted) == 10
    by_key = {k: sum(1 for lease in admitted if int(lease[1:]) % 3 == k) for k in range(3)}
    assert max(by_key.values()) <= 4


async def test_a_lost_replicas_leases_come_back_and_its_records_are_lost(
    redis_server: RedisServer, replicas: Callable[..., RedisState]
) -> None:
    # No beat runs here, so a short lost_after_s would let `dead`'s heartbeat expire before the refusal
    # below on a slow machine; its heartbeat lasts the whole test instead, and the test ends it itself.
    dead, alive = replicas("dead"), replicas("alive")
    await dead.start()
    await alive.start()
    assert (await dead.acquire("sessions", "d1", "alice", per_key=1, total=1)).admitted
    await dead.publish("session", "ses_d", "alice", {})
    assert not (await alive.acquire("sessions", "a1", "alice", per_key=1, total=1)).admitted
    # `dead` stops beating (it does not close: a kill -9 leaves its keys as they are) and its heartbeat
    # expires: the key that RedisState.beat sets with lost_after_s as its time to live goes.
    async with Redis.from_url(redis_server.url) as redis:
        assert await redis.delete(f"{PREFIX}node:{dead.node_id}") == 1
    with anyio.fail_after(60):  # a bound: alive's view of the replicas is at most REPLICAS_FRESH_S old
        while (placed := await alive.place("session", "ses_d")) is not None and not placed.lost:  # noqa: ASYNC110 - another replica's view, which no event here signals
            await anyio.sleep(0.05)
    assert placed is not None
    assert placed.lost
    assert await alive.listing("session") == []
    assert (await alive.acquire("sessions", "a1", "alice", per_key=1, total=1)).admitted


async def test_a_redis_that_forgot_everything_gets_it_back_from_the_replicas(
    redis_server: RedisServer, replicas: Callable[..., RedisState]
) -> None:
    a, b = replicas("a"), replicas("b")
    await a.start()
    await b.start()
    assert (await a.acquire("sessions", "s1", "alice", per_key=1, total=2)).admitted
    assert (await a.acquire("sessions", "s2", "bob", per_key=1, total=2)).admitted
    await a.publish("session", "ses_a", "alice", {})
    redis_server.stop()
    with pytest.raises(SharedStateUnavailable, match="retry in a few seconds"):
        await b.acquire("sessions", "b1", "carol", per_key=1, total=2)
    await a.release("sessions", "s2")  # never raises: removed at the next beat instead
    redis_server.start()  # empty: a server without persistence
    await a.beat()
    await b.beat()
    assert [p.record_id for p in await b.listing("session")] == ["ses_a"]
    assert (await b.acquire("sessions", "b1", "carol", per_key=1, total=2)).admitted  # s2 is released
    refused = await b.acquire("sessions", "b2", "dave", per_key=1, total=2)
    assert (refused.refused, refused.total) == ("total", 2)
    assert await b.nodes() == {"a": "http://a.test", "b": "http://b.test"}


async def test_an_admission_whose_answer_is_lost_gives_its_lease_back(replicas: Callable[..., RedisState]) -> None:
    """The script took the lease, and then the answer never came (a timeout, a cancelled request): the
    lease must not stay in Redis, held by nobody, for the life of the replica."""
    state = replicas("a")
    await state.start()
    real_call = state._call

    async def answer_lost(what: str, operation: Any) -> Any:
        if what == "admission":
            await operation  # it ran in Redis
            raise SharedStateUnavailable("lost on the way back")
        return await real_call(what, operation)

    state._call = answer_lost  # type: ignore[method-assign]
    with pytest.raises(SharedStateUnavailable):
        await state.acquire("sessions", "lost", "alice", per_key=1, total=1)
    state._call = real_call  # type: ignore[method-assign]
    assert (await state.acquire("sessions", "next", "alice", per_key=1, total=1)).admitted


async def test_a_lost_replicas_records_are_pruned_and_its_sessions_keep_their_410(
    replicas: Callable[..., RedisState],
) -> None:
    dead, alive = replicas("dead", lost_after_s=0.5), replicas("alive")
    await dead.start()
    await alive.start()
    await dead.publish("session", "ses_d", "alice", {})
    await dead.publish("execution", "exe_d", "alice", {})
    with anyio.fail_after(10):
        while not (await alive.place("session", "ses_d")).lost:  # type: ignore[union-attr]  # noqa: ASYNC110 - another replica's view
            await anyio.sleep(0.05)
    await alive._prune_lost()
    alive._places.clear()  # what another replica, which never looked, would find
    assert await alive.place("session", "ses_d") is None
    assert await alive.place("execution", "exe_d") is None
    tombstone = await alive.tombstone("ses_d")
    assert tombstone is not None
    assert (tombstone.owner, tombstone.reason) == ("alice", "node_lost")
