"""The token bucket that bounds one execution's tunnel work: pure logic, on a clock the tests move."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from metaagent.sandbox.budget import TokenBucket


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_full_bucket_gives_its_capacity_at_once_then_reserves_future_tokens_in_order() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=10, capacity=3, clock=clock)
    assert [bucket.reserve(max_debt=math.inf) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert [bucket.reserve(max_debt=math.inf) for _ in range(3)] == pytest.approx([0.1, 0.2, 0.3])


def test_a_reservation_past_the_debt_bound_is_refused_and_takes_nothing() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=1, capacity=1, clock=clock)
    assert bucket.reserve(max_debt=2) == 0.0
    assert bucket.reserve(max_debt=2) == pytest.approx(1.0)
    assert bucket.reserve(max_debt=2) == pytest.approx(2.0)
    assert bucket.reserve(max_debt=2) is None
    assert bucket.reserve(max_debt=2) is None  # the refusals reserved nothing
    clock.now += 1  # one token more: room for one more reservation
    assert bucket.reserve(max_debt=2) == pytest.approx(2.0)


def test_tokens_accrue_with_time_but_never_past_the_capacity() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=5, capacity=2, clock=clock)
    assert bucket.reserve() == 0.0
    assert bucket.reserve() == 0.0
    assert bucket.reserve() is None
    clock.now += 3600
    assert [bucket.reserve() for _ in range(3)] == [0.0, 0.0, None]


@given(
    rate=st.floats(min_value=0.5, max_value=1000),
    capacity=st.integers(min_value=1, max_value=50),
    gaps=st.lists(st.floats(min_value=0, max_value=0.5), min_size=1, max_size=300),
)
def test_over_any_interval_it_grants_at_most_its_capacity_plus_its_rate_times_the_time(
    rate: float, capacity: int, gaps: list[float]
) -> None:
    clock = Clock()
    bucket = TokenBucket(rate=rate, capacity=capacity, clock=clock)
    start = clock.now
    granted = 0
    for gap in gaps:
        clock.now += gap
        if bucket.reserve() == 0.0:
            granted += 1
    assert granted <= capacity + rate * (clock.now - start) + 1e-9


async def test_take_waits_only_when_the_bucket_is_empty() -> None:
    bucket = TokenBucket(rate=1000, capacity=1)
    assert await bucket.take() is False
    assert await bucket.take() is True


@pytest.mark.parametrize(("rate", "capacity"), [(0, 1), (-1, 1), (1, 0.5)])
def test_a_bucket_without_a_positive_rate_or_room_for_a_token_is_refused(rate: float, capacity: float) -> None:
    with pytest.raises(ValueError, match="positive rate"):
        TokenBucket(rate=rate, capacity=capacity)
