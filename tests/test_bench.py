"""The benchmarks' arithmetic and wiring (bench/): statistics, ratios, targets, the baseline's flags.

No timing is asserted here: the benchmarks measure, `scripts/bench` runs them.
"""

from __future__ import annotations

import math
import os
import re

import pytest

from bench.__main__ import finite, parse_args
from bench.baselines import docker_run_argv
from bench.latency import COLD, COLD_RUNSC, DOCKER_RUN, EPICBOX, NODE, POOLED, POOLED_RUNSC
from bench.report import render, runtimes_table, sessions_table, targets
from bench.sessions import CALL, CREATE, mib_per_second, process_cpu_s, status_kib
from bench.sessions import NODE as SESSIONS_NODE
from bench.stats import Summary, Target, format_number, percentile, ratio


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.95) == pytest.approx(3.85)
    assert percentile([7.0], 0.95) == 7.0
    assert percentile([1.0, 2.0, 3.0], 0.0) == 1.0
    assert percentile([1.0, 2.0, 3.0], 1.0) == 3.0


@pytest.mark.parametrize(("samples", "fraction"), [([], 0.5), ([1.0], 1.5), ([1.0], -0.1)])
def test_percentile_refuses_no_samples_and_fractions_outside_0_1(samples: list[float], fraction: float) -> None:
    with pytest.raises(ValueError, match=r"samples|fraction"):
        percentile(samples, fraction)


def test_summary_has_p50_p95_mean_and_extremes() -> None:
    summary = Summary.of([float(x) for x in range(1, 101)])
    assert (summary.n, summary.p50, summary.mean, summary.min, summary.max) == (100, 50.5, 50.5, 1.0, 100.0)
    assert summary.p95 == pytest.approx(95.05)


def test_ratio_by_zero_is_infinite_or_undefined_rather_than_an_exception() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert math.isinf(ratio(1.0, 0.0))
    assert math.isnan(ratio(0.0, 0.0))


@pytest.mark.parametrize(
    ("measured", "comparison", "verdict"),
    [(0.9, "<=", "pass"), (1.0, "<=", "pass"), (1.1, "<=", "miss"), (2.0, ">=", "pass"), (1.0, ">=", "miss")],
)
def test_target_verdict_follows_its_comparison(measured: float, comparison: str, verdict: str) -> None:
    target = Target("t", measured, comparison, 1.0 if comparison == "<=" else 1.5, "x")  # type: ignore[arg-type]
    assert target.verdict == verdict


def test_a_strict_target_misses_at_its_bound() -> None:
    assert Target("t", 2.99, "<", 3.0, "x").verdict == "pass"
    assert Target("t", 3.0, "<", 3.0, "x").verdict == "miss"


def test_a_target_without_its_measurement_is_not_applicable_rather_than_passed() -> None:
    assert Target("t", None, "<=", 1.0, "x").verdict == "n/a"
    assert Target("t", math.nan, ">=", 1.0, "x").verdict == "n/a"


def _latency(p50s: dict[str, float]) -> dict[str, object]:
    return {
        "rounds": 3,
        "summaries": {name: Summary.of([p50]).as_dict() for name, p50 in p50s.items()},
        "pooled_paths": {"warm": 3},
        "pooled_code_duration_ms": Summary.of([20.0]).as_dict(),
        "pooled_outside_code_ms": Summary.of([30.0]).as_dict(),
    }


def test_targets_are_the_issues_ratios_of_one_runs_figures() -> None:
    results = {
        "machine": {},
        "latency": _latency({NODE: 100.0, POOLED: 90.0, COLD: 300.0, EPICBOX: 400.0, DOCKER_RUN: 600.0}),
        "throughput": {
            "duration_s": 8,
            "levels": [{"concurrency": 4, "service": {"per_second": 6.0}, "docker_run": {"per_second": 3.0}}],
        },
        "http_tool": {"added_p50_ms": 2.5},
        "allowlist": {"decisions_per_second": {"mix": 400_000.0}},
    }
    found = {t.name: (t.measured, t.verdict) for t in targets(results)}
    assert {value for name, value in found.items() if "session" in name} == {(None, "n/a")}  # not measured here
    assert {name: value for name, value in found.items() if "session" not in name} == {
        "pooled p50 / node -e p50": (0.9, "pass"),
        "cold p50 / epicbox p50": (0.75, "pass"),
        "cold p50 / docker run --rm p50": (0.5, "pass"),
        "throughput at 4: service / docker run loop": (2.0, "pass"),
        "HTTP tool added latency at p50": (2.5, "miss"),
        "allow-list decisions/s, 1,000 patterns (mix)": (400_000.0, "miss"),
        "runsc: pooled p50 / node -e p50": (None, "n/a"),
        "runsc: benign programs' total / under runc": (None, "n/a"),
        "back-to-back calls p50 / node -e p50": (None, "n/a"),
        "back-to-back calls p95 / node -e p50": (None, "n/a"),
        "runsc: back-to-back calls p50 / node -e p50": (None, "n/a"),
    }


def test_runsc_targets_are_ratios_against_node_and_against_runc_in_the_same_run() -> None:
    results = {
        "machine": {},
        "latency": _latency({NODE: 100.0, POOLED: 90.0, POOLED_RUNSC: 160.0, COLD: 300.0, COLD_RUNSC: 900.0}),
        "benign": {
            "programs": 29,
            "rounds": 2,
            "total_ms": {"runc": Summary.of([1000.0]).as_dict(), "runsc": Summary.of([1800.0]).as_dict()},
            "failures": {"runc": [], "runsc": ["gate:zlib: HTTP 200 {...}"]},
            "start_retries": {"runc": 0.0, "runsc": 3.0},
        },
        "throughput": {
            "duration_s": 8,
            "levels": [{"concurrency": 4, "service": {"per_second": 6.0}, "docker_run": {"per_second": 3.0}}],
            "runsc_levels": [{"concurrency": 4, "service": {"per_second": 3.0}}],
        },
    }
    found = {t.name: (t.measured, t.verdict) for t in targets(results)}
    assert found["runsc: pooled p50 / node -e p50"] == (1.6, "miss")
    assert found["runsc: benign programs' total / under runc"] == (1.8, "pass")
    table = runtimes_table(results)
    assert table is not None
    assert "cold p50" in table
    assert "3.00x" in table  # cold: 900 / 300
    assert "0.50x" in table  # throughput at 4: 3 / 6
    rows = {cells[0]: cells[1:3] for cells in (re.split(r"\s{2,}", line) for line in table.splitlines())}
    assert rows["benign programs with a wrong output"] == ["0", "1"]
    assert rows["crashes at start the pool retried"] == ["0", "3"]


def test_report_renders_a_partial_run_with_unmeasured_targets_marked() -> None:
    machine = {
        "date": "2026-01-01T00:00:00+00:00",
        "commit": "abc1234",
        "cpu_count": 2,
        "cpu_model": "cpu",
        "kernel": "6.1",
        "docker_engine": "20.10",
        "node_host": "v20",
        "load_average_start": [1.0, 1.0, 1.0],
    }
    text = render({"machine": machine, "latency": _latency({NODE: 100.0, POOLED: 120.0})})
    assert "service, warm pool" in text
    assert "1.20x" in text
    assert "paths in the audit log {'warm': 3}" in text
    assert "n/a" in text
    assert "miss" in text


def test_the_docker_run_baseline_has_the_services_container_flags() -> None:
    argv = docker_run_argv("metaagent-sandbox:test", 0.5)
    joined = " ".join(argv)
    for flags in [
        "run --rm",
        "--network none",
        "--read-only",
        "--tmpfs /tmp:rw,nosuid,nodev,noexec,size=100m,nr_inodes=16384,mode=1777",
        "--user 1001:1001",
        "--cap-drop ALL",
        "--security-opt no-new-privileges",
        "--memory 256m --memory-swap 256m",
        "--cpus 0.5",
        "--pids-limit 32",
        "--ulimit nofile=256:256",
        "--ipc none",
        "--log-driver none",
        "--entrypoint /usr/bin/dumb-init metaagent-sandbox:test -- /usr/bin/node -e console.log(1)",
    ]:
        assert flags in joined


def test_quick_runs_shorten_every_default_and_explicit_values_win() -> None:
    quick = parse_args(["--quick", "--rounds", "7"])
    full = parse_args([])
    assert quick.rounds == 7
    assert full.rounds > quick.warmup
    assert quick.duration < full.duration
    assert quick.http_iterations < full.http_iterations
    assert (full.session_rounds, full.session_transfers, full.idle_sessions, full.idle_seconds) == (30, 5, 20, 10.0)
    assert quick.idle_sessions < full.idle_sessions
    assert quick.idle_seconds < full.idle_seconds


def test_only_refuses_an_unknown_section(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--only", "latency,speed"])
    assert "unknown section(s) speed" in capsys.readouterr().err


def test_json_output_has_no_infinities() -> None:
    assert finite({"a": [math.inf, 1.0], "b": math.nan, "c": "x"}) == {"a": [None, 1.0], "b": None, "c": "x"}


def test_number_formats() -> None:
    assert format_number(0.8412, "x") == "0.84x"
    assert format_number(1234567.0, "/s") == "1,234,567/s"
    assert format_number(12.34, "ms") == "12.3 ms"
    assert format_number(None) == "-"


def test_process_cpu_is_user_plus_system_ticks_counted_after_the_command_name() -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    # The command name may hold spaces and parentheses; utime and stime are fields 14 and 15.
    fields = ["S", "1", "2", "3", "4", "5", "6", "7", "8", "9", "10", str(3 * ticks), str(ticks), "99", "99"]
    assert process_cpu_s(f"4242 (python (x) y) {' '.join(fields)} 20 0") == 4.0


def test_status_fields_are_read_in_kib_and_a_missing_one_is_an_error() -> None:
    status = "Name:\tpython\nVmHWM:\t  120000 kB\nVmRSS:\t   93844 kB\n"
    assert status_kib(status, "VmRSS") == 93844
    assert status_kib(status, "VmHWM") == 120000
    with pytest.raises(ValueError, match="VmSwap"):
        status_kib(status, "VmSwap")


def test_transfer_rate_is_mebibytes_per_second() -> None:
    assert mib_per_second(10 * 1024 * 1024, 200.0) == 50.0
    assert math.isinf(mib_per_second(1, 0.0))


def _sessions_section(call: float, create: float, node: float, up: float, down: float, growth: float) -> object:
    return {
        "rounds": 3,
        "summaries": {
            name: Summary.of([p50]).as_dict() for name, p50 in ((CALL, call), (CREATE, create), (SESSIONS_NODE, node))
        },
        "create_paths": {"warm": 3},
        "files": {
            "upload_mib_s": up,
            "download_mib_s": down,
            "rss_before_kib": 90 * 1024,
            "rss_peak_kib": 100 * 1024,
            "growth_per_file": growth,
        },
        "idle": {
            "sessions": 20,
            "seconds": 10.0,
            "service_cpu_s_alone": 0.01,
            "service_cpu_s": 0.02,
            "containers_cpu_s": 0.005,
            "container_cpu_s_max": 0.001,
            "rss_kib": {"before": 90 * 1024, "open": 95 * 1024, "after_idle": 95 * 1024},
        },
    }


def test_session_targets_are_ratios_to_node_and_rates_of_each_runtime_in_the_same_run() -> None:
    results = {
        "machine": {},
        "sessions": {
            "runc": _sessions_section(call=5.0, create=40.0, node=80.0, up=80.0, down=120.0, growth=0.5),
            "runsc": _sessions_section(call=30.0, create=100.0, node=80.0, up=20.0, down=60.0, growth=3.0),
        },
    }
    found = {t.name: (t.measured, t.verdict) for t in targets(results)}
    assert found["session call (1+1) p50 / node -e p50"] == (0.0625, "pass")
    assert found["POST /sessions, pool warm, p50 / node -e p50"] == (0.5, "pass")
    assert found["session: 10 MiB upload"] == (80.0, "pass")
    assert found["session: service RSS growth / file size"] == (0.5, "pass")
    assert found["runsc: session call (1+1) p50 / node -e p50"] == (0.375, "miss")
    assert found["runsc: POST /sessions, pool warm, p50 / node -e p50"] == (1.25, "miss")
    assert found["runsc: session: 10 MiB upload"] == (20.0, "miss")
    assert found["runsc: session: 10 MiB download"] == (60.0, "pass")
    assert found["runsc: session: service RSS growth / file size"] == (3.0, "miss")
    table = sessions_table(results)
    assert table is not None
    rows = {cells[0]: cells[1:] for cells in (re.split(r"\s{2,}", line) for line in table.splitlines())}
    assert rows["call p50 / node -e p50"] == ["0.06x", "0.38x"]
    assert rows["10 MiB upload, p50"] == ["80.0 MiB/s", "20.0 MiB/s"]
    assert rows["the 20 containers' CPU, together"] == ["0.005 s", "0.005 s"]
    assert rows["service RSS, all open"] == ["95.0 MiB", "95.0 MiB"]


def test_session_targets_are_not_applicable_without_the_sessions_section() -> None:
    found = {t.name: t.verdict for t in targets({"machine": {}})}
    assert found["session: 10 MiB download"] == "n/a"
    assert found["runsc: session call (1+1) p50 / node -e p50"] == "n/a"
    assert sessions_table({"machine": {}}) is None
