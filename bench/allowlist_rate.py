"""Allow-list decisions per second with 1,000 patterns (half exact names, half wildcards).

A decision is `AllowList.allows(host)` on a host already normalised (as the egress guard calls it after
reading the URL). Measured per kind of host and on a mix: a quarter exact hits, a quarter wildcard hits,
half misses. `canonical_ip` is timed on its own too: `match` calls it for every host that is not an
exact entry, so it bounds the wildcard and miss rates.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from metaagent.egress.allowlist import AllowList, canonical_ip

PATTERNS = 1000


def patterns() -> list[str]:
    exact = [f"api{i}.service{i % 97}.example{i % 13}.com" for i in range(PATTERNS // 2)]
    wildcard = [f"*.tenant{i}.cloud{i % 31}.net" for i in range(PATTERNS - PATTERNS // 2)]
    return exact + wildcard


def hosts(rng: random.Random) -> dict[str, list[str]]:
    count = PATTERNS // 2
    exact_hits = [f"api{i}.service{i % 97}.example{i % 13}.com" for i in range(count)]
    wildcard_hits = [
        f"{'x.' * (i % 3)}node{i}.tenant{i}.cloud{i % 31}.net" for i in range(count)
    ]  # 1 to 3 labels below the base
    misses = (
        [f"www{i}.unlisted{i % 53}.org" for i in range(count // 4)]
        + [f"tenant{i}.cloud{i % 31}.net" for i in range(count // 4)]  # a wildcard's base is not covered
        + [f"api{i}.service{i % 97}.example{i % 13}.com.evil.io" for i in range(count // 4)]
        + [f"10.{i % 256}.{i // 256}.7" for i in range(count // 4)]
    )
    mixed = exact_hits[: count // 2] + wildcard_hits[: count // 2] + misses
    rng.shuffle(mixed)
    return {"exact hit": exact_hits, "wildcard hit": wildcard_hits, "miss": misses, "mix": mixed}


def rate(decide: Callable[[str], object], inputs: Sequence[str], seconds: float) -> float:
    """Calls per second of `decide` over `inputs`, repeated for at least `seconds`."""
    calls = 0
    started = time.perf_counter()
    deadline = started + seconds
    while True:
        for host in inputs:
            decide(host)
        calls += len(inputs)
        now = time.perf_counter()
        if now >= deadline:
            return calls / (now - started)


def measure(*, seconds: float, progress: Callable[[str], None]) -> dict[str, Any]:
    raw = json.dumps(patterns())
    started = time.perf_counter()
    allowlist = AllowList.parse(raw)
    parse_ms = (time.perf_counter() - started) * 1000
    assert len(allowlist) == PATTERNS
    groups = hosts(random.Random(7))
    expected = {"exact hit": True, "wildcard hit": True, "miss": False}
    for kind, want in expected.items():
        wrong = [host for host in groups[kind] if allowlist.allows(host) is not want]
        assert not wrong, f"{kind}: {wrong[:3]} decided wrongly"
    rate(allowlist.allows, groups["mix"], seconds / 4)  # warm-up
    rates = {kind: rate(allowlist.allows, inputs, seconds) for kind, inputs in groups.items()}
    names = groups["miss"][: len(groups["miss"]) * 3 // 4]
    progress("allow-list: done")
    return {
        "patterns": PATTERNS,
        "parse_ms": parse_ms,
        "decisions_per_second": rates,
        "canonical_ip_on_names_per_second": rate(canonical_ip, names, seconds),
    }
