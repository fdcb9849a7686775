"""The run ledger: an append-only JSON-lines event log per pipeline run.

Every stage, the supervisor and rank 0 of the training workload append events
here; reports, SLO figures and resumption read it back. Nothing is inferred
from log text. One event is one ``write`` on an ``O_APPEND`` descriptor, so
lines from several processes never interleave on a local file system.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

LEDGER_FILE = "events.jsonl"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def safe_name(text: str) -> str:
    """A file-system-safe form of a DAG or run id (``manual__2026-11-29T02:00:00+00:00``)."""
    cleaned = _UNSAFE.sub("_", text).strip("._")
    return cleaned or "_"


def run_dir(runs_root: str | Path, dag_id: str, run_id: str) -> Path:
    """Where one run keeps its files: keyed by DAG and run, so runs never share files."""
    return Path(runs_root) / safe_name(dag_id) / safe_name(run_id)


class Ledger:
    """Append and read events of one run (``<run_dir>/events.jsonl``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def in_dir(cls, directory: str | Path) -> Ledger:
        return cls(Path(directory) / LEDGER_FILE)

    def append(self, stage: str, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": time.time(), "stage": stage, "event": event, **fields}
        line = (json.dumps(record, sort_keys=True, default=str) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return record

    def events(self, stage: str | None = None, event: str | None = None) -> Iterator[dict[str, Any]]:
        """Events in write order, optionally filtered. A torn last line is skipped."""
        if not self.path.exists():
            return
        with self.path.open(encoding="utf-8") as fh:
            for line in fh:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a writer killed mid-line; the rest of the log stays readable
                if stage is not None and record.get("stage") != stage:
                    continue
                if event is not None and record.get("event") != event:
                    continue
                yield record
