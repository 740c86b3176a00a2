"""Summaries of timings, the ratios between contenders, and the issue's targets judged against them.

Pure functions, no I/O: the one part of the benchmarks that unit tests cover.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal


def percentile(samples: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile (0..1) by linear interpolation between closest ranks (numpy's default)."""
    if not samples:
        raise ValueError("no samples")
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must lie in [0, 1], not {fraction}")
    ordered = sorted(samples)
    position = fraction * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True)
class Summary:
    """Latency of one contender, in milliseconds."""

    n: int
    p50: float
    p95: float
    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, samples_ms: Sequence[float]) -> Summary:
        return cls(
            n=len(samples_ms),
            p50=percentile(samples_ms, 0.50),
            p95=percentile(samples_ms, 0.95),
            mean=sum(samples_ms) / len(samples_ms),
            min=min(samples_ms),
            max=max(samples_ms),
        )

    def as_dict(self) -> dict[str, float]:
        return {"n": self.n, "p50": self.p50, "p95": self.p95, "mean": self.mean, "min": self.min, "max": self.max}


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator; infinite when the denominator is zero (never a ZeroDivisionError mid-report)."""
    if denominator == 0:
        return math.inf if numerator else math.nan
    return numerator / denominator


@dataclass(frozen=True)
class Target:
    """One of the issue's targets: `measured` must be at most (`<=`), below (`<`) or at least (`>=`) `bound`."""

    name: str
    measured: float | None  # None: the rows it needs were not measured in this run
    comparison: Literal["<=", "<", ">="]
    bound: float
    unit: str  # "x" for a ratio, else the unit of an absolute figure ("ms", "/s")

    @property
    def verdict(self) -> Literal["pass", "miss", "n/a"]:
        if self.measured is None or math.isnan(self.measured):
            return "n/a"
        if self.comparison == "<":
            ok = self.measured < self.bound
        else:
            ok = self.measured <= self.bound if self.comparison == "<=" else self.measured >= self.bound
        return "pass" if ok else "miss"

    def as_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "measured": self.measured,
            "comparison": self.comparison,
            "bound": self.bound,
            "unit": self.unit,
            "verdict": self.verdict,
        }


def format_number(value: float | None, unit: str = "") -> str:
    """Compact figures for the table: 0.84x, 12.3 ms, 1,234,567/s."""
    if value is None or math.isnan(value):
        return "-"
    if math.isinf(value):
        return "inf"
    if unit == "x":
        return f"{value:.2f}x"
    if unit == "/s":
        return f"{value:,.0f}/s" if value >= 100 else f"{value:.2f}/s"
    digits = 2 if abs(value) < 10 else 1 if abs(value) < 100 else 0
    text = f"{value:,.{digits}f}"
    return f"{text} {unit}" if unit else text
