"""The benchmarks' arithmetic and wiring (bench/): statistics, ratios, targets, the baseline's flags.

No timing is asserted here: the benchmarks measure, `scripts/bench` runs them.
"""

from __future__ import annotations

import math
import os
import re
import struct
import threading
import time

import pytest

from bench.__main__ import finite, parse_args
from bench.baselines import docker_run_argv
from bench.cpustat import (
    CLIENT,
    CONTAINER,
    CONTAINERD,
    DOCKERD,
    RUNTIME,
    SHIM,
    ExitRecord,
    Ledger,
    Process,
    Window,
    background_rate,
    cgroup_path,
    classify,
    exit_records,
    family_id,
    is_runtime_invocation,
    parse_schedstat,
    parse_stat,
    per_execution,
    process_label,
    shim_container_id,
)
from bench.cpuwatch import TaskstatsSocket, WatchUnavailable
from bench.latency import COLD, COLD_RUNSC, DOCKER_RUN, EPICBOX, NODE, POOLED, POOLED_RUNSC
from bench.python import process_cpu_ns
from bench.report import cpu_tables, render, runtimes_table, sessions_table, targets
from bench.sessions import CALL, CREATE, mib_per_second, process_cpu_s, status_kib
from bench.sessions import NODE as SESSIONS_NODE
from bench.stats import Summary, Target, format_number, percentile, ratio
from bench.syscalls import grouped, parse_strace_summary
from metaagent.sandbox.runtime import RUNSC


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
        "host CPU per execution: pooled / docker run --rm": (None, "n/a"),
        "runsc: host CPU per execution: pooled / docker run --rm": (None, "n/a"),
        "issue 26, runsc: back-to-back p50 / node -e": (None, "n/a"),
        "issue 26, runsc: back-to-back p95 / node -e": (None, "n/a"),
        "issue 26, runsc: CPU per pooled execution / docker run": (None, "n/a"),
        "issue 26, runsc: throughput at 4 / docker run loop": (None, "n/a"),
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
            "runsc_levels": [
                {"concurrency": 4, "service": {"per_second": 3.0}, "docker_run": {"per_second": 1.5}},
            ],
        },
        "sequential": {"runtimes": {"runsc": {"p50_ratio": 1.6, "p95_ratio": 4.5}}},
    }
    found = {t.name: (t.measured, t.verdict) for t in targets(results)}
    assert found["runsc: pooled p50 / node -e p50"] == (1.6, "miss")
    # issue 26's, of the default runtime: against node, and against a plain runsc start's loop
    assert found["issue 26, runsc: back-to-back p50 / node -e"] == (1.6, "pass")
    assert found["issue 26, runsc: back-to-back p95 / node -e"] == (4.5, "miss")
    assert found["issue 26, runsc: throughput at 4 / docker run loop"] == (2.0, "miss")
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


# --- the CPU section (bench/cpustat.py, bench/report.py) ---


def test_a_proc_stat_line_is_read_past_a_name_with_spaces_and_parentheses() -> None:
    fields = ["S", "45", "1", "1", "0", "-1", "4194560", "10", "0", "0", "0", "7", "3", "11", "2", "20", "0", "1"]
    line = "123 (a b) c) " + " ".join([*fields, "0", "98765", "2400256"]) + "\n"
    stat = parse_stat(line)
    assert (stat.pid, stat.comm, stat.ppid) == (123, "a b) c", 45)
    assert (stat.utime, stat.stime, stat.cutime, stat.cstime, stat.starttime) == (7, 3, 11, 2, 98765)


def test_schedstat_gives_a_threads_time_on_a_cpu_in_nanoseconds() -> None:
    assert parse_schedstat("200757511 1200 35\n") == 200757511


def test_a_process_cpu_time_counts_every_thread_of_it() -> None:
    def main_thread_ns() -> int:
        with open(f"/proc/self/task/{threading.main_thread().native_id}/schedstat") as stat:
            return parse_schedstat(stat.read())

    worked, release = threading.Event(), threading.Event()

    def work() -> None:
        sum(range(2_000_000))
        worked.set()
        release.wait()  # still alive, so still listed, when the total is read

    before, main_before = process_cpu_ns(os.getpid()), main_thread_ns()
    worker = threading.Thread(target=work)
    worker.start()
    worked.wait()
    after, main_after = process_cpu_ns(os.getpid()), main_thread_ns()
    release.set()
    worker.join()
    assert after - before > main_after - main_before


def test_the_cpuacct_cgroup_is_found_in_v1_and_the_unified_path_in_v2() -> None:
    v1 = "9:name=systemd:/\n2:cpuacct:/docker/abc\n1:cpu:/docker/abc\n0::/\n"
    assert cgroup_path(v1) == "/docker/abc"
    assert cgroup_path("4:cpu,cpuacct:/x\n") == "/x"
    assert cgroup_path("0::/system.slice/docker-abc.scope\n") == "/system.slice/docker-abc.scope"


def test_a_shims_container_is_the_value_of_its_id_flag() -> None:
    argv = ["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", "abc123", "-address", "/x.sock"]
    assert shim_container_id(argv) == "abc123"
    assert shim_container_id(["containerd", "--config", "x"]) is None


@pytest.mark.parametrize(
    ("argv", "label"),
    [
        (
            ["runc", "--root", "/r", "--log", "/l.json", "--log-format", "json", "create", "--bundle", "/b", "id"],
            "runc create",
        ),
        (["/usr/bin/runc", "init"], "runc init"),
        (["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", "x", "start"], "containerd-shim start"),
        (["/usr/bin/containerd-shim-runc-v2", "-namespace", "moby", "-id", "x", "-address", "/s"], "containerd-shim"),
        (["/bin/sh", "/var/lib/docker/runtimes/runsc", "--root", "/r", "delete", "id"], "sh runsc delete"),
        (["runsc-sandbox", "--root=/r", "--network=none", "boot", "--bundle=/b", "id"], "runsc-sandbox boot"),
        (["libnetwork-setkey", "-exec-root=/var/run/docker", "abc", "def"], "libnetwork-setkey"),
        (["/usr/bin/node", "/opt/runner/runner.js"], "node"),
        ([""], "dumb-init"),
    ],
)
def test_a_process_is_labelled_by_its_program_and_the_runtimes_subcommand(argv: list[str], label: str) -> None:
    assert process_label("dumb-init", argv) == label


@pytest.mark.parametrize(
    ("label", "invocation"),
    [
        ("runc create", True),
        ("runc delete", True),
        ("runc", True),
        ("sh runsc start", True),
        ("libnetwork-setkey", True),
        ("runc init", False),
        ("runsc-sandbox boot", False),
        ("runsc-gofer gofer", False),
        ("node", False),
        ("", False),
    ],
)
def test_runs_of_the_runtimes_command_and_hooks_are_invocations(label: str, invocation: bool) -> None:
    assert is_runtime_invocation(label) is invocation


def _taskstats(*, version: int, tid: int, tgid: int, ppid: int, comm: bytes, virtual_ns: int, utime_us: int) -> bytes:
    """A struct taskstats laid out as linux/taskstats.h says (version 11 and on)."""
    stats = bytearray(400)
    struct.pack_into("=H", stats, 0, version)
    struct.pack_into("=Q", stats, 72, virtual_ns)  # cpu_run_virtual_total
    stats[80 : 80 + len(comm)] = comm  # ac_comm[32]
    struct.pack_into("=II", stats, 128, tid, ppid)  # ac_pid, ac_ppid
    struct.pack_into("=QQ", stats, 152, utime_us, 0)  # ac_utime, ac_stime
    struct.pack_into("=Q", stats, 344, 1_700_000_000)  # ac_btime64
    struct.pack_into("=I", stats, 368, tgid)  # ac_tgid
    return bytes(stats)


def _attribute(kind: int, payload: bytes) -> bytes:
    length = 4 + len(payload)
    return struct.pack("=HH", length, kind) + payload + b"\0" * (-length % 4)


def _datagram(family: int, *stats: bytes) -> bytes:
    messages = b""
    for one in stats:
        nested = _attribute(1, struct.pack("=I", 7)) + _attribute(3, one)  # TASKSTATS_TYPE_PID, _STATS
        body = struct.pack("=BBH", 2, 1, 0) + _attribute(4 | 0x8000, nested)  # CMD_NEW; AGGR_PID, nested flag
        messages += struct.pack("=IHHII", 16 + len(body), family, 0, 0, 0) + body
    return messages


def test_exit_records_carry_each_threads_ids_name_and_scheduler_time() -> None:
    first = _taskstats(version=16, tid=5, tgid=4, ppid=3, comm=b"runc:[1:CHILD]", virtual_ns=1_234_567, utime_us=4000)
    second = _taskstats(version=11, tid=9, tgid=9, ppid=4, comm=b"node", virtual_ns=0, utime_us=8000)
    records = exit_records(_datagram(31, first, second) + _datagram(99, first), 31)
    assert records == [
        ExitRecord(tid=5, tgid=4, ppid=3, comm="runc:[1:CHILD]", cpu_ns=1_234_567, start_s=1_700_000_000),
        # No scheduler sum from the kernel: the tick-sampled times, flagged as such.
        ExitRecord(tid=9, tgid=9, ppid=4, comm="node", cpu_ns=8_000_000, start_s=1_700_000_000, sampled=True),
    ]


def test_an_exit_record_without_the_thread_group_id_is_skipped() -> None:
    old = _taskstats(version=10, tid=5, tgid=4, ppid=3, comm=b"x", virtual_ns=10, utime_us=0)
    assert exit_records(_datagram(31, old), 31) == []


def test_the_taskstats_family_id_is_read_from_the_controllers_reply() -> None:
    body = struct.pack("=BBH", 1, 2, 0) + _attribute(2, b"TASKSTATS\0") + _attribute(1, struct.pack("=H", 31))
    reply = struct.pack("=IHHII", 16 + len(body), 0x10, 0, 1, 0) + body
    assert family_id(reply) == 31
    error = struct.pack("=IHHII", 36, 2, 0, 1, 0) + struct.pack("=i", -2) + bytes(16)
    assert family_id(error) is None


def _exit(tid: int, tgid: int, cpu_ns: int) -> ExitRecord:
    return ExitRecord(tid=tid, tgid=tgid, ppid=1, comm="x", cpu_ns=cpu_ns)


def test_the_ledger_counts_growth_of_a_running_thread_and_all_of_one_born_in_between() -> None:
    ledger = Ledger()
    ledger.observe(1, 1, 100)
    start = ledger.mark()
    ledger.observe(1, 1, 150)
    ledger.observe(2, 1, 30)
    end = ledger.mark()
    assert ledger.between(start, end) == {1: 80}
    assert ledger.between(start, end, exclude={2}) == {1: 50}


def test_the_ledger_counts_a_thread_up_to_its_exit_and_ignores_a_reading_of_its_zombie() -> None:
    ledger = Ledger()
    ledger.observe(3, 7, 10)
    start = ledger.mark()
    ledger.exited(_exit(3, 7, 25))
    ledger.observe(3, 7, 25)  # /proc still shows it until it is reaped
    middle = ledger.mark()
    ledger.observe(3, 7, 25)
    end = ledger.mark()
    assert ledger.between(start, middle) == {7: 15}
    assert ledger.between(middle, end) == {}


def test_the_ledger_takes_a_reused_thread_id_for_a_new_thread() -> None:
    ledger = Ledger()
    ledger.exited(_exit(5, 1, 100))
    start = ledger.mark()
    ledger.observe(5, 9, 7)
    end = ledger.mark()
    assert ledger.between(start, end) == {9: 7}


def test_the_ledger_forgets_only_what_later_intervals_do_not_need() -> None:
    ledger = Ledger()
    ledger.observe(1, 1, 100)
    ledger.exited(_exit(2, 2, 40))
    first = ledger.mark()
    ledger.observe(1, 1, 120)
    second = ledger.mark()
    ledger.forget_before(first)
    ledger.observe(1, 1, 125)
    third = ledger.mark()
    assert ledger.between(first, second) == {1: 20}
    assert ledger.between(second, third) == {1: 5}


DOCKERD_PID, CONTAINERD_PID, SERVICE_PID, BENCH_PID = 2, 3, 40, 70


def _runc_tree() -> dict[int, Process]:
    """An execution under runc as /proc and the exit records show it, with another user's beside it."""
    return {
        9: Process(CONTAINERD_PID, "containerd-shim", label="containerd-shim start"),  # the shim's launcher
        10: Process(9, "containerd-shim", label="containerd-shim"),
        11: Process(10, "runc", "/", label="runc create"),
        12: Process(11, "dumb-init", "/docker/abc", label="runc init → dumb-init"),
        13: Process(12, "node", "/docker/abc", label="node"),
        14: Process(11, "runc:[1:CHILD]"),  # never seen running: known from its exit record
        15: Process(11, "exe", "/", label="libnetwork-setkey"),
        16: Process(10, "runc"),
        20: Process(DOCKERD_PID, "exe", "/", label="set-ipv6", args=("set-ipv6", "/var/run/docker/netns/ns1", "all")),
        21: Process(DOCKERD_PID, "exe", "/", label="set-ipv6", args=("set-ipv6", "/var/run/docker/netns/other")),
        22: Process(CONTAINERD_PID, "containerd-shim"),  # someone's launcher, never seen
        30: Process(1, "containerd-shim", label="containerd-shim"),  # another user's container
        31: Process(30, "runc", "/", label="runc create"),
        SERVICE_PID: Process(BENCH_PID, "python", label="python"),
    }


def test_an_executions_processes_under_runc_are_sorted_into_its_parts() -> None:
    processes = _runc_tree()
    found = classify(
        processes,
        processes,
        shims={10: "abc"},
        dockerd=[DOCKERD_PID],
        containerd=[CONTAINERD_PID],
        clients=[SERVICE_PID],
        keys=["abc", "ns1"],
    )
    assert found == {
        9: CONTAINERD,
        10: SHIM,
        11: RUNTIME,
        12: CONTAINER,
        13: CONTAINER,
        14: CONTAINER,  # one of runc's init stages
        15: RUNTIME,
        16: RUNTIME,
        20: DOCKERD,
        SERVICE_PID: CLIENT,
    }


def test_runcs_init_stages_are_the_containers_though_never_seen_in_its_cgroup() -> None:
    processes = {10: Process(1, "containerd-shim"), 11: Process(10, "runc"), 14: Process(11, "runc:[1:CHILD]")}
    found = classify([14], processes, shims={10: "abc"}, dockerd=[2], containerd=[3])
    assert found == {14: CONTAINER}


def test_under_runsc_the_runtimes_runs_are_the_runtimes_even_inside_the_containers_cgroup() -> None:
    processes = {
        50: Process(1, "containerd-shim", label="containerd-shim"),
        51: Process(50, "runsc", "/", label="sh runsc create"),
        52: Process(51, "runsc", "/def", label="runsc create"),  # runsc create joins the cgroup
        53: Process(52, "exe", "/def", label="runsc-gofer gofer"),
        54: Process(52, "exe", "/def", label="runsc-sandbox boot"),
        55: Process(54, "exe"),  # a stub of the sandbox, never seen running
        56: Process(52, "exe", "/def", label="libnetwork-setkey"),  # a hook runsc create ran
        57: Process(52, "exe"),  # a helper of runsc create, never seen running
    }
    found = classify(processes, processes, shims={50: "def"}, dockerd=[2], containerd=[3])
    assert found == {
        50: SHIM,
        51: RUNTIME,
        52: RUNTIME,
        53: CONTAINER,
        54: CONTAINER,
        55: CONTAINER,
        56: RUNTIME,
        57: RUNTIME,
    }


def test_the_docker_clis_are_the_clients_of_docker_run_and_no_other_child_is() -> None:
    processes = {60: Process(BENCH_PID, "docker"), 61: Process(BENCH_PID, "python"), BENCH_PID: Process(1, "python")}
    found = classify(processes, processes, shims={}, dockerd=[2], containerd=[3], client_children=(BENCH_PID, "docker"))
    assert found == {60: CLIENT}


def test_per_execution_cpu_subtracts_the_engines_background_over_each_window_and_never_goes_below_zero() -> None:
    windows = [
        Window(2, 1.0, {DOCKERD: 50.0, CONTAINERD: 5.0, SHIM: 20.0, CONTAINER: 200.0, CLIENT: 10.0}),
        Window(2, 3.0, {DOCKERD: 90.0, CONTAINERD: 5.0, SHIM: 20.0, CONTAINER: 200.0, CLIENT: 10.0}),
    ]
    found = per_execution(windows, {DOCKERD: 10.0, CONTAINERD: 10.0})
    assert found[DOCKERD] == pytest.approx((140 - 40) / 4)
    assert found[CONTAINERD] == 0.0  # 10 measured, 40 of background: clamped
    assert found[SHIM] == pytest.approx(10.0)
    assert found[RUNTIME] == 0.0
    assert found["total"] == pytest.approx(25 + 10 + 100 + 5)
    assert per_execution([], {})["total"] == 0.0
    unclamped = per_execution(windows, {DOCKERD: 10.0, CONTAINERD: 10.0}, clamp=False)
    assert unclamped[CONTAINERD] == pytest.approx((10 - 40) / 4)  # a phase's share keeps its sign


def test_the_background_rate_is_the_engines_cpu_over_the_idle_windows_time() -> None:
    idle = [Window(0, 1.0, {DOCKERD: 3.0, CONTAINERD: 1.0, SHIM: 99.0}), Window(0, 3.0, {DOCKERD: 9.0})]
    assert background_rate(idle) == {DOCKERD: 3.0, CONTAINERD: 0.25}
    assert background_rate([]) == {DOCKERD: 0.0, CONTAINERD: 0.0}


def _cpu_row(name: str, runtime: str, total: float) -> dict[str, object]:
    per = {DOCKERD: 0.1 * total, CONTAINERD: 0.0, SHIM: 0.0, RUNTIME: 0.2 * total, CONTAINER: 0.7 * total, CLIENT: 0.0}
    return {
        "name": name,
        "runtime": runtime,
        "per_execution_ms": {**per, "total": total},
        "by_process_ms": {"container: node": 0.7 * total},
        "processes_per_execution": {SHIM: 1.0, RUNTIME: 4.0, CONTAINER: 3.0},
        "foreign_container_exits": 1,
    }


def test_the_cpu_target_is_the_pooled_services_cpu_over_docker_runs_under_the_same_runtime() -> None:
    rows = [
        _cpu_row(POOLED, "runc", 150.0),
        _cpu_row(COLD, "runc", 330.0),
        _cpu_row(DOCKER_RUN, "runc", 300.0),
        _cpu_row(POOLED, "runsc", 500.0),
        _cpu_row(DOCKER_RUN, "runsc", 625.0),
    ]
    cpu = {
        "rounds": 2,
        "batch": 2,
        "contenders": rows,
        "background_ms_per_s": {DOCKERD: 1.0, CONTAINERD: 0.5},
        "idle_seconds": 12.0,
        "idle_foreign_container_exits": 0,
        "lost_record_datagrams": 0,
        "sampled_records": 0,
        "phase_iterations": 1,
        "phases_ms": {"runc": {"warm": {"create": {DOCKERD: 5.0, "wall": 9.0}, "idle in the pool": {SHIM: 1.0}}}},
    }
    found = {t.name: (t.measured, t.verdict) for t in targets({"cpu": cpu})}
    assert found["host CPU per execution: pooled / docker run --rm"] == (0.5, "pass")
    assert found["runsc: host CPU per execution: pooled / docker run --rm"] == (0.8, "miss")
    text = cpu_tables({"cpu": cpu})
    assert text is not None
    lines = {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in text.splitlines())}
    assert lines["service, pool off"][-1] == "1.10x"  # 330 / 300, the docker run of its own runtime
    assert lines["total (idle left out)"][1:3] == ["5.00 ms", "0.00 ms"]  # the idle phase is not in the total
    assert "container: node" in text


def test_a_cpu_section_that_could_not_run_says_why() -> None:
    assert cpu_tables({"cpu": {"unavailable": "needs root"}}) == "Host CPU per execution: not measured (needs root)"
    assert cpu_tables({}) is None


def test_the_runsc_docker_run_baseline_has_the_services_runsc_limits() -> None:
    joined = " ".join(docker_run_argv("metaagent-sandbox:test", 0.5, RUNSC))
    assert "--runtime runsc" in joined
    assert f"--pids-limit {RUNSC.pids_limit()}" in joined
    assert "--ulimit nproc=32:32" in joined
    assert "--runtime" not in " ".join(docker_run_argv("metaagent-sandbox:test", 0.5))


def test_quick_runs_shorten_the_cpu_section_too() -> None:
    quick, full = parse_args(["--quick", "--only", "cpu"]), parse_args([])
    assert quick.only == ["cpu"]
    assert quick.cpu_rounds < full.cpu_rounds
    assert quick.cpu_phase_iterations < full.cpu_phase_iterations


def test_the_kernel_reports_a_childs_exit_with_its_ids_and_no_more_cpu_than_its_parent_is_told() -> None:
    if os.geteuid() != 0:  # the kernel refuses the listener; the section then says it needs root
        with pytest.raises(WatchUnavailable, match="run as root"):
            TaskstatsSocket()
        return
    listener = TaskstatsSocket()
    try:
        pid = os.fork()
        if pid == 0:
            began = time.thread_time()
            while time.thread_time() - began < 0.02:
                pass
            os._exit(0)
        _, _, usage = os.wait4(pid, 0)
        records = [record for record in listener.drain() if record.tgid == pid]  # sent before the parent hears
    finally:
        listener.close()
    assert [(record.tid, record.ppid, record.sampled) for record in records] == [(pid, os.getpid(), False)]
    # The record is made before the process leaves the CPU: at most what the parent is told at the reap.
    assert 0 < records[0].cpu_ns <= (usage.ru_utime + usage.ru_stime) * 1e9 + 1000


def test_strace_summaries_are_read_with_or_without_errors_and_grouped_by_kind() -> None:
    summary = """% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 67.13    0.031666         340        93         5 futex
  2.96    0.001397           6       213       103 openat
  2.33    0.001099           6       165           mmap
  0.10    0.000045          22         2           set_tid_address
  0.05    0.000030           1        10           rt_sigaction
  0.01    0.000010           1         4           write
------ ----------- ----------- --------- --------- ----------------
100.00    0.034247          70       487       108 total
"""
    calls = parse_strace_summary(summary)
    assert calls == {"futex": 93, "openat": 213, "mmap": 165, "set_tid_address": 2, "rt_sigaction": 10, "write": 4}
    groups = grouped(calls)
    assert list(groups.values()) == [165, 213, 95, 10, 4]  # memory, files, threads, signals, other
    assert sum(groups.values()) == 487
