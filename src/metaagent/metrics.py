"""Prometheus metrics, served at `GET /metrics` (with API keys, to operator keys only: all are service-wide).

    metaagent_executions_total{outcome}          completed, failed (non-zero exit), timed_out, oom_killed,
                                                 killed, rejected (429), unavailable (503), refused (400),
                                                 cancelled (the caller hung up), error
    metaagent_execution_duration_seconds         histogram of the container's run time (completed runs)
    metaagent_executions_running                 executions holding a slot now
    metaagent_executions_queued                  executions waiting for a slot now
    metaagent_pool_containers{language}          warm containers ready in the language's pool
    metaagent_pool_target{language}              containers that pool aims to hold now, lent ones included
                                                 (it follows demand between its floor and ceiling)
    metaagent_pool_starts_per_second{language}   warm starts a second this machine sustains, from the pool's
                                                 recent starts (sandbox/sizing.py, StartCost); 0 before the first
    metaagent_pool_start_retries_total{language} warm containers of the language's pool whose runner died
                                                 before any code was handed over (a crash at start); the
                                                 pool starts another
    metaagent_egress_blocked_total{tool}         outbound requests the egress guard refused
    metaagent_engine_errors_total                container engine calls that failed (engine down, refused)
    metaagent_oom_kills_unreported_total         OOM kills the memory cgroup notified and the engine's
                                                 report missed (sandbox/oom.py); each is still `oom_killed`
    metaagent_tunnel_operations_total{phase}     the service's work for sandbox tunnels: accept (connections
                                                 accepted), check (tunnel requests read and decided: allow-lists,
                                                 DNS, address policy, connect), relay (chunks moved)
    metaagent_tunnel_waits_total{phase}          times an execution's accept, check or relay waited for its budget
    metaagent_tunnel_refusals_total{reason}      tunnel connections refused: host, address, dns, limit, rate,
                                                 request, bytes
    metaagent_tunnel_bytes_total{direction}      bytes relayed, to_upstream or from_upstream
    metaagent_tunnel_execution_operations{phase} histogram of one execution's tunnel work, observed when it ends
    metaagent_tunnels_open                       tunnels open now, all executions together

Metrics are process-wide (one service per process), on prometheus-client's default registry, which also
carries the process's own `process_*` metrics (memory, CPU, open files).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TYPE_CHECKING, Protocol

import anyio
from prometheus_client import Counter, Gauge, Histogram

from metaagent.errors import AtCapacity, RequestRefused, Unavailable

if TYPE_CHECKING:
    from metaagent.tools.code_interpreter import CodeInterpreterResponse


class _Pool(Protocol):
    @property
    def ready(self) -> int: ...

    @property
    def size(self) -> int: ...

    def starts_per_second(self) -> float: ...


class _Admission(Protocol):
    @property
    def running(self) -> int: ...

    @property
    def waiting(self) -> int: ...


EXECUTIONS = Counter("metaagent_executions", "Code interpreter executions by how they ended", ["outcome"])
EXECUTION_DURATION = Histogram(
    "metaagent_execution_duration_seconds",
    "Run time of executions that completed (container start to exit)",
    buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300),
)
RUNNING = Gauge("metaagent_executions_running", "Executions holding a slot now")
QUEUED = Gauge("metaagent_executions_queued", "Executions waiting for a slot now")
POOL_CONTAINERS = Gauge(
    "metaagent_pool_containers", "Warm sandbox containers ready in the pool, by language", ["language"]
)
POOL_TARGET = Gauge(
    "metaagent_pool_target",
    "Containers the language's warm pool aims to hold now (lent ones included); follows demand",
    ["language"],
)
POOL_STARTS_PER_SECOND = Gauge(
    "metaagent_pool_starts_per_second",
    "Warm starts a second this machine sustains, from the language's pool's recent starts (0 before the first)",
    ["language"],
)
POOL_START_RETRIES = Counter(
    "metaagent_pool_start_retries",
    "Warm containers whose runner died before any code was handed over; the language's pool started another",
    ["language"],
)
EGRESS_BLOCKED = Counter("metaagent_egress_blocked", "Outbound requests refused by the egress guard", ["tool"])
ENGINE_ERRORS = Counter("metaagent_engine_errors", "Container engine calls that failed")
OOM_UNREPORTED = Counter(
    "metaagent_oom_kills_unreported", "OOM kills the memory cgroup notified and the engine's report missed"
)
TUNNEL_OPERATIONS = Counter(
    "metaagent_tunnel_operations",
    "Work the service did for sandbox tunnels: connections accepted, tunnel requests checked, chunks relayed",
    ["phase"],
)
TUNNEL_WAITS = Counter(
    "metaagent_tunnel_waits", "Times an execution's tunnel work waited for its per-execution budget", ["phase"]
)
TUNNEL_REFUSALS = Counter("metaagent_tunnel_refusals", "Sandbox tunnel connections refused, by reason", ["reason"])
TUNNEL_BYTES = Counter("metaagent_tunnel_bytes", "Bytes relayed through sandbox tunnels", ["direction"])
TUNNEL_EXECUTION_OPERATIONS = Histogram(
    "metaagent_tunnel_execution_operations",
    "Tunnel work of one execution (connections accepted, requests checked, chunks relayed), when it ends",
    ["phase"],
    buckets=(1, 10, 100, 1000, 10_000, 100_000, 1_000_000),
)
TUNNELS_OPEN = Gauge("metaagent_tunnels_open", "Sandbox tunnels open now")
TUNNEL_PHASES = ("accept", "check", "relay")
TUNNEL_REFUSAL_REASONS = ("host", "address", "dns", "limit", "rate", "request", "bytes")
# Every series exists from the start, so a scrape shows zeros rather than nothing before the first tunnel.
for _phase in TUNNEL_PHASES:
    TUNNEL_OPERATIONS.labels(phase=_phase)
    TUNNEL_WAITS.labels(phase=_phase)
for _reason in TUNNEL_REFUSAL_REASONS:
    TUNNEL_REFUSALS.labels(reason=_reason)
for _direction in ("to_upstream", "from_upstream"):
    TUNNEL_BYTES.labels(direction=_direction)


def watch_admission(admission: _Admission) -> None:
    """The running and queued gauges read this admission when scraped."""
    RUNNING.set_function(lambda: admission.running)
    QUEUED.set_function(lambda: admission.waiting)


def watch_pool(pool: _Pool, language: str) -> None:
    """The pool gauges of `language` read this pool (that language's lane) when scraped."""
    POOL_CONTAINERS.labels(language=language).set_function(lambda: pool.ready)
    POOL_TARGET.labels(language=language).set_function(lambda: pool.size)
    POOL_STARTS_PER_SECOND.labels(language=language).set_function(pool.starts_per_second)
    POOL_START_RETRIES.labels(language=language)  # zero from the start, not absent until the first retry


def pool_start_retry(language: str) -> None:
    POOL_START_RETRIES.labels(language=language).inc()


def egress_blocked(tool: str) -> None:
    EGRESS_BLOCKED.labels(tool=tool).inc()


def engine_error() -> None:
    ENGINE_ERRORS.inc()


def oom_unreported() -> None:
    OOM_UNREPORTED.inc()


def tunnel_operation(phase: str, waited: bool = False) -> None:
    TUNNEL_OPERATIONS.labels(phase=phase).inc()
    if waited:
        TUNNEL_WAITS.labels(phase=phase).inc()


def tunnel_refused(reason: str) -> None:
    TUNNEL_REFUSALS.labels(reason=reason).inc()


def tunnel_relayed(size: int, to_upstream: bool, waited: bool) -> None:
    tunnel_operation("relay", waited)
    TUNNEL_BYTES.labels(direction="to_upstream" if to_upstream else "from_upstream").inc(size)


def tunnel_execution_ended(accepted: int, checked: int, relayed: int) -> None:
    for phase, count in zip(TUNNEL_PHASES, (accepted, checked, relayed), strict=True):
        TUNNEL_EXECUTION_OPERATIONS.labels(phase=phase).observe(count)


async def observe_execution(call: Awaitable[CodeInterpreterResponse]) -> CodeInterpreterResponse:
    """Awaits one execution and counts how it ended."""
    try:
        response = await call
    except anyio.get_cancelled_exc_class():
        EXECUTIONS.labels(outcome="cancelled").inc()
        raise
    except AtCapacity:
        EXECUTIONS.labels(outcome="rejected").inc()
        raise
    except Unavailable:
        EXECUTIONS.labels(outcome="unavailable").inc()
        raise
    except RequestRefused:
        EXECUTIONS.labels(outcome="refused").inc()
        raise
    except Exception:
        EXECUTIONS.labels(outcome="error").inc()
        raise
    EXECUTIONS.labels(outcome=_outcome(response)).inc()
    EXECUTION_DURATION.observe(response.duration_ms / 1000)
    return response


def _outcome(response: CodeInterpreterResponse) -> str:
    if response.killed:
        return "killed"
    if response.timed_out:
        return "timed_out"
    if response.oom_killed:
        return "oom_killed"
    return "completed" if response.exit_code == 0 else "failed"
