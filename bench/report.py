"""The issue's targets judged on one run's results, and the results as text tables."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench import sessions
from bench.latency import COLD, COLD_RUNSC, DOCKER_RUN, EPICBOX, NODE, POOLED, POOLED_RUNSC
from bench.stats import Target, format_number, ratio


def _p50(results: dict[str, Any], name: str) -> float | None:
    summary = results.get("latency", {}).get("summaries", {}).get(name)
    return None if summary is None else float(summary["p50"])


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or denominator is None else ratio(numerator, denominator)


def _throughput_ratio(results: dict[str, Any], concurrency: int) -> float | None:
    for level in results.get("throughput", {}).get("levels", []):
        if level["concurrency"] == concurrency:
            return ratio(level["service"]["per_second"], level["docker_run"]["per_second"])
    return None


def _runsc_throughput(results: dict[str, Any], concurrency: int) -> tuple[float | None, float | None]:
    """(runsc's executions/s, runc's) at one concurrency, where both were measured."""
    found = results.get("throughput", {})
    runc = next(
        (lv["service"]["per_second"] for lv in found.get("levels", []) if lv["concurrency"] == concurrency), None
    )
    runsc = next(
        (lv["service"]["per_second"] for lv in found.get("runsc_levels", []) if lv["concurrency"] == concurrency), None
    )
    return runsc, runc


def _runsc_loop_ratio(results: dict[str, Any], concurrency: int) -> float | None:
    """The runsc service's executions/s over a `docker run --rm --runtime=runsc` loop's at one concurrency."""
    for level in results.get("throughput", {}).get("runsc_levels", []):
        if level["concurrency"] == concurrency and "docker_run" in level:
            return _ratio(level["service"]["per_second"], level["docker_run"]["per_second"])
    return None


def _benign_ratio(results: dict[str, Any]) -> float | None:
    totals = results.get("benign", {}).get("total_ms", {})
    if "runsc" not in totals or "runc" not in totals:
        return None
    return ratio(totals["runsc"]["p50"], totals["runc"]["p50"])


def _session_ratio(results: dict[str, Any], name: str, runtime: str = "runc") -> float | None:
    """A sessions row's p50 over bare node -e's, both of the sessions section's own rounds."""
    summaries = results.get("sessions", {}).get(runtime, {}).get("summaries", {})
    if name not in summaries or sessions.NODE not in summaries:
        return None
    return ratio(summaries[name]["p50"], summaries[sessions.NODE]["p50"])


def _session_files(results: dict[str, Any], key: str, runtime: str = "runc") -> float | None:
    value = results.get("sessions", {}).get(runtime, {}).get("files", {}).get(key)
    return None if value is None else float(value)


def _session_targets(results: dict[str, Any], runtime: str) -> list[Target]:
    """Issue 15's targets on one runtime's sessions section (runsc's named so; both are judged, as runsc
    is the runtime in force wherever it works)."""
    prefix = "" if runtime == "runc" else f"{runtime}: "
    call, create = _session_ratio(results, sessions.CALL, runtime), _session_ratio(results, sessions.CREATE, runtime)
    return [
        Target(f"{prefix}session call (1+1) p50 / node -e p50", call, "<=", 0.25, "x"),
        Target(f"{prefix}POST /sessions, pool warm, p50 / node -e p50", create, "<=", 1, "x"),
        Target(f"{prefix}session: 10 MiB upload", _session_files(results, "upload_mib_s", runtime), ">=", 50, "MiB/s"),
        Target(
            f"{prefix}session: 10 MiB download", _session_files(results, "download_mib_s", runtime), ">=", 50, "MiB/s"
        ),
        Target(
            f"{prefix}session: service RSS growth / file size",
            _session_files(results, "growth_per_file", runtime),
            "<",
            3,
            "x",
        ),
    ]


def _sequential(results: dict[str, Any], runtime: str, key: str) -> float | None:
    measured = results.get("sequential", {}).get("runtimes", {}).get(runtime)
    return None if measured is None else float(measured[key])


def targets(results: dict[str, Any]) -> list[Target]:
    pooled, cold = _p50(results, POOLED), _p50(results, COLD)
    http = results.get("http_tool")
    allowlist = results.get("allowlist")
    return [
        Target("pooled p50 / node -e p50", _ratio(pooled, _p50(results, NODE)), "<=", 1.0, "x"),
        Target("cold p50 / epicbox p50", _ratio(cold, _p50(results, EPICBOX)), "<=", 0.9, "x"),
        Target("cold p50 / docker run --rm p50", _ratio(cold, _p50(results, DOCKER_RUN)), "<=", 0.6, "x"),
        Target("throughput at 4: service / docker run loop", _throughput_ratio(results, 4), ">=", 1.5, "x"),
        Target("HTTP tool added latency at p50", http["added_p50_ms"] if http else None, "<=", 2.0, "ms"),
        Target(
            "allow-list decisions/s, 1,000 patterns (mix)",
            allowlist["decisions_per_second"]["mix"] if allowlist else None,
            ">=",
            500_000,
            "/s",
        ),
        Target(
            "runsc: pooled p50 / node -e p50", _ratio(_p50(results, POOLED_RUNSC), _p50(results, NODE)), "<=", 1.5, "x"
        ),
        Target("runsc: benign programs' total / under runc", _benign_ratio(results), "<=", 2.0, "x"),
        Target("back-to-back calls p50 / node -e p50", _sequential(results, "runc", "p50_ratio"), "<=", 1.0, "x"),
        Target("back-to-back calls p95 / node -e p50", _sequential(results, "runc", "p95_ratio"), "<=", 3.0, "x"),
        Target(
            "runsc: back-to-back calls p50 / node -e p50", _sequential(results, "runsc", "p50_ratio"), "<=", 1.5, "x"
        ),
        *(target for runtime in ("runc", "runsc") for target in _session_targets(results, runtime)),
        *cpu_targets(results),
        *default_runtime_targets(results),
        *fleet_targets(results),
    ]


def fleet_targets(results: dict[str, Any]) -> list[Target]:
    """Issue 25's, under each runtime measured: what forwarding adds, and two nodes beside one."""
    fleet = results.get("fleet") or {}
    return [
        target
        for runtime, m in fleet.items()
        for target in (
            Target(
                f"{runtime}: fleet, a forwarded session call adds at p50",
                m["forwarded_call"]["added_p50_ms"],
                "<=",
                3.0,
                "ms",
            ),
            Target(f"{runtime}: fleet, two nodes / one node at 8 callers", m["throughput"]["ratio"], ">=", 0.9, "x"),
        )
    ]


def fleet_table(results: dict[str, Any]) -> str | None:
    fleet = results.get("fleet")
    if not fleet:
        return None
    rows = []
    for runtime, m in fleet.items():
        call, rates = m["forwarded_call"], m["throughput"]
        rows.append(
            [
                runtime,
                format_number(call["direct"]["p50"], "ms"),
                format_number(call["forwarded"]["p50"], "ms"),
                format_number(call["added_p50_ms"], "ms"),
                format_number(rates["one_node_per_second"], "/s"),
                format_number(rates["two_nodes_per_second"], "/s"),
                format_number(rates["ratio"], "x"),
            ]
        )
    return "Fleet: two nodes (network namespaces with their own engines) on this machine, one Redis\n" + table(
        ["runtime", "session 1+1 via a", "via b (forwarded)", "added", "8 callers on a", "spread on a+b", "ratio"],
        rows,
    )


def default_runtime_targets(results: dict[str, Any]) -> list[Target]:
    """Issue 26's: the default runtime (runsc) against node and against a plain runsc start, in one run."""
    return [
        Target("issue 26, runsc: back-to-back p50 / node -e", _sequential(results, "runsc", "p50_ratio"), "<=", 2, "x"),
        Target("issue 26, runsc: back-to-back p95 / node -e", _sequential(results, "runsc", "p95_ratio"), "<=", 4, "x"),
        Target(
            "issue 26, runsc: CPU per pooled execution / docker run",
            cpu_ratio(results, POOLED, "runsc"),
            "<=",
            0.4,
            "x",
        ),
        Target("issue 26, runsc: throughput at 4 / docker run loop", _runsc_loop_ratio(results, 4), ">=", 2.5, "x"),
        Target(
            "issue 26, runsc: session call (1+1) / node -e",
            _session_ratio(results, sessions.CALL, "runsc"),
            "<=",
            0.08,
            "x",
        ),
        Target(
            "issue 26, runsc: POST /sessions warm / node -e",
            _session_ratio(results, sessions.CREATE, "runsc"),
            "<=",
            0.3,
            "x",
        ),
    ]


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=False)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = cells
        return "  ".join([first.ljust(widths[0]), *(cell.rjust(w) for cell, w in zip(rest, widths[1:], strict=True))])

    return "\n".join([line(headers), "  ".join("-" * w for w in widths), *(line(row) for row in rows)])


def render(results: dict[str, Any]) -> str:
    parts: list[str] = []
    machine = results["machine"]
    parts.append(
        f"metaagent benchmarks, {machine['date']}, commit {machine['commit']}: {machine['cpu_count']} CPUs "
        f"({machine['cpu_model']}), kernel {machine['kernel']}, Docker {machine['docker_engine']}, "
        f"host node {machine['node_host']}; load average {machine['load_average_start']} at the start, "
        f"{machine.get('load_average_end')} at the end"
    )
    latency = results.get("latency")
    if latency:
        node = _p50(results, NODE)
        rows = [
            [
                name,
                format_number(s["p50"], "ms"),
                format_number(s["p95"], "ms"),
                format_number(s["mean"], "ms"),
                format_number(_ratio(s["p50"], node), "x"),
                str(s["n"]),
            ]
            for name, s in latency["summaries"].items()
        ]
        parts.append(
            f"Latency of console.log(1), end to end ({latency['rounds']} rounds, shuffled order)\n"
            + table(["contender", "p50", "p95", "mean", "p50 / node -e", "n"], rows)
        )
        notes = []
        for key, label in (("pooled", "warm pool"), ("cold", "pool off")):
            if f"{key}_paths" in latency:
                code, outside = latency[f"{key}_code_duration_ms"], latency[f"{key}_outside_code_ms"]
                notes.append(
                    f"{label}: paths in the audit log {latency[f'{key}_paths']}; per request, the code's run "
                    f"(hand-over to exit, the response's duration_ms) p50 {format_number(code['p50'], 'ms')}, "
                    f"the rest p50 {format_number(outside['p50'], 'ms')}"
                )
        parts.append("\n".join(notes))
    throughput = results.get("throughput")
    if throughput:
        rows = []
        for level in throughput["levels"]:
            svc, loop = level["service"], level["docker_run"]
            rows.append(
                [
                    str(level["concurrency"]),
                    format_number(svc["per_second"], "/s"),
                    f"{svc['errors']}/{svc['rejected']}",
                    f"{svc.get('warm', '-')}/{svc.get('cold', '-')}",
                    format_number(loop["per_second"], "/s"),
                    str(loop["errors"]),
                    format_number(ratio(svc["per_second"], loop["per_second"]), "x"),
                ]
            )
        parts.append(
            f"Throughput, executions/s over {throughput['duration_s']:g} s per level (service: warm pool on)\n"
            + table(["concurrency", "service", "errors/429", "warm/cold", "docker run loop", "errors", "ratio"], rows)
        )
    runtimes = runtimes_table(results)
    if runtimes:
        parts.append(runtimes)
    http = results.get("http_tool")
    if http:
        rows = [
            [
                "direct httpx2 request",
                format_number(http["direct_ms"]["p50"], "ms"),
                format_number(http["direct_ms"]["p95"], "ms"),
            ],
            [
                "POST /tools/http",
                format_number(http["tool_ms"]["p50"], "ms"),
                format_number(http["tool_ms"]["p95"], "ms"),
            ],
            ["added by the tool", format_number(http["added_p50_ms"], "ms"), format_number(http["added_p95_ms"], "ms")],
        ]
        parts.append(
            f"HTTP tool to a local server on 127.0.0.1 ({http['iterations']} requests each)\n"
            + table(["", "p50", "p95"], rows)
        )
    allowlist = results.get("allowlist")
    if allowlist:
        rows = [[kind, format_number(value, "/s")] for kind, value in allowlist["decisions_per_second"].items()]
        rows.append(
            ["(canonical_ip on a name, alone)", format_number(allowlist["canonical_ip_on_names_per_second"], "/s")]
        )
        parts.append(
            f"Allow-list decisions with {allowlist['patterns']:,} patterns (parsed in {allowlist['parse_ms']:.1f} ms)\n"
            + table(["hosts", "decisions"], rows)
        )
    sequential = results.get("sequential")
    if sequential:
        rows = [
            [
                runtime,
                format_number(m["service"]["p50"], "ms"),
                format_number(m["service"]["p95"], "ms"),
                format_number(m["node"]["p50"], "ms"),
                format_number(m["p50_ratio"], "x"),
                format_number(m["p95_ratio"], "x"),
                f"{m['paths'].get('warm', 0)} warm, {m['paths'].get('cold', 0)} cold",
            ]
            for runtime, m in sequential["runtimes"].items()
        ]
        parts.append(
            f"Back-to-back calls of console.log(1), no pause between them ({sequential['calls']} per runtime)\n"
            + table(["runtime", "p50", "p95", "node -e p50", "p50 / node", "p95 / node", "paths"], rows)
        )
    phases = results.get("phases")
    if phases:
        rows = [
            [name, format_number(s["p50"], "ms"), format_number(s["p95"], "ms")]
            for name, s in phases["phases_ms"].items()
        ]
        parts.append(
            f"Where a pooled execution's time goes (in-process, {phases['iterations']} executions)\n"
            + table(["phase", "p50", "p95"], rows)
        )
    sessions_part = sessions_table(results)
    if sessions_part:
        parts.append(sessions_part)
    cpu = cpu_tables(results)
    if cpu:
        parts.append(cpu)
    fleet = fleet_table(results)
    if fleet:
        parts.append(fleet)
    rows = [
        [t.name, format_number(t.measured, t.unit), f"{t.comparison} {format_number(t.bound, t.unit)}", t.verdict]
        for t in targets(results)
    ]
    parts.append(
        "Targets (issues 8, 15, 17, 18, 24, 25 and 26)\n" + table(["target", "measured", "target", "verdict"], rows)
    )
    return "\n\n".join(parts)


def _count(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def runtimes_table(results: dict[str, Any]) -> str | None:
    """runsc beside runc, same run: the latency p50s, throughput at each runsc level, the benign programs."""
    rows = []
    for label, runc_name, runsc_name in (("pooled p50", POOLED, POOLED_RUNSC), ("cold p50", COLD, COLD_RUNSC)):
        runc, runsc = _p50(results, runc_name), _p50(results, runsc_name)
        if runsc is not None:
            rows.append(
                [label, format_number(runc, "ms"), format_number(runsc, "ms"), format_number(_ratio(runsc, runc), "x")]
            )
    for level in results.get("throughput", {}).get("runsc_levels", []):
        runsc, runc = _runsc_throughput(results, level["concurrency"])
        rows.append(
            [
                f"throughput at {level['concurrency']}",
                format_number(runc, "/s"),
                format_number(runsc, "/s"),
                format_number(_ratio(runsc, runc), "x"),
            ]
        )
    benign = results.get("benign")
    if benign:
        totals = benign["total_ms"]
        runc_total = totals.get("runc", {}).get("p50")
        runsc_total = totals.get("runsc", {}).get("p50")
        rows.append(
            [
                f"benign programs ({benign['programs']}), total p50 of {benign['rounds']} rounds",
                format_number(runc_total, "ms"),
                format_number(runsc_total, "ms"),
                format_number(_ratio(runsc_total, runc_total), "x"),
            ]
        )
        counts = {
            "benign programs with a wrong output": {name: len(names) for name, names in benign["failures"].items()},
            "crashes at start the pool retried": benign.get("start_retries", {}),
        }
        for label, by_runtime in counts.items():
            rows.append([label, *(_count(by_runtime.get(name)) for name in ("runc", "runsc")), ""])
    if not rows:
        return None
    return "Isolation runtimes: runsc (gVisor) beside runc\n" + table(
        ["measure", "runc", "runsc", "runsc / runc"], rows
    )


def _mib(kib: float | None) -> str:
    return "-" if kib is None else f"{kib / 1024:.1f} MiB"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def _session_rows(results: dict[str, Any], runtime: str) -> list[tuple[str, str]]:
    """(label, figure) of one runtime's sessions section, in the table's order."""
    found: dict[str, Any] = results["sessions"][runtime]
    summaries, files, idle = found["summaries"], found["files"], found["idle"]
    count = idle["sessions"]
    return [
        *(
            (f"{name}, {key}", format_number(summaries[name][key], "ms"))
            for name in (sessions.CALL, sessions.CREATE, sessions.NODE)
            for key in ("p50", "p95")
        ),
        ("call p50 / node -e p50", format_number(_session_ratio(results, sessions.CALL, runtime), "x")),
        ("POST /sessions p50 / node -e p50", format_number(_session_ratio(results, sessions.CREATE, runtime), "x")),
        ("the created sessions' paths (audit log)", str(found["create_paths"])),
        ("10 MiB upload, p50", format_number(files["upload_mib_s"], "MiB/s")),
        ("10 MiB download, p50", format_number(files["download_mib_s"], "MiB/s")),
        ("service RSS before the transfers", _mib(files["rss_before_kib"])),
        ("service RSS peak during them", _mib(files["rss_peak_kib"])),
        ("RSS growth / file size", format_number(files["growth_per_file"], "x")),
        (f"service CPU, no session, {idle['seconds']:g} s", _seconds(idle["service_cpu_s_alone"])),
        (f"service CPU, {count} sessions idle as long", _seconds(idle["service_cpu_s"])),
        (f"the {count} containers' CPU, together", _seconds(idle["containers_cpu_s"])),
        ("the busiest container's CPU", _seconds(idle["container_cpu_s_max"])),
        ("service RSS before they open", _mib(idle["rss_kib"]["before"])),
        ("service RSS, all open", _mib(idle["rss_kib"]["open"])),
        ("service RSS after the idle period", _mib(idle["rss_kib"]["after_idle"])),
    ]


def sessions_table(results: dict[str, Any]) -> str | None:
    """The sessions section, one column per runtime measured."""
    runtimes = list(results.get("sessions", {}))
    if not runtimes:
        return None
    columns = [_session_rows(results, runtime) for runtime in runtimes]
    rows = [[label, *(column[index][1] for column in columns)] for index, (label, _) in enumerate(columns[0])]
    rounds = results["sessions"][runtimes[0]]["rounds"]
    return f"Sessions ({rounds} rounds, shuffled order; a service of their own per runtime)\n" + table(
        ["measure", *runtimes], rows
    )


# --- the CPU section (bench/cpu.py) ---

_CPU_HEADERS = ["dockerd", "containerd", "shim", "runtime", "container", "client"]


def _cpu_row(results: dict[str, Any], name: str, runtime: str) -> dict[str, Any] | None:
    for row in results.get("cpu", {}).get("contenders", []):
        if row["name"] == name and row["runtime"] == runtime:
            found: dict[str, Any] = row
            return found
    return None


def cpu_ratio(results: dict[str, Any], name: str, runtime: str) -> float | None:
    """`name`'s host CPU per execution over that of `docker run --rm` under the same runtime."""
    row, baseline = _cpu_row(results, name, runtime), _cpu_row(results, DOCKER_RUN, runtime)
    if row is None or baseline is None:
        return None
    return ratio(row["per_execution_ms"]["total"], baseline["per_execution_ms"]["total"])


def cpu_targets(results: dict[str, Any]) -> list[Target]:
    return [
        Target("host CPU per execution: pooled / docker run --rm", cpu_ratio(results, POOLED, "runc"), "<=", 0.6, "x"),
        Target(
            "runsc: host CPU per execution: pooled / docker run --rm",
            cpu_ratio(results, POOLED, "runsc"),
            "<=",
            0.6,
            "x",
        ),
    ]


def cpu_tables(results: dict[str, Any]) -> str | None:
    """The CPU per execution by part and contender, what was subtracted and checked, and by phase."""
    cpu = results.get("cpu")
    if not cpu:
        return None
    if "unavailable" in cpu:
        return f"Host CPU per execution: not measured ({cpu['unavailable']})"
    rows = []
    for row in cpu["contenders"]:
        ms = row["per_execution_ms"]
        rows.append(
            [
                row["name"],
                row["runtime"],
                *(format_number(ms[part], "ms") for part in _CPU_HEADERS),
                format_number(ms["total"], "ms"),
                format_number(cpu_ratio(results, row["name"], row["runtime"]), "x"),
            ]
        )
    parts = [
        f"Host CPU per execution of console.log(1), ms ({cpu['rounds']} rounds x {cpu['batch']} executions per "
        "contender; client: the service process, or the docker CLI)\n"
        + table(["contender", "runtime", *_CPU_HEADERS, "total", "/ docker run --rm"], rows),
        "\n".join(_cpu_notes(cpu)),
        _cpu_processes(cpu),
    ]
    for runtime, paths in cpu.get("phases_ms", {}).items():
        for path, phases in paths.items():
            parts.append(_phase_table(runtime, path, phases, cpu["phase_iterations"]))
    return "\n\n".join(part for part in parts if part)


def _cpu_notes(cpu: dict[str, Any]) -> list[str]:
    background = cpu["background_ms_per_s"]
    notes = [
        f"subtracted from dockerd and containerd: their background, {background['dockerd']:.1f} and "
        f"{background['containerd']:.1f} ms/s over {cpu['idle_seconds']:.0f} s of idle windows; containers of "
        f"other users that ended meanwhile: {sum(r['foreign_container_exits'] for r in cpu['contenders'])} during "
        f"the windows, {cpu['idle_foreign_container_exits']} during the idle ones"
    ]
    for row in cpu["contenders"]:
        label = f"{row['name']} ({row['runtime']})"
        if "metrics_polls" in row:
            rest = row["at_rest_ms_per_s"]
            notes.append(
                f"{label}: paths {row.get('paths')}; {row['metrics_polls']} /metrics polls for a full pool, "
                f"{row['metrics_poll_cost_ms']:.2f} ms of service CPU each, subtracted; the pool at rest uses "
                f"{sum(rest.values()):.1f} ms/s (shim {rest['shim']:.1f}, container {rest['container']:.1f}, "
                f"service {rest['client']:.1f}), {row['at_rest_share_ms']:.0f} ms of each execution's figure"
            )
        if "container_cgroup_over_ledger" in row:
            notes.append(f"{label}: container cgroup / counted container CPU {row['container_cgroup_over_ledger']:.2f}")
        if row.get("exit_tail_ms_per_process") is not None:
            transient = sum(row["processes_per_execution"][part] for part in ("shim", "runtime", "container"))
            tail = row["exit_tail_ms_per_process"]
            notes.append(
                f"{label}: not counted, what an exit record misses of its process's end: {tail:.2f} ms per docker "
                f"CLI (its rusage - its records); at that, about {tail * transient:.0f} ms per execution for the "
                f"{transient:.0f} processes below the shim"
            )
    if cpu["lost_record_datagrams"] or cpu["sampled_records"]:
        notes.append(
            f"exit records lost: {cpu['lost_record_datagrams']} datagrams; tick-sampled: {cpu['sampled_records']}"
        )
    return notes


def _cpu_processes(cpu: dict[str, Any]) -> str:
    contenders = cpu["contenders"]
    labels = sorted({label for row in contenders for label in row["by_process_ms"]})
    if not labels:
        return ""
    rows = [[label, *(format_number(row["by_process_ms"].get(label), "ms") for row in contenders)] for label in labels]
    headers = ["process (part: what it runs)", *(f"{row['name']} ({row['runtime']})" for row in contenders)]
    return "The same by process, ms per execution (dockerd's and containerd's own threads left out)\n" + table(
        headers, rows
    )


def _no_negative_zero(value: float) -> float:
    return 0.0 if abs(value) < 0.005 else value


def _phase_table(runtime: str, path: str, phases: dict[str, dict[str, float]], iterations: int) -> str:
    rows = []
    totals = dict.fromkeys([*_CPU_HEADERS, "total", "wall"], 0.0)
    for phase, parts in phases.items():
        total = sum(parts.get(part, 0.0) for part in _CPU_HEADERS)
        cells = [*(parts.get(part, 0.0) for part in _CPU_HEADERS), total, parts.get("wall", 0.0)]
        rows.append([phase, *(format_number(_no_negative_zero(value), "ms") for value in cells)])
        if phase != "idle in the pool":
            for key, value in zip(totals, cells, strict=True):
                totals[key] += value
    rows.append(
        ["total (idle left out)", *(format_number(_no_negative_zero(value), "ms") for value in totals.values())]
    )
    what = "a pooled execution (started as the pool does)" if path == "warm" else "a cold execution (pool off)"
    headers = ["phase", *_CPU_HEADERS[:-1], "this process", "total CPU", "wall"]
    return (
        f"CPU by phase of {what}, {runtime}, in this process, ms ({iterations} runs; dockerd and containerd less "
        "their background over the phase's wall time, below 0 where the background's noise is larger)\n"
        + table(headers, rows)
    )
