"""The warm pool's size: pure logic on a clock the tests move, and its limits from the settings."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from metaagent.errors import ConfigError
from metaagent.sandbox.sizing import (
    MAX_DEMAND_WINDOW_S,
    PoolLimits,
    PoolSizer,
    StartCost,
    default_memory_budget_mb,
    host_memory_mb,
    pool_limits,
)
from metaagent.settings import Settings, describe_settings_error

WINDOW_S = 2.0
DECAY_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def sizer(clock: Clock, floor: int = 1, ceiling: int = 8, idle_max: int = 8) -> PoolSizer:
    return PoolSizer(floor, ceiling, idle_max, window_s=WINDOW_S, decay_s=DECAY_S, clock=clock)


def test_the_target_starts_at_the_floor_and_rises_at_once_to_the_demand() -> None:
    pool = sizer(Clock(), floor=2)
    assert pool.target(0) == 2
    assert pool.target(5) == 5  # five lent or waiting now: no delay


def test_the_target_never_rises_above_the_ceiling() -> None:
    pool = sizer(Clock(), ceiling=4)
    assert pool.target(16) == 4


def test_executions_that_ended_within_the_window_count_as_demand_and_stop_counting_after_it() -> None:
    clock = Clock()
    pool = sizer(clock, floor=1, ceiling=8)
    for _ in range(3):  # an agent loop: three back-to-back calls, each finished before the next
        pool.left()
    assert pool.target(1) == 4  # the one running now and the three just before it
    clock.now += WINDOW_S
    assert pool.target(1) == 4  # out of the window, but the target holds until it decays
    clock.now += DECAY_S
    assert pool.target(1) == 3


def test_the_target_decays_one_step_per_decay_interval_down_to_the_floor_and_no_lower() -> None:
    clock = Clock()
    pool = sizer(clock, floor=2)
    pool.target(6)
    seen = []
    for _ in range(6):
        clock.now += DECAY_S
        seen.append(pool.target(0))
    assert seen == [5, 4, 3, 2, 2, 2]


def test_a_long_quiet_spell_takes_as_many_steps_as_intervals_passed() -> None:
    clock = Clock()
    pool = sizer(clock, floor=1)
    pool.target(8)
    clock.now += 3 * DECAY_S + 1
    assert pool.target(0) == 5
    clock.now += 100 * DECAY_S
    assert pool.target(0) == 1


def test_the_target_never_decays_below_the_demand_still_there() -> None:
    clock = Clock()
    pool = sizer(clock, floor=1)
    pool.target(6)
    clock.now += 10 * DECAY_S
    assert pool.target(4) == 4  # four still lent: the target stops there


def test_demand_that_reaches_the_target_again_restarts_the_decay() -> None:
    clock = Clock()
    pool = sizer(clock, floor=1)
    pool.target(4)
    clock.now += DECAY_S - 1
    assert pool.target(4) == 4  # a burst of the same size just before the step
    clock.now += DECAY_S - 1
    assert pool.target(0) == 4  # a whole interval has not passed since that burst
    clock.now += 1
    assert pool.target(0) == 3


def test_the_next_step_is_due_one_interval_after_the_last_demand_and_never_at_the_floor() -> None:
    clock = Clock()
    pool = sizer(clock, floor=1)
    assert pool.next_step_in() is None
    pool.target(3)
    clock.now += 10
    assert pool.next_step_in() == DECAY_S - 10
    clock.now += 100 * DECAY_S
    pool.target(0)
    assert pool.next_step_in() is None


def test_a_sizer_refuses_a_floor_above_its_ceiling() -> None:
    with pytest.raises(ValueError, match="floor 3, ceiling 2"):
        PoolSizer(3, 2, 4)


def test_the_default_limits_are_the_concurrency_limit_four_times_it_and_a_quarter_of_the_memory() -> None:
    concurrency = Settings().effective_concurrency(2)
    limits = pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256)
    assert limits == PoolLimits(floor=concurrency, ceiling=4 * concurrency, memory_budget_mb=2048)


def test_the_default_floor_is_at_most_what_a_small_hosts_default_budget_holds() -> None:
    assert Settings().effective_concurrency(2) > 2
    limits = pool_limits(Settings(), cpu_count=2, host_mb=2048, container_mb=256)  # a budget of 512 MB
    assert (limits.floor, limits.memory_budget_mb) == (2, 512)


def test_the_default_floor_is_at_most_an_explicit_ceiling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METAAGENT_POOL_SIZE", "1")
    assert pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256).floor == 1


def test_explicit_pool_settings_are_the_limits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METAAGENT_POOL_SIZE", "6")
    monkeypatch.setenv("METAAGENT_POOL_MIN", "2")
    monkeypatch.setenv("METAAGENT_POOL_MEMORY_MB", "1024")
    limits = pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256)
    assert limits == PoolLimits(floor=2, ceiling=6, memory_budget_mb=1024)


@pytest.mark.parametrize("env", [{"METAAGENT_POOL_ENABLED": "false"}, {"METAAGENT_POOL_SIZE": "0"}])
def test_a_pool_that_is_off_has_no_floor_and_no_budget_to_check(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    for name, value in {**env, "METAAGENT_POOL_MIN": "3", "METAAGENT_POOL_MEMORY_MB": "1"}.items():
        monkeypatch.setenv(name, value)
    assert pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256) == PoolLimits.off()


def test_two_lanes_split_the_default_budget_so_that_together_they_hold_no_more_idle_memory_than_one() -> None:
    one = pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256)
    each = pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256, lanes=2)
    assert 2 * each.memory_budget_mb == one.memory_budget_mb == 2048
    assert (each.floor, each.ceiling) == (one.floor, one.ceiling)  # each lane's sizer follows its own demand


def test_two_lanes_split_an_explicit_budget_and_each_lanes_floor_is_capped_by_its_share(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("METAAGENT_POOL_MEMORY_MB", "1024")
    assert Settings().effective_concurrency(2) > 2
    each = pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256, lanes=2)
    assert (each.floor, each.memory_budget_mb) == (2, 512)  # two containers of 256 MB in a 512 MB share


def test_a_small_hosts_default_budget_still_holds_one_warm_container_a_lane() -> None:
    each = pool_limits(Settings(), cpu_count=2, host_mb=1024, container_mb=256, lanes=2)  # a quarter: 256 MB
    assert (each.floor, each.memory_budget_mb) == (1, 256)


def test_an_explicit_budget_whose_share_cannot_hold_a_lanes_floor_is_refused_naming_the_split(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("METAAGENT_POOL_MEMORY_MB", "256")
    with pytest.raises(ConfigError) as raised:
        pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256, lanes=2)
    assert str(raised.value) == (
        "METAAGENT_POOL_MEMORY_MB (256), split among the 2 languages' pools (METAAGENT_LANGUAGES), each holds 0 "
        "warm container(s) of 256 MB, fewer than the pool's floor (1): set it to at least 512, lower "
        "METAAGENT_POOL_MIN, or turn the pool off (METAAGENT_POOL_ENABLED=false)"
    )


def test_the_default_budget_is_a_quarter_of_the_host_clamped_to_one_container_and_16_gib() -> None:
    assert default_memory_budget_mb(8192) == 2048
    assert default_memory_budget_mb(512) == 256
    assert default_memory_budget_mb(1024 * 1024) == 16 * 1024
    assert default_memory_budget_mb(None) == 1024


def test_the_host_memory_is_read_from_meminfo(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24684084 kB\nMemFree:        21006612 kB\n")
    assert host_memory_mb(meminfo) == 24105
    assert host_memory_mb(tmp_path / "absent") is None


def test_a_floor_above_the_pool_size_is_refused_with_both_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("METAAGENT_POOL_SIZE", "2")
    monkeypatch.setenv("METAAGENT_POOL_MIN", "3")
    with pytest.raises(ConfigError) as raised:
        pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256)
    assert str(raised.value) == (
        "METAAGENT_POOL_MIN (3) is above the warm pool's ceiling (2, METAAGENT_POOL_SIZE): "
        "lower METAAGENT_POOL_MIN or raise METAAGENT_POOL_SIZE"
    )


def test_a_floor_above_the_default_ceiling_is_refused_and_names_the_concurrency_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ceiling = 4 * Settings().effective_concurrency(2)
    monkeypatch.setenv("METAAGENT_POOL_MIN", str(ceiling + 1))
    with pytest.raises(ConfigError, match=rf"ceiling \({ceiling}, 4 per execution slot: METAAGENT_POOL_SIZE unset\)"):
        pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256)


@pytest.mark.parametrize(("budget", "floor", "fits"), [("100", None, 0), ("600", "3", 2)])
def test_a_budget_that_cannot_hold_the_floor_is_refused_with_the_least_that_would(
    monkeypatch: pytest.MonkeyPatch, budget: str, floor: str | None, fits: int
) -> None:
    monkeypatch.setenv("METAAGENT_POOL_MEMORY_MB", budget)
    if floor is not None:
        monkeypatch.setenv("METAAGENT_POOL_MIN", floor)
    with pytest.raises(ConfigError) as raised:
        pool_limits(Settings(), cpu_count=2, host_mb=8192, container_mb=256)
    least = int(floor or 1) * 256  # the default floor is what the budget holds, and at least one
    assert f"METAAGENT_POOL_MEMORY_MB ({budget}) holds {fits} warm container(s) of 256 MB" in str(raised.value)
    assert f"set it to at least {least}" in str(raised.value)


@pytest.mark.parametrize(
    ("value", "problem"),
    [("0", "greater than or equal to 1"), ("lots", "valid integer"), ("-256", "greater than or equal to 1")],
)
def test_a_budget_that_is_not_a_positive_number_is_a_settings_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, value: str, problem: str
) -> None:
    monkeypatch.setenv("METAAGENT_POOL_MEMORY_MB", value)
    with pytest.raises(ValidationError) as raised:
        Settings()
    message = describe_settings_error(raised.value)
    assert message.startswith("METAAGENT_POOL_MEMORY_MB: ")
    assert problem in message
    assert repr(value) in message


def test_the_start_rate_is_the_parallel_starts_over_the_median_wall_time_until_the_cpus_bound_it() -> None:
    cost = StartCost(parallel=2, cpus=2, window=3)
    assert cost.rate() is None  # before the first start
    cost.record(0.5, None)  # no CPU figure (no cgroup to read): the wall time alone
    rate = cost.rate()
    assert rate is not None
    assert (rate.measured, rate.wall_s, rate.cpu_s, rate.per_second) == (1, 0.5, None, 4.0)
    cost.record(0.4, 0.8)
    cost.record(0.6, 0.8)
    rate = cost.rate()
    assert rate is not None
    # 2 in parallel at a median of 0.5 s would be 4 a second, but 0.8 s of CPU each on 2 CPUs pays for 2.5.
    assert (rate.wall_s, rate.cpu_s, rate.per_second) == (0.5, 0.8, 2.5)
    assert rate.as_dict() == {"measured": 3, "wall_ms": 500.0, "cpu_ms": 800.0, "per_second": 2.5}


def test_the_start_rate_follows_the_last_starts_only() -> None:
    cost = StartCost(parallel=1, cpus=4, window=3)
    for wall_s in (0.1, 0.1, 0.1, 1.0, 1.0, 1.0):  # the machine became busy
        cost.record(wall_s, None)
    rate = cost.rate()
    assert rate is not None
    assert (rate.measured, rate.wall_s, rate.per_second) == (6, 1.0, 1.0)


def test_demand_is_counted_over_the_time_a_start_takes_between_the_least_window_and_its_most() -> None:
    pool_sizer = sizer(Clock())
    pool_sizer.count_demand_over(0.5)  # faster than the least window: the least stands
    assert pool_sizer.window_s == WINDOW_S
    pool_sizer.count_demand_over(4.0)
    assert pool_sizer.window_s == 4.0
    pool_sizer.count_demand_over(60.0)  # a start slowed to its timeout
    assert pool_sizer.window_s == MAX_DEMAND_WINDOW_S
    pool_sizer.count_demand_over(1.0)  # starts fast again: back to the least
    assert pool_sizer.window_s == WINDOW_S
