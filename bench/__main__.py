"""`python -m bench` (or `scripts/bench`): every benchmark of issues 8, 15, 17 and 18 in one run on this machine.

Prints the tables and the targets, and writes everything (samples included) with the machine's
description to bench/results/latest.json. `--quick` is a smoke run: the same code, few iterations.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import docker

from bench import (
    allowlist_rate,
    benign,
    cpu,
    fleet,
    http_tool,
    latency,
    phases,
    python,
    sequential,
    sessions,
    syscalls,
    throughput,
)
from bench.baselines import BENCH_LABEL, DEFAULT_EPICBOX_VENV, Epicbox, ensure_epicbox_venv
from bench.machine import REPO, describe, load_average, node_path
from bench.report import render, targets
from bench.service import BenchService
from metaagent.languages.javascript.image import image_tag
from metaagent.languages.python.image import python_image_tag
from metaagent.sandbox.runtime import RUNC, RUNSC, Runtime, registration_problem
from metaagent.settings import Settings

SECTIONS = (
    "allowlist",
    "benign",
    "cpu",
    "fleet",
    "http",
    "latency",
    "phases",
    "python",
    "sequential",
    "sessions",
    "syscalls",
    "throughput",
)
DEFAULT_OUTPUT = REPO / "bench" / "results" / "latest.json"


def _csv(kind: type[int] | type[str]) -> Any:
    def parse(text: str) -> list[Any]:
        return [kind(item.strip()) for item in text.split(",") if item.strip()]

    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/bench", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="a smoke run: few iterations, short periods")
    parser.add_argument(
        "--only", type=_csv(str), default=list(SECTIONS), help=f"comma-separated of {','.join(SECTIONS)}"
    )
    parser.add_argument("--rounds", type=int, help="latency rounds, one execution per contender each (default 30)")
    parser.add_argument("--warmup", type=int, help="warm-up rounds before latency and phases (default 3)")
    parser.add_argument("--duration", type=float, help="seconds per throughput measurement (default 8)")
    parser.add_argument("--concurrency", type=_csv(int), default=[1, 4, 16], help="throughput levels (default 1,4,16)")
    parser.add_argument("--http-iterations", type=int, help="HTTP tool requests, and as many direct (default 300)")
    parser.add_argument("--allowlist-seconds", type=float, help="seconds per allow-list measurement (default 1)")
    parser.add_argument("--phase-iterations", type=int, help="pooled executions timed phase by phase (default 10)")
    parser.add_argument("--sequential-calls", type=int, help="back-to-back calls per runtime (default 30)")
    parser.add_argument("--benign-rounds", type=int, help="rounds of the benign programs per runtime (default 2)")
    parser.add_argument(
        "--benign-runtimes", type=_csv(str), default=["runc", "runsc"], help="runtimes of the benign rounds"
    )
    parser.add_argument(
        "--runsc-concurrency", type=_csv(int), default=[4], help="throughput levels under runsc (default 4)"
    )
    parser.add_argument("--session-rounds", type=int, help="rounds of session calls and creations (default 30)")
    parser.add_argument("--session-transfers", type=int, help="10 MiB uploads and downloads (default 5)")
    parser.add_argument("--idle-sessions", type=int, help="sessions open and idle at once (default 20)")
    parser.add_argument("--idle-seconds", type=float, help="how long they stay idle, measured (default 10)")
    parser.add_argument("--cpu-rounds", type=int, help="CPU section: rounds of every contender (default 5)")
    parser.add_argument("--cpu-batch", type=int, help="CPU section: executions per contender and round (default 4)")
    parser.add_argument("--cpu-phase-iterations", type=int, help="CPU section: in-process runs per path (default 8)")
    parser.add_argument("--syscall-rounds", type=int, help="syscalls section: runs per program (default 5)")
    parser.add_argument("--fleet-rounds", type=int, help="fleet section: session calls each way (default 100)")
    parser.add_argument("--fleet-seconds", type=float, help="fleet section: seconds per throughput phase (default 8)")
    parser.add_argument("--fleet-repeats", type=int, help="fleet section: each throughput phase, times (default 2)")
    parser.add_argument("--no-runsc", action="store_true", help="leave the runsc (gVisor) rows out")
    parser.add_argument("--no-epicbox", action="store_true", help="leave epicbox out of the latency table")
    parser.add_argument("--epicbox-venv", type=Path, default=DEFAULT_EPICBOX_VENV, help="epicbox's own venv")
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, help="where the JSON goes")
    args = parser.parse_args(argv)
    unknown = set(args.only) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown section(s) {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    quick = args.quick
    for name, full, smoke in [
        ("rounds", 30, 5),
        ("warmup", 3, 1),
        ("duration", 8.0, 2.0),
        ("http_iterations", 300, 30),
        ("allowlist_seconds", 1.0, 0.2),
        ("phase_iterations", 10, 3),
        ("benign_rounds", 2, 1),
        ("session_rounds", 30, 5),
        ("session_transfers", 5, 1),
        ("idle_sessions", 20, 4),
        ("idle_seconds", 10.0, 2.0),
        ("sequential_calls", 30, 5),
        ("cpu_rounds", 5, 1),
        ("cpu_batch", 4, 2),
        ("cpu_phase_iterations", 8, 1),
        ("syscall_rounds", 5, 1),
        ("fleet_rounds", 100, 10),
        ("fleet_seconds", 8.0, 2.0),
        ("fleet_repeats", 2, 1),
    ]:
        if getattr(args, name) is None:
            setattr(args, name, smoke if quick else full)
    return args


def progress(message: str) -> None:
    print(f"bench: {message}", file=sys.stderr, flush=True)


def _remove_bench_containers(client: docker.DockerClient) -> None:
    """Containers of this run's `docker run` loops that outlived it (a timeout): --rm covers the rest."""
    for container in client.containers.list(all=True, filters={"label": f"{BENCH_LABEL}={os.getpid()}"}):
        container.remove(force=True)


def _throughput_level(
    service: BenchService, image: str, cpus: float, concurrency: int, duration_s: float, runtime: Runtime
) -> dict[str, Any]:
    """One level: the pooled service's clients, then a `docker run --rm` loop under the same runtime."""
    service.wait_pool_full()
    before = set(service.container_paths())
    served = throughput.service(service.base_url, concurrency, duration_s)
    paths = [path for execution_id, path in service.container_paths().items() if execution_id not in before]
    service.wait_pool_full()  # an idle service while the loop runs: its refills would slow the loop
    loop = throughput.docker_run_loop(image, cpus, concurrency, duration_s, runtime)
    progress(
        f"throughput at {concurrency} under {runtime.name}: service {served.per_second:.2f}/s, "
        f"docker run {loop.per_second:.2f}/s"
    )
    return {
        "concurrency": concurrency,
        "service": {**served.as_dict(), "warm": paths.count("warm"), "cold": paths.count("cold")},
        "docker_run": loop.as_dict(),
    }


def _throughput(
    pooled: BenchService, pooled_runsc: BenchService | None, image: str, cpus: float, args: argparse.Namespace
) -> dict[str, Any]:
    levels = [_throughput_level(pooled, image, cpus, c, args.duration, RUNC) for c in args.concurrency]
    runsc_levels = (
        [_throughput_level(pooled_runsc, image, cpus, c, args.duration, RUNSC) for c in args.runsc_concurrency]
        if pooled_runsc is not None
        else []
    )
    return {"duration_s": args.duration, "levels": levels, "runsc_levels": runsc_levels}


def _sessions(stack: ExitStack, runsc_problem: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """The sessions section per runtime, each against a service of its own (started here, stopped at the
    end of the run): runc, and runsc unless it cannot run here."""
    measured = {}
    for runtime in ["runc"] + ([] if runsc_problem else [RUNSC.name]):
        progress(f"starting the sessions service ({runtime})")
        service = stack.enter_context(
            BenchService(
                "sessions" if runtime == "runc" else f"sessions-{runtime}",
                METAAGENT_SANDBOX_RUNTIME=runtime,
                METAAGENT_SESSION_MAX=str(args.idle_sessions + 4),  # the idle sessions and the measured ones
            )
        )
        service.wait_pool_full()
        measured[runtime] = sessions.measure(
            service,
            node=node_path(),
            rounds=args.session_rounds,
            warmup=args.warmup,
            transfers=args.session_transfers,
            idle_sessions=args.idle_sessions,
            idle_seconds=args.idle_seconds,
            progress=progress,
        )
        service.stop()  # its containers gone before the next runtime's are measured
    return measured


def _python(stack: ExitStack, runsc_problem: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """The Python section per runtime, each against a service of its own that serves Python."""
    measured = {}
    for runtime in ["runc"] + ([] if runsc_problem else [RUNSC.name]):
        progress(f"starting the Python service ({runtime})")
        settings = {"METAAGENT_SANDBOX_RUNTIME": runtime, "METAAGENT_LANGUAGES": "javascript,python"}
        service = stack.enter_context(BenchService(f"python-{runtime}", **settings))
        measured[runtime] = python.measure(
            service,
            image=python_image_tag(),
            runtime=runtime,
            rounds=args.rounds,
            warmup=args.warmup,
            progress=progress,
        )
        service.stop()
    return measured


def _runsc_usable(client: docker.DockerClient) -> str | None:
    """None when the engine can run runsc containers as the service needs; otherwise why not."""
    runtimes = {
        name: [str(arg) for arg in (entry or {}).get("runtimeArgs") or []]
        for name, entry in (client.info().get("Runtimes") or {}).items()
    }
    problem = registration_problem(runtimes)
    return None if problem is None else f"runsc {problem}"


def _cpu(image: str, cpus: float, runsc_problem: str | None, args: argparse.Namespace) -> dict[str, Any]:
    problem = cpu.unavailable()
    if problem:
        progress(f"no CPU section: {problem}")
        return {"unavailable": problem}
    return cpu.measure(
        image=image,
        cpus=cpus,
        runsc=runsc_problem is None,
        rounds=args.cpu_rounds,
        batch=args.cpu_batch,
        idle_s=0.3 if args.quick else 1.0,
        phase_iterations=args.cpu_phase_iterations,
        progress=progress,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    only = set(args.only)
    client = docker.from_env()
    results: dict[str, Any] = {"machine": describe(client)}
    cpus = float(Settings.model_fields["sandbox_cpus"].default)
    image = image_tag()
    results["config"] = {
        "image": image,
        "sandbox_cpus": cpus,
        "sections": sorted(only),
        "quick": args.quick,
        "rounds": args.rounds,
        "warmup": args.warmup,
        "duration_s": args.duration,
        "concurrency": args.concurrency,
        "http_iterations": args.http_iterations,
        "allowlist_seconds": args.allowlist_seconds,
        "phase_iterations": args.phase_iterations,
        "benign_rounds": args.benign_rounds,
        "benign_runtimes": args.benign_runtimes,
        "runsc_concurrency": args.runsc_concurrency,
        "session_rounds": args.session_rounds,
        "session_transfers": args.session_transfers,
        "idle_sessions": args.idle_sessions,
        "idle_seconds": args.idle_seconds,
        "cpu_rounds": args.cpu_rounds,
        "cpu_batch": args.cpu_batch,
        "cpu_phase_iterations": args.cpu_phase_iterations,
    }
    runsc_problem = "--no-runsc" if args.no_runsc else _runsc_usable(client)
    results["config"]["runsc"] = runsc_problem or "measured"
    if runsc_problem:
        progress(f"no runsc rows: {runsc_problem}")
    with ExitStack() as stack:
        stack.callback(client.close)
        stack.callback(_remove_bench_containers, client)
        if only & {"latency", "throughput", "phases"}:
            progress(f"sandbox image {image}")
            subprocess.run([sys.executable, "-m", "metaagent", "sandbox", "build"], check=True, capture_output=True)

        if "allowlist" in only:
            results["allowlist"] = allowlist_rate.measure(seconds=args.allowlist_seconds, progress=progress)

        # The issue-8 rows run runc, as before; the runsc rows beside them, same programs, same run.
        pooled = cold = pooled_runsc = cold_runsc = None
        benign_problem = benign.unavailable() if "benign" in only else None
        if benign_problem:
            progress(f"no benign rows: {benign_problem}")
        benign_runc = "benign" in only and not benign_problem and "runc" in args.benign_runtimes
        benign_runsc = "benign" in only and not benign_problem and RUNSC.name in args.benign_runtimes
        if only & {"latency", "throughput", "http", "sequential"} or benign_runc:
            progress("starting the service (warm pool on)")
            pooled = stack.enter_context(
                BenchService(
                    "pooled",
                    METAAGENT_EXECUTION_QUEUE_SIZE="64",
                    ALLOW_HTTP_HOSTS='["127.0.0.1"]',
                    METAAGENT_SANDBOX_RUNTIME="runc",
                )
            )
            pooled.wait_pool_full()
            results["config"]["pool_size"] = pooled.warm_pool()["size"]
        if "latency" in only:
            progress("starting the service (warm pool off)")
            cold = stack.enter_context(
                BenchService("cold", METAAGENT_POOL_ENABLED="false", METAAGENT_SANDBOX_RUNTIME="runc")
            )
        if not runsc_problem and (only & {"latency", "throughput", "sequential"} or benign_runsc):
            progress("starting the service under runsc (warm pool on)")
            pooled_runsc = stack.enter_context(
                BenchService("pooled-runsc", METAAGENT_EXECUTION_QUEUE_SIZE="64", METAAGENT_SANDBOX_RUNTIME=RUNSC.name)
            )
            pooled_runsc.wait_pool_full()
        if not runsc_problem and "latency" in only:
            progress("starting the service under runsc (warm pool off)")
            cold_runsc = stack.enter_context(
                BenchService("cold-runsc", METAAGENT_POOL_ENABLED="false", METAAGENT_SANDBOX_RUNTIME=RUNSC.name)
            )

        if "http" in only and pooled is not None:
            results["http_tool"] = http_tool.measure(
                pooled, iterations=args.http_iterations, warmup=max(5, args.http_iterations // 10), progress=progress
            )

        if "latency" in only:
            epicbox = None
            if not args.no_epicbox:
                epicbox = stack.enter_context(Epicbox(ensure_epicbox_venv(args.epicbox_venv), image))
                results["machine"]["epicbox_versions"] = epicbox.versions
            results["latency"] = latency.measure(
                pooled=pooled,
                cold=cold,
                node=node_path(),
                image=image,
                cpus=cpus,
                epicbox=epicbox,
                rounds=args.rounds,
                warmup=args.warmup,
                progress=progress,
                pooled_runsc=pooled_runsc,
                cold_runsc=cold_runsc,
            )

        if "sequential" in only:
            loops = {name: service for name, service in (("runc", pooled), (RUNSC.name, pooled_runsc)) if service}
            results["sequential"] = sequential.measure(
                loops, node=node_path(), calls=args.sequential_calls, progress=progress
            )

        services = {
            name: service
            for name, service, wanted in (("runc", pooled, benign_runc), (RUNSC.name, pooled_runsc, benign_runsc))
            if service is not None and wanted
        }
        if services:
            results["benign"] = benign.measure(services, rounds=args.benign_rounds, progress=progress)

        if "phases" in only:
            results["phases"] = phases.measure(
                image=image, cpus=cpus, iterations=args.phase_iterations, warmup=args.warmup, progress=progress
            )

        if "sessions" in only:
            results["sessions"] = _sessions(stack, runsc_problem, args)

        if "throughput" in only and pooled is not None:
            results["throughput"] = _throughput(pooled, pooled_runsc, image, cpus, args)

        if "cpu" in only:
            results["cpu"] = _cpu(image, cpus, runsc_problem, args)

        if "python" in only:
            results["python"] = _python(stack, runsc_problem, args)

        if "syscalls" in only:
            results["syscalls"] = syscalls.measure(
                image, runsc=runsc_problem is None, rounds=args.syscall_rounds, progress=progress
            )

        if "fleet" in only:
            subprocess.run([sys.executable, "-m", "metaagent", "sandbox", "build"], check=True, capture_output=True)
            results["fleet"] = fleet.measure(
                client,
                ["runc"] + ([] if runsc_problem else [RUNSC.name]),
                rounds=args.fleet_rounds,
                warmup=args.warmup,
                duration_s=args.fleet_seconds,
                repeats=args.fleet_repeats,
                progress=progress,
            )

    results["machine"]["load_average_end"] = load_average()
    results["targets"] = [target.as_dict() for target in targets(results)]
    return results


def finite(value: Any) -> Any:
    """`value` with every infinite or NaN float replaced by None: JSON has no such numbers."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(finite(results), indent=2, allow_nan=False) + "\n")
    print(render(results))
    if "python" in results:
        print("\n" + "\n".join(python.lines(results["python"])))
    if "syscalls" in results:
        print("\n" + "\n".join(syscalls.lines(results["syscalls"])))
    print(f"\nJSON: {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
