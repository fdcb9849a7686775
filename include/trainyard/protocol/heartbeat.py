"""Heartbeat files: each rank's latest step, time and status, ``rank-<RANK>.json`` in the attempt's heartbeat folder.

One writer (the runtime, every step) and one reader (the supervisor, the progress line, the
Kubernetes trigger). Files rather than ledger events because the watcher needs the latest state
of every rank cheaply. The writer renames a finished temporary over the final name, so a reader
sees the old beat or the new one, never half. Imports no torch.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def beat_name(rank: int) -> str:
    return f"rank-{rank}.json"


def write_beat(directory: Path, rank: int, record: dict[str, Any]) -> None:
    """This rank's heartbeat; no fsync: a beat means something only while its writer lives, and it beats every step."""
    final = directory / beat_name(rank)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record, default=float), encoding="utf-8")
    os.replace(tmp, final)


def read_heartbeats(directory: Path) -> dict[str, dict[str, Any]]:
    """Every rank's latest beat by file stem (``rank-N``); a file replaced between listing and reading is skipped."""
    beats = {}
    for path in sorted(directory.glob("rank-*.json")):
        try:
            beats[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced between glob and read; the next poll sees it
    return beats
