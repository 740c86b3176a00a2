"""Runs inside epicbox's own virtual environment (never imported by the service's): one execution per
`run` line on stdin, one JSON line per execution on stdout. EOF ends it.

`epicbox.run` wraps every command in `/bin/sh -c`, and the sandbox image has no shell (by design). So
this driver makes the calls `epicbox.run` makes, in the same order, with the command as an argument
vector: `_create_sandbox_container` (what `epicbox.create` calls after wrapping the command), then
`start` (attach, start, stream, inspect) and `destroy` (forced removal). Nothing of epicbox is changed.

Limits: the ones epicbox can set, at the service's values: memory 256 MiB without swap, 32 processes,
a read-only root, no network, uid 1001; CPU time and wall time 8 s (the service's default timeout).
epicbox has no setting for capabilities, no-new-privileges, a tmpfs, a CPU share, open files or IPC,
so its containers are created with less to set up than the service's. Without a CPU share, node in an
epicbox container starts at the full speed of the machine; `run capped` adds one engine call between
create and start that sets the service's 0.5 CPU (`--cpus 0.5` is a quota of 50 ms per 100 ms), to show
what that share costs.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
import warnings
from importlib import metadata

# urllib3 1.26 warns that epicbox uses a deprecated Retry argument; it still works.
warnings.simplefilter("ignore", DeprecationWarning)

import epicbox  # noqa: E402  # after the filter above
from epicbox import sandboxes, utils  # noqa: E402

USER = "1001:1001"
LIMITS = {"cputime": 8, "realtime": 8, "memory": 256, "processes": 32}


CPU_PERIOD_US = 100_000
CPU_QUOTA_US = 50_000


def run_once(image: str, program: str, *, capped: bool) -> dict[str, object]:
    started = time.perf_counter()
    sandbox_id = str(uuid.uuid4())
    limits = utils.merge_limits_defaults(dict(LIMITS))
    command = ["/usr/bin/dumb-init", "--", "/usr/bin/node", "-e", program]
    container = sandboxes._create_sandbox_container(
        sandbox_id, image, command, limits, user=USER, read_only=True, network_disabled=True
    )
    with sandboxes.Sandbox(sandbox_id, container, realtime_limit=limits["realtime"]) as sandbox:
        if capped:
            container.update(cpu_period=CPU_PERIOD_US, cpu_quota=CPU_QUOTA_US)
        result = sandboxes.start(sandbox)
    elapsed_ms = (time.perf_counter() - started) * 1000
    return {
        "ms": elapsed_ms,
        "exit_code": result["exit_code"],
        "stdout": result["stdout"].decode(errors="replace"),
        "stderr": result["stderr"].decode(errors="replace")[-500:],
        "timeout": result["timeout"],
    }


def main() -> None:
    image, program = sys.argv[1], sys.argv[2]
    epicbox.configure(profiles=[epicbox.Profile("bench", image, user=USER, read_only=True, network_disabled=True)])
    versions = {name: metadata.version(name) for name in ("epicbox", "docker", "urllib3", "requests")}
    print(json.dumps({"versions": versions}), flush=True)
    for line in sys.stdin:
        command = line.split()
        if command and command[0] == "run":
            print(json.dumps(run_once(image, program, capped=command[1:] == ["capped"])), flush=True)


if __name__ == "__main__":
    main()
