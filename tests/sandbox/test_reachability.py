"""The reachability walk: nothing user code can reach behind the gate is a function that gives file,
program, worker, debugger, raw-handle or loader powers.

A reference run in an ungated node of the same image names those functions by fingerprint (source hash,
or a native's name); the gated run walks everything reachable from globalThis, require, module, process
and every allowed built-in, and reports what it finds of them. Then it constructs every class it reached
with benign arguments and walks what that made (instances, their prototypes, `_handle`s, constructors),
since some powers exist only after a call: `new tty.WriteStream(1)._handle.constructor` is the native TTY
class, a raw handle on any descriptor. This is the test that catches the next bypass: a new path to any
of these functions fails it, whichever property chain leads there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import docker
import pytest

from tests.sandbox.conftest import RunJs, Service

pytestmark = [pytest.mark.docker, pytest.mark.security]

WALK = (Path(__file__).parent / "programs" / "reachability.js").read_text()


@pytest.fixture(scope="module")
def reference(sandbox_service: Service, docker_client: docker.DockerClient) -> dict[str, Any]:
    """The fingerprints of the powerful functions, from an ungated node of the service's sandbox image."""
    tag = sandbox_service.get("/health").json()["checks"]["sandbox_image"]["tag"]
    output = docker_client.containers.run(
        tag,
        ["/usr/bin/node", "--expose-internals", "-e", f"{WALK}\nreference()"],
        network_disabled=True,
        network_mode="none",
        user="1001:1001",
        read_only=True,
        remove=True,
        stdout=True,
        stderr=False,
    )
    lines = [json.loads(line) for line in output.decode().splitlines()]
    tagged = ("baseline", "control", "constructed")
    return {
        "forbidden": dict(line for line in lines if line[0] not in tagged),
        "baseline": next(line[1] for line in lines if line[0] == "baseline"),
        "control": next(line[1] for line in lines if line[0] == "control"),
        # powers the walk reaches from the allowed surface only through something it constructed
        "constructed": dict(line[1] for line in lines if line[0] == "constructed"),
    }


def test_the_reference_names_the_powers_and_the_walk_finds_them_without_the_gate(reference: dict[str, Any]) -> None:
    labels = set(reference["forbidden"].values())
    for label in (
        "fs.readFileSync",
        "fs.promises.open",
        "child_process.spawnSync",
        "worker_threads.Worker",
        "inspector.Session",
        "Module._findPath",
        "Module._readPackage",
        "Module.prototype._compile",
        "process.binding",
        "process._getActiveHandles",
        "tcp_wrap.TCP",
        "pipe_wrap.Pipe",
        "tty_wrap.TTY",
        "tty.WriteStream",
        # found by the generic search of every binding for handle classes, internal ones included
        "signal_wrap.Signal",
        "tls_wrap.TLSWrap",
        "watchdog.TraceSigintWatchdog",
    ):
        assert label in labels, sorted(labels)[:50]
    assert len(labels) > 500
    # The walk itself, over fs and process in the ungated node: it must find them (its positive control).
    assert reference["control"] > 100


def test_the_walk_finds_ttys_native_handle_only_through_what_it_constructs(reference: dict[str, Any]) -> None:
    # In the ungated node, over the gated run's roots: the TTY class is no property of anything before a
    # call, and is the constructor of the handle of a tty stream the walk made on descriptor 1.
    constructed: dict[str, str] = reference["constructed"]
    assert "tty_wrap.TTY" in constructed, constructed
    assert "Stream(1)" in constructed["tty_wrap.TTY"], constructed
    assert constructed["tty_wrap.TTY"].endswith("constructor"), constructed


def test_nothing_reachable_behind_the_gate_is_a_power(run_js: RunJs, reference: dict[str, Any]) -> None:
    forbidden: dict[str, str] = reference["forbidden"]
    result = run_js(
        f"process.noDeprecation = true;\n{WALK}\ngated();",
        stdin=json.dumps(list(forbidden)),
        timeout_s=60,
        memory_mb=1024,
    )
    assert result.exit_code == 0, result.stderr
    walked = json.loads(result.stdout)
    leaks = [f"{forbidden[fingerprint]} at {path}" for fingerprint, path in walked["found"]]
    assert leaks == [], "\n".join(leaks)
    assert walked["messagePorts"] == 0  # no hooks thread, so no port to it
    # The walk covered the surface: every allowed built-in loaded, and most of what the same roots reach
    # in an ungated node (the gate removes some, the ungated walk has no import() namespaces).
    assert "http" in walked["allowed"]
    assert "module" in walked["allowed"]
    assert walked["objects"] > 0.8 * reference["baseline"], (walked["objects"], reference["baseline"])
    # And it constructed the classes it reached, and walked what they made.
    assert walked["constructed"] > 100, walked
    assert walked["instances"] > 500, walked
