"""How many containers the warm pool holds: a target that follows demand between a floor and a ceiling,
and never more idle or starting containers than a memory budget holds.

Demand is every execution that held, waited for or asked for a pooled container in the last
`DEMAND_WINDOW_S` seconds: those lent or waiting now, plus those that finished or went cold in that
window. The target rises at once to the demand (never above the ceiling) and, while demand stays below
it, falls by one each `DECAY_STEP_S` seconds, down to the floor. The target counts lent containers, as
the fixed pool's size did; the memory budget bounds only what the pool itself holds (ready, starting
and being removed), since a lent container's memory is its execution's, bounded by the concurrency.

Each served language has a pool of its own (a lane of the code interpreter), with its own sizer: the
floor and ceiling settings apply to each, and each target follows its own language's demand. The memory
budget is the whole service's: `pool_limits` splits it evenly among the lanes, so that two languages
never hold more idle memory than one did (a lane's floor is capped by its share, as the whole pool's was
by the budget). The one exception is the default budget's least, one warm container per lane: on a host
whose quarter of memory holds fewer containers than there are lanes, each lane still gets one.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from metaagent.errors import ConfigError
from metaagent.settings import POOL_GROWTH, Settings

# The least window: about the time one JavaScript warm start takes on a busy small host (runc 0.3-1 s,
# gVisor 1-2 s). What came in the last window is then about what must be in stock for an agent loop's
# back-to-back calls (one every 0.1-0.5 s) not to find the pool empty while their replacements start: 2 s
# of such calls ask for 4-20 containers, the ceiling on a small host. Where a start takes longer (Python
# under gVisor: seconds), the pool widens the window to the median start it measures (`StartCost`).
DEMAND_WINDOW_S = 2.0
# The most the measured start time widens it to: a few starts slowed by a busy minute must not keep the
# pool large long after (60 s, the start timeout, would).
MAX_DEMAND_WINDOW_S = 10.0
# An agent's model thinks for seconds to a minute between turns, and a burst (4-16 parallel calls) tends
# to come again at the next turn. Idle containers use no CPU, only memory within the budget, while each
# start costs a few hundred ms of CPU, the scarce thing on a small host: so a level is kept across a turn
# or two and given back slowly, one container each 30 s (16 back to 4 in 6 minutes).
DECAY_STEP_S = 30.0

# The default memory budget: a quarter of the host's memory, at least one warm container (so that the
# default floor, which the budget caps, fits anywhere) and at most 16 GiB, the largest ceiling (64) of
# 256 MB containers.
_MIN_DEFAULT_BUDGET_MB = 256
_MAX_DEFAULT_BUDGET_MB = 16 * 1024
_UNKNOWN_HOST_BUDGET_MB = 1024  # no /proc/meminfo (not Linux): four warm containers


@dataclass(frozen=True)
class PoolLimits:
    """The warm pool's bounds: the fewest and most containers it aims to hold (lent ones included), and
    the most memory its idle and starting containers may hold together."""

    floor: int
    ceiling: int
    memory_budget_mb: int

    @classmethod
    def off(cls) -> PoolLimits:
        return cls(0, 0, 0)


def host_memory_mb(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    """The host's memory (MemTotal) in MiB; None where the kernel does not say."""
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) // 1024  # the kernel writes kB (KiB)
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_memory_budget_mb(host_mb: int | None) -> int:
    if host_mb is None:
        return _UNKNOWN_HOST_BUDGET_MB
    return max(_MIN_DEFAULT_BUDGET_MB, min(_MAX_DEFAULT_BUDGET_MB, host_mb // 4))


def pool_limits(
    settings: Settings, *, cpu_count: int, host_mb: int | None, container_mb: int, lanes: int = 1
) -> PoolLimits:
    """One lane's pool limits from the settings (defaults filled in), its memory budget the lane's share of
    the service's among `lanes` pools; a ConfigError that says what to change when the floor is above the
    ceiling or the share cannot hold the floor's containers."""
    ceiling = settings.effective_pool_size(cpu_count)
    if ceiling == 0:
        return PoolLimits.off()
    total = settings.pool_memory_mb
    if total is None:
        total = max(default_memory_budget_mb(host_mb), lanes * container_mb)  # at least one warm container a lane
    budget = total // lanes
    floor = settings.pool_min
    if floor is None:  # as many as can run at once (the pool's fixed size before), if ceiling and budget allow
        floor = max(1, min(settings.effective_concurrency(cpu_count), ceiling, budget // container_mb))
    if floor > ceiling:
        where = (
            "METAAGENT_POOL_SIZE"
            if settings.pool_size is not None
            else f"{POOL_GROWTH} per execution slot: METAAGENT_POOL_SIZE unset"
        )
        raise ConfigError(
            f"METAAGENT_POOL_MIN ({floor}) is above the warm pool's ceiling ({ceiling}, {where}): "
            "lower METAAGENT_POOL_MIN or raise METAAGENT_POOL_SIZE"
        )
    if budget // container_mb < max(floor, 1):
        fits = budget // container_mb
        shared = f", split among the {lanes} languages' pools (METAAGENT_LANGUAGES), each" if lanes > 1 else ""
        raise ConfigError(
            f"METAAGENT_POOL_MEMORY_MB ({total}){shared} holds {fits} warm container(s) of {container_mb} MB, "
            f"fewer than the pool's floor ({max(floor, 1)}): set it to at least "
            f"{lanes * max(floor, 1) * container_mb}, lower METAAGENT_POOL_MIN, or turn the pool off "
            "(METAAGENT_POOL_ENABLED=false)"
        )
    return PoolLimits(floor, ceiling, budget)


class PoolSizer:
    """The pool's target, from the demand it is told of; pure logic on an injectable clock.

    `idle_max` is how many containers the memory budget holds (ready, starting or being removed).
    """

    def __init__(
        self,
        floor: int,
        ceiling: int,
        idle_max: int,
        *,
        window_s: float = DEMAND_WINDOW_S,
        decay_s: float = DECAY_STEP_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= floor <= ceiling or idle_max < 0 or window_s < 0 or decay_s <= 0:
            raise ValueError(f"bad pool sizing: floor {floor}, ceiling {ceiling}, idle_max {idle_max}")
        self.floor = floor
        self.ceiling = ceiling
        self.idle_max = idle_max
        self.least_window_s = window_s
        self.window_s = window_s
        self.decay_s = decay_s
        self._clock = clock
        self._target = floor
        self._level_since = clock()  # when demand last reached the target, or the target last stepped down
        self._recent: deque[float] = deque()  # when executions stopped holding or waiting for a container

    def left(self) -> None:
        """An execution no longer holds or waits for a pooled container: it finished, or went cold."""
        self._recent.append(self._clock())

    def target(self, in_use: int) -> int:
        """The containers the pool aims to hold now, lent ones included; `in_use`: lent or waited for now."""
        now = self._clock()
        while self._recent and self._recent[0] <= now - self.window_s:
            self._recent.popleft()
        demand = min(self.ceiling, in_use + len(self._recent))
        if demand >= self._target:
            self._target, self._level_since = demand, now
        elif (steps := int((now - self._level_since) // self.decay_s)) > 0:
            self._target = max(self.floor, demand, self._target - steps)
            self._level_since += steps * self.decay_s
        return self._target

    def count_demand_over(self, start_s: float) -> None:
        """Demand is counted over at least what a start takes now (at most MAX_DEMAND_WINDOW_S): what comes
        in while a replacement starts is what must be in stock (a Python start under runsc takes seconds)."""
        self.window_s = max(self.least_window_s, min(start_s, MAX_DEMAND_WINDOW_S))

    def next_step_in(self) -> float | None:
        """Seconds until the target may step down (for the pool's loop to look again); None at the floor."""
        if self._target <= self.floor:
            return None
        return max(0.0, self._level_since + self.decay_s - self._clock())


# How many of the pool's last starts say what a start costs now: enough for a steady median, few enough
# to follow a machine that became busier (a minute of starts at this machine's pace).
START_COST_WINDOW = 32


@dataclass(frozen=True)
class StartRate:
    """What the pool's recent starts cost, and the pace of starts this machine sustains from it."""

    measured: int  # starts behind the figures
    wall_s: float  # median, create to the runner's ready line, at whatever parallelism they ran
    cpu_s: float | None  # median CPU of the container's own processes (its cgroup) over that time
    per_second: float  # sustained starts per second, see `StartCost.rate`

    def as_dict(self) -> dict[str, float | int | None]:
        return {
            "measured": self.measured,
            "wall_ms": round(self.wall_s * 1000, 1),
            "cpu_ms": None if self.cpu_s is None else round(self.cpu_s * 1000, 1),
            "per_second": round(self.per_second, 2),
        }


class StartCost:
    """The cost of the pool's recent starts; pure logic.

    With `parallel` starts kept in flight, each taking the median wall time W, starts complete at
    `parallel / W` a second (Little's law). Measured while fewer ran at once, W is shorter than it would
    be with `parallel` competing for the CPU, so the rate is also held to what the CPUs can pay for:
    `cpus / C`, C the median CPU of a start's container. (The engine's own part of a start, dockerd,
    containerd and the shim, is not in C: the figure is an upper bound that the wall time usually sets.)
    """

    def __init__(self, parallel: int, cpus: int, window: int = START_COST_WINDOW) -> None:
        self.parallel = parallel
        self.cpus = cpus
        self._walls: deque[float] = deque(maxlen=window)
        self._cpus: deque[float] = deque(maxlen=window)
        self.measured = 0

    def record(self, wall_s: float, cpu_s: float | None) -> None:
        self.measured += 1
        self._walls.append(wall_s)
        if cpu_s is not None:
            self._cpus.append(cpu_s)

    def rate(self) -> StartRate | None:
        """None before the first start."""
        if not self._walls:
            return None
        wall = statistics.median(self._walls)
        cpu = statistics.median(self._cpus) if self._cpus else None
        per_second = self.parallel / max(wall, 1e-3)
        if cpu:
            per_second = min(per_second, self.cpus / cpu)
        return StartRate(self.measured, wall, cpu, per_second)
