"""The audit log: JSON Lines, one record per event, each chained to the one before it by hash.

Every record has the same envelope: `{"seq", "time", "event", "prev_hash", "hash", ...fields}`.
`hash` is the sha256 of the record's canonical JSON (sorted keys, no spaces) without the `hash` key, and
`prev_hash` is the previous record's `hash` (64 zeros for the first). Changing, removing or reordering
any record breaks every link after it; `verify` names the first broken record.

Event names are stable: `execution.finished`, `egress.blocked`, `package.refused`, `package.install_failed`.
Records never hold secrets or raw code: code is recorded as its sha256 and size.

No record is lost silently. The writer carries whatever a record holds: a lone surrogate (which UTF-8
cannot encode) is written as its JSON escape (`\udfff`, which reads back as the same string, so the
hash still verifies), and a value JSON has no type for as its text. A record that still cannot be
written (the disk is full, the file is not writable) raises `AuditWriteFailed`: the request that caused
it fails with a 500 that says so, and the error handler logs it.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from metaagent.errors import AuditWriteFailed

GENESIS = "0" * 64


def _canonical(record: dict[str, Any]) -> bytes:
    # `backslashreplace` writes a lone surrogate as the JSON escape of that code unit (JSON escapes real
    # backslashes itself, so none is left raw): valid JSON, read back as the very same string.
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return text.encode("utf-8", "backslashreplace")


def record_hash(record: dict[str, Any]) -> str:
    return hashlib.sha256(_canonical({k: v for k, v in record.items() if k != "hash"})).hexdigest()


class AuditLog:
    """Appends chained records to a file; safe to call from several threads."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._seq, self._prev = self._tail()

    def _tail(self) -> tuple[int, str]:
        if not self.path.exists():
            return 0, GENESIS
        last = None
        with self.path.open("rb") as f:
            for line in f:
                if line.strip():
                    last = line
        if last is None:
            return 0, GENESIS
        try:
            record = json.loads(last)
            return int(record["seq"]), str(record["hash"])
        except (ValueError, KeyError, TypeError):
            # A damaged tail must not stop the service; `verify` reports it, new records chain from here.
            return 0, hashlib.sha256(last).hexdigest()

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        with self._lock:
            record: dict[str, Any] = {
                "seq": self._seq + 1,
                "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "event": event,
                **fields,
                "prev_hash": self._prev,
            }
            try:
                # The line is the hashed text with the hash added last: one serialization, not two (verify
                # parses the line and hashes its canonical form, which does not depend on key order).
                record.pop("hash", None)  # a field called `hash` gives way to the record's own, as it always did
                hashed = _canonical(record)
                record["hash"] = hashlib.sha256(hashed).hexdigest()
                line = b'%s,"hash":"%s"}\n' % (hashed[:-1], record["hash"].encode())
                try:
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                except FileNotFoundError:  # its folder is made when needed (and again if it was removed)
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                    fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
                try:
                    written = os.write(fd, line)
                finally:
                    os.close(fd)
                if written != len(line):
                    raise OSError(f"only {written} of {len(line)} bytes were written")
            except (OSError, ValueError, TypeError) as exc:
                raise AuditWriteFailed(
                    f"The audit record of this request ({event}) could not be written to {self.path} ({exc}), "
                    "so the service does not answer it as done: the operator must make the audit log writable "
                    "(space, permissions) before this can succeed"
                ) from exc
            self._seq, self._prev = record["seq"], record["hash"]
            return record


@dataclass(frozen=True)
class Verification:
    ok: bool
    records: int
    message: str
    first_bad_line: int | None = None


def verify(path: Path) -> Verification:
    """Checks every record's hash and link; names the first record that does not hold."""
    prev = GENESIS
    count = 0
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                stored = record["hash"]
                linked = record["prev_hash"]
            except (ValueError, KeyError, TypeError):
                return Verification(False, count, f"line {number}: not a valid audit record", number)
            if linked != prev:
                return Verification(
                    False,
                    count,
                    f"line {number} (seq {record.get('seq')}): does not chain to the record before it",
                    number,
                )
            if record_hash(record) != stored:
                return Verification(
                    False,
                    count,
                    f"line {number} (seq {record.get('seq')}): content does not match its hash",
                    number,
                )
            prev = stored
            count += 1
    return Verification(True, count, f"{count} records, chain intact")
