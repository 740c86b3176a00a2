"""The audit log: JSON Lines, one record per event, each chained to the one before it by hash.

Every record has the same envelope: `{"seq", "time", "event", "prev_hash", "hash", ...fields}`.
`hash` is the sha256 of the record's canonical JSON (sorted keys, no spaces) without the `hash` key, and
`prev_hash` is the previous record's `hash` (64 zeros for the first). Changing, removing or reordering
any record breaks every link after it; `verify` names the first broken record.

Event names are stable: `execution.finished`, `egress.blocked`, `package.refused`, `package.install_failed`.
Records never hold secrets or raw code: code is recorded as its sha256 and size.
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

GENESIS = "0" * 64


def _canonical(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


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
            record["hash"] = record_hash(record)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            line = _canonical(record) + b"\n"
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, line)
            finally:
                os.close(fd)
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
