"""The state replicas share: leases that count what each key holds, records of where each execution and
session lives, replicas' heartbeats, and ended sessions' reasons. One interface, two implementations.

- `LocalState` keeps it in memory: one machine, the default.
- `RedisState` keeps it in a Redis server (`METAAGENT_REDIS_URL`) that every replica shares.

A lease belongs to a replica. It counts only while its replica's heartbeat lives, so a replica that
dies (kill -9, a lost machine) gives its share back when its heartbeat expires, with nobody cleaning up
after it: every admission drops the leases of dead replicas before it counts. An admission counts and
takes in one Lua script, so two replicas admitting at once cannot both take the last place.

A replica is the truth about what it runs; Redis holds a copy. Each replica keeps its own leases and
records in memory, and whenever its heartbeat finds that Redis had forgotten it (its first beat, a
Redis restarted without persistence, a beat missed past `LOST_AFTER_S`), it writes them all back. So
nothing running is lost or killed because Redis blinked: while Redis is unreachable, new work is refused
(503) and what runs goes on; when it answers again, the fleet's view is whole again within a beat.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import anyio
from redis.asyncio import Redis
from redis.exceptions import RedisError

from metaagent.errors import Unavailable

log = logging.getLogger("metaagent")

HEARTBEAT_S = 5.0  # how often a replica says it is alive
LOST_AFTER_S = 20.0  # a replica silent this long is lost: its leases stop counting, its sessions answer 410
PREFIX = "metaagent:"
# A request for what another replica holds looks up where it is. A record never moves, so its place is
# kept once read (the last PLACES_KEPT): one withdrawn since is answered by its replica (its own 404 or
# 410), and one whose replica is gone is read again. Which replicas live is read again after
# REPLICAS_FRESH_S.
PLACES_KEPT = 10_000
REPLICAS_FRESH_S = 1.0
# Every this many beats a replica removes lost replicas' records; a lost session's 410 is kept this long.
PRUNE_EVERY_BEATS = 12
LOST_SESSION_KEEP_S = 2 * 3600
MAX_LOCAL_TOMBSTONES = 100_000

Kind = Literal["execution", "session", "mcp"]
Pool = Literal["executions", "sessions"]


class SharedStateUnavailable(Unavailable):
    """The shared state cannot be reached: new work is refused (503), what runs goes on."""


@dataclass(frozen=True)
class Admission:
    """What `acquire` found: whether the lease was taken, and what the key and everyone held before it."""

    admitted: bool
    mine: int
    total: int
    refused: Literal["per_key", "total"] | None = None


@dataclass(frozen=True)
class Placed:
    """Where a record lives: its replica, whether that replica is alive, and what it published."""

    record_id: str
    node_id: str
    node_url: str | None  # None: the replica is lost
    owner: str | None  # the key id of the caller it belongs to
    data: dict[str, Any]

    @property
    def lost(self) -> bool:
        return self.node_url is None


@dataclass(frozen=True)
class Replica:
    """A live replica: where it is reached, and the load it reported at its last heartbeat."""

    url: str
    load: dict[str, int]


@dataclass(frozen=True)
class Tombstone:
    owner: str | None
    reason: str


class SharedState(Protocol):
    """`acquire` takes a lease in `pool` for `key` (None: the one caller of a service without keys) if the key
    holds fewer than `per_key` (None: no share, an operator's key) and everyone fewer than `total` (None: no
    cap); `release` gives it back. Records say which replica holds an execution or a session; a tombstone
    keeps an ended session's reason for its 410."""

    node_id: str

    async def start(self) -> None: ...
    async def close(self) -> None: ...
    async def beat(self) -> None: ...
    async def acquire(
        self, pool: Pool, lease: str, key: str | None, *, per_key: int | None, total: int | None
    ) -> Admission: ...
    async def release(self, pool: Pool, lease: str) -> None: ...
    def holds(self, kind: Kind, record_id: str) -> bool: ...
    async def publish(self, kind: Kind, record_id: str, owner: str | None, data: Mapping[str, Any]) -> None:
        """Never raises: what Redis missed, the next beat writes back."""
        ...

    async def withdraw(self, kind: Kind, record_id: str) -> None: ...
    async def place(self, kind: Kind, record_id: str) -> Placed | None: ...
    async def listing(self, kind: Kind) -> list[Placed]: ...
    async def nodes(self) -> dict[str, str]: ...
    async def replicas(self) -> dict[str, Replica]: ...
    def forget_replicas(self) -> None:
        """Drops the live replicas read last, so that the next question reads them from Redis again."""
        ...

    async def bury(self, record_id: str, owner: str | None, reason: str, keep_s: float) -> None: ...
    async def tombstone(self, record_id: str) -> Tombstone | None: ...


class _Held:
    """What this replica holds, in memory: the truth that `RedisState` writes back after Redis forgot it,
    and the whole state of `LocalState`."""

    def __init__(self) -> None:
        self.leases: dict[Pool, dict[str, str]] = {"executions": {}, "sessions": {}}  # lease -> key ("" none)
        self.records: dict[Kind, dict[str, str]] = {"execution": {}, "session": {}, "mcp": {}}  # id -> published JSON

    def count(self, pool: Pool, key: str | None) -> tuple[int, int]:
        leases = self.leases[pool]
        return sum(1 for k in leases.values() if k == (key or "")), len(leases)


def _admission(mine: int, total: int, per_key: int | None, limit: int | None) -> Admission:
    if per_key is not None and mine >= per_key:
        return Admission(False, mine, total, "per_key")
    if limit is not None and total >= limit:
        return Admission(False, mine, total, "total")
    return Admission(True, mine, total)


class LocalState:
    """One machine: everything in this process's memory; the replica is always alive."""

    def __init__(self, node_id: str = "local", node_url: str = "") -> None:
        self.node_id, self.node_url = node_id, node_url
        self._held = _Held()
        self._tombstones: OrderedDict[str, tuple[Tombstone, float]] = OrderedDict()

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def beat(self) -> None:
        now = time.monotonic()
        for record_id in [r for r, (_, until) in self._tombstones.items() if until <= now]:
            del self._tombstones[record_id]

    async def acquire(
        self, pool: Pool, lease: str, key: str | None, *, per_key: int | None, total: int | None
    ) -> Admission:
        admission = _admission(*self._held.count(pool, key), per_key, total)
        if admission.admitted:
            self._held.leases[pool][lease] = key or ""
        return admission

    async def release(self, pool: Pool, lease: str) -> None:
        self._held.leases[pool].pop(lease, None)

    def holds(self, kind: Kind, record_id: str) -> bool:
        return record_id in self._held.records[kind]

    async def publish(self, kind: Kind, record_id: str, owner: str | None, data: Mapping[str, Any]) -> None:
        self._held.records[kind][record_id] = _record_json(self.node_id, owner, data)

    async def withdraw(self, kind: Kind, record_id: str) -> None:
        self._held.records[kind].pop(record_id, None)

    async def place(self, kind: Kind, record_id: str) -> Placed | None:
        raw = self._held.records[kind].get(record_id)
        return None if raw is None else _placed(record_id, raw, {self.node_id: self.node_url})

    async def listing(self, kind: Kind) -> list[Placed]:
        live = {self.node_id: self.node_url}
        return [_placed(record_id, raw, live) for record_id, raw in self._held.records[kind].items()]

    async def nodes(self) -> dict[str, str]:
        return {self.node_id: self.node_url}

    async def replicas(self) -> dict[str, Replica]:
        return {self.node_id: Replica(self.node_url, {})}

    def forget_replicas(self) -> None:
        pass

    async def bury(self, record_id: str, owner: str | None, reason: str, keep_s: float) -> None:
        self._tombstones[record_id] = (Tombstone(owner, reason), time.monotonic() + keep_s)
        while len(self._tombstones) > MAX_LOCAL_TOMBSTONES:
            self._tombstones.popitem(last=False)

    async def tombstone(self, record_id: str) -> Tombstone | None:
        found = self._tombstones.get(record_id)
        return found[0] if found and found[1] > time.monotonic() else None


def _record_json(node_id: str, owner: str | None, data: Mapping[str, Any]) -> str:
    return json.dumps({"node": node_id, "owner": owner, "data": dict(data)}, separators=(",", ":"))


def _placed(record_id: str, raw: str | bytes, live: Mapping[str, str]) -> Placed:
    record = json.loads(raw)
    node = record["node"]
    return Placed(record_id, node, live.get(node), record.get("owner"), record.get("data") or {})


# Counts the pool's leases of live replicas (dropping those of dead ones) and takes one if there is room.
# KEYS[1]: the pool's lease hash (lease -> "node\tkey"). ARGV: node-key prefix, this node, lease, key ("": the
# one caller of a service without keys), per-key limit and total limit (-1: none). The nodes' heartbeat
# keys are read by name, which a single Redis server allows (a Redis Cluster would need them declared, and
# is not supported).
_ACQUIRE = """
local leases = redis.call('HGETALL', KEYS[1])
local alive = {}
local mine, total = 0, 0
for i = 1, #leases, 2 do
  local node, key = string.match(leases[i + 1], '^([^\\t]*)\\t(.*)$')
  local live = alive[node]
  if live == nil then
    live = redis.call('EXISTS', ARGV[1] .. node) == 1
    alive[node] = live
  end
  if live then
    total = total + 1
    if key == ARGV[4] then mine = mine + 1 end
  else
    redis.call('HDEL', KEYS[1], leases[i])
  end
end
local per_key, limit = tonumber(ARGV[5]), tonumber(ARGV[6])
if per_key >= 0 and mine >= per_key then return {0, mine, total, 'per_key'} end
if limit >= 0 and total >= limit then return {0, mine, total, 'total'} end
redis.call('HSET', KEYS[1], ARGV[3], ARGV[2] .. '\\t' .. ARGV[4])
return {1, mine, total, ''}
"""


class RedisState:
    """The fleet's state in a Redis server that every replica shares (redis-py's asyncio client)."""

    def __init__(
        self,
        url: str,
        node_id: str,
        node_url: str,
        *,
        lost_after_s: float = LOST_AFTER_S,
        timeout_s: float = 2.0,
    ) -> None:
        self.node_id, self.node_url, self.lost_after_s = node_id, node_url, lost_after_s
        self.load: Callable[[], dict[str, int]] = dict  # what this replica runs, reported with each beat
        self._redis = Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, decode_responses=True
        )
        self._acquire = self._redis.register_script(_ACQUIRE)
        self._held = _Held()
        self._withdrawn: set[tuple[str, str]] = set()  # (hash key, field) whose removal Redis missed
        self._resync = False  # a record Redis missed: the next beat writes back everything held
        self._beats = 0
        self._places: OrderedDict[tuple[Kind, str], str] = OrderedDict()  # records found, as published
        self._replicas: tuple[float, dict[str, Replica]] | None = None  # when read, and what was
        self.reachable = False

    async def _call(self, what: str, operation: Any) -> Any:
        try:
            result = await operation
        except (RedisError, OSError) as exc:
            self.reachable = False
            raise SharedStateUnavailable(
                f"The fleet's shared state (Redis) cannot be reached ({type(exc).__name__}); {what} was refused: "
                "retry in a few seconds"
            ) from None
        self.reachable = True
        return result

    async def start(self) -> None:
        await self.beat()

    async def close(self) -> None:
        with contextlib.suppress(RedisError, OSError):  # leaving: its heartbeat expires by itself
            await self._redis.delete(self._node_key(self.node_id))
        await self._redis.aclose()

    def _node_key(self, node_id: str) -> str:
        return f"{PREFIX}node:{node_id}"

    async def beat(self) -> None:
        """Says this replica is alive; if Redis had forgotten it, writes back everything it holds."""
        beat = json.dumps({"url": self.node_url, "load": self.load()}, separators=(",", ":"))
        previous = await self._call(
            "the heartbeat",
            self._redis.set(self._node_key(self.node_id), beat, px=int(self.lost_after_s * 1000), get=True),
        )
        if previous is None or self._resync:
            self._resync = False
            await self._rejoin()
        if self._withdrawn:
            pending, self._withdrawn = self._withdrawn, set()
            try:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for name, field in pending:
                        pipe.hdel(name, field)
                    await self._call("a withdrawal", pipe.execute())
            except SharedStateUnavailable:
                self._withdrawn |= pending  # the next beat tries again
                raise
        self._beats += 1
        if self._beats % PRUNE_EVERY_BEATS == 0:
            await self._prune_lost()

    async def _prune_lost(self) -> None:
        """Removes the records of lost replicas (a crash leaves them); a session's becomes a tombstone, so
        that it still answers 410 `node_lost`. Any replica may do it, and two at once do no harm."""
        live = await self.nodes()
        for kind in ("execution", "session", "mcp"):
            found = await self._call("pruning", self._redis.hgetall(f"{PREFIX}records:{kind}"))
            for record_id, raw in found.items():
                placed = _placed(record_id, raw, live)
                if not placed.lost:
                    continue
                if kind == "session":
                    await self.bury(record_id, placed.owner, "node_lost", keep_s=LOST_SESSION_KEEP_S)
                await self._call("pruning", self._redis.hdel(f"{PREFIX}records:{kind}", record_id))

    async def _rejoin(self) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            for pool, leases in self._held.leases.items():
                for lease, key in leases.items():
                    pipe.hset(f"{PREFIX}leases:{pool}", lease, f"{self.node_id}\t{key}")
            for kind, records in self._held.records.items():
                for record_id, raw in records.items():
                    pipe.hset(f"{PREFIX}records:{kind}", record_id, raw)
            await self._call("rejoining the fleet", pipe.execute())
        held = sum(map(len, self._held.leases.values())) + sum(map(len, self._held.records.values()))
        log.info("fleet: node %s joined through Redis, with %d lease(s) and record(s) of its own", self.node_id, held)

    async def acquire(
        self, pool: Pool, lease: str, key: str | None, *, per_key: int | None, total: int | None
    ) -> Admission:
        try:
            admitted, mine, total_held, refused = await self._call(
                "admission",
                self._acquire(
                    keys=[f"{PREFIX}leases:{pool}"],
                    args=[
                        f"{PREFIX}node:",
                        self.node_id,
                        lease,
                        key or "",
                        -1 if per_key is None else per_key,
                        -1 if total is None else total,
                    ],
                ),
            )
        except BaseException:  # cancelled or timed out, perhaps after the script took the lease: give it back
            with anyio.CancelScope(shield=True):
                await self._forget(f"{PREFIX}leases:{pool}", lease)
            raise
        if admitted:
            self._held.leases[pool][lease] = key or ""
            return Admission(True, int(mine), int(total_held))
        return Admission(False, int(mine), int(total_held), refused)

    async def release(self, pool: Pool, lease: str) -> None:
        self._held.leases[pool].pop(lease, None)
        await self._forget(f"{PREFIX}leases:{pool}", lease)

    def holds(self, kind: Kind, record_id: str) -> bool:
        """Whether this replica published the record (a look in its own memory, no round trip)."""
        return record_id in self._held.records[kind]

    async def _forget(self, name: str, field: str) -> None:
        """Removes a field; if Redis cannot be reached, the next beat removes it (never raises)."""
        try:
            await self._call("a withdrawal", self._redis.hdel(name, field))
        except SharedStateUnavailable:
            self._withdrawn.add((name, field))

    async def publish(self, kind: Kind, record_id: str, owner: str | None, data: Mapping[str, Any]) -> None:
        raw = _record_json(self.node_id, owner, data)
        self._held.records[kind][record_id] = raw
        self._withdrawn.discard((f"{PREFIX}records:{kind}", record_id))
        try:
            await self._call("publishing a record", self._redis.hset(f"{PREFIX}records:{kind}", record_id, raw))
        except SharedStateUnavailable:
            self._resync = True  # it runs here all the same; the others learn of it at the next beat

    async def withdraw(self, kind: Kind, record_id: str) -> None:
        self._held.records[kind].pop(record_id, None)
        self._places.pop((kind, record_id), None)
        await self._forget(f"{PREFIX}records:{kind}", record_id)

    async def place(self, kind: Kind, record_id: str) -> Placed | None:
        cached = self._places.get((kind, record_id))
        if cached is not None:
            placed = _placed(record_id, cached, await self.nodes())
            if not placed.lost:
                return placed
            del self._places[(kind, record_id)]  # its replica went: what Redis says now (withdrawn, or lost)
        raw = await self._call("finding a record", self._redis.hget(f"{PREFIX}records:{kind}", record_id))
        if raw is None:
            return None
        self._places[(kind, record_id)] = raw
        while len(self._places) > PLACES_KEPT:
            self._places.popitem(last=False)
        return _placed(record_id, raw, await self.nodes())

    async def listing(self, kind: Kind) -> list[Placed]:
        found = await self._call("listing", self._redis.hgetall(f"{PREFIX}records:{kind}"))
        live = await self.nodes()
        placed = [_placed(record_id, raw, live) for record_id, raw in found.items()]
        return [p for p in placed if not p.lost]

    async def nodes(self) -> dict[str, str]:
        """The live replicas: node id -> URL."""
        return {node_id: replica.url for node_id, replica in (await self.replicas()).items()}

    async def replicas(self) -> dict[str, Replica]:
        """The live replicas, with the load each reported at its last beat (read at most REPLICAS_FRESH_S ago)."""
        now = time.monotonic()
        if self._replicas is not None and now - self._replicas[0] < REPLICAS_FRESH_S:
            return self._replicas[1]

        async def read() -> dict[str, Replica]:
            names = [name async for name in self._redis.scan_iter(match=f"{PREFIX}node:*", count=100)]
            beats = await self._redis.mget(names) if names else []
            found = {}
            for name, beat in zip(names, beats, strict=True):
                if beat is not None:
                    record = json.loads(beat)
                    found[name.removeprefix(f"{PREFIX}node:")] = Replica(record["url"], record.get("load") or {})
            return found

        found = dict(await self._call("listing the replicas", read()))
        self._replicas = (now, found)
        return found

    def forget_replicas(self) -> None:
        self._replicas = None

    async def bury(self, record_id: str, owner: str | None, reason: str, keep_s: float) -> None:
        value = json.dumps({"owner": owner, "reason": reason})
        try:
            await self._call(
                "recording an end", self._redis.set(f"{PREFIX}ended:{record_id}", value, px=int(keep_s * 1000))
            )
        except SharedStateUnavailable:  # only the other replicas' answer suffers: a 404 instead of this 410
            log.warning(
                "fleet: the end of %s (%s) is known to this replica only: Redis cannot be reached", record_id, reason
            )

    async def tombstone(self, record_id: str) -> Tombstone | None:
        raw = await self._call("finding an end", self._redis.get(f"{PREFIX}ended:{record_id}"))
        if raw is None:
            return None
        found = json.loads(raw)
        return Tombstone(found.get("owner"), found["reason"])
