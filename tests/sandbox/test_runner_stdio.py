"""The runner's stdio: a program that writes faster than its output is read waits for the reader, so its
memory stays flat however fast it writes (it would otherwise pile the output up in its own heap and die
of it before its deadline)."""

from __future__ import annotations

import json
import subprocess
import uuid

import docker
import pytest

from metaagent.languages.javascript.image import image_tag, runner_command

pytestmark = [pytest.mark.docker, pytest.mark.security]

FLOOD = "const chunk = 'z'.repeat(1 << 16); (function more() { process.stdout.write(chunk); setImmediate(more); })();"
MEMORY_MB = 64
READ_BYTES = 24 * 1024 * 1024  # far more than the container's memory: it cannot all be held there
SLOW_READ = 16 * 1024  # bytes per read, with a pause after each: a reader much slower than the writer


def test_a_writer_faster_than_its_reader_waits_instead_of_filling_its_memory(
    sandbox_service: object, docker_client: docker.DockerClient
) -> None:
    code = FLOOD.encode()
    payload = json.dumps({"code_bytes": len(code), "stdin_bytes": 0}).encode() + b"\n" + code
    name = f"metaagent-test-stdio-{uuid.uuid4().hex[:12]}"
    command = ["docker", "run", "--rm", "-i", f"--name={name}", "--log-driver=none", "--network=none",
               f"--memory={MEMORY_MB}m", f"--memory-swap={MEMORY_MB}m", "--user=1001:1001", "--read-only",
               "--label=org.metaagent.test=stdio",
               image_tag(), *runner_command(MEMORY_MB)]  # fmt: skip
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE) as process:
        try:
            assert process.stdin is not None
            assert process.stdout is not None
            process.stdin.write(payload)
            process.stdin.flush()
            read = 0
            peak = 0
            while read < READ_BYTES:
                data = process.stdout.read1(SLOW_READ)
                assert data, process.stderr.read() if process.stderr else b""  # the program died before the end
                read += len(data)
                if read % (2 * 1024 * 1024) < SLOW_READ:
                    stats = docker_client.containers.get(name).stats(stream=False)
                    peak = max(peak, stats["memory_stats"].get("usage", 0))
            assert process.poll() is None  # still writing, not killed at its memory limit
            assert 0 < peak < MEMORY_MB * 1024 * 1024
        finally:
            process.kill()
            subprocess.run(["docker", "rm", "-f", name], capture_output=True, check=False)
