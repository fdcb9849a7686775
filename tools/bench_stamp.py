"""Stamp a bench's JSON line with when and where it ran: ``date`` (UTC, ISO) and ``machine`` (CPU model, cores,
memory, GPU), so that docs/benchmarks.md's tables (tools.bench_tables) say which machine gave each figure.

``make bench`` pipes each bench's last line through it: ``python -m tools.bench_stamp < line > results.json``.
A line that already carries a field keeps it (a bench that knows better, e.g. the GPU it ran on).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def _gpus() -> str:
    if shutil.which("nvidia-smi") is None:
        return "no GPU"
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "GPU unknown"
    names = [n.strip() for n in out.splitlines() if n.strip()]
    return f"{len(names)} x {names[0]}" if names else "no GPU"


def machine() -> str:
    """One line: ``<CPU model>, <cores> cores, <memory> GiB, <GPUs>``."""
    memory = _memory_gib()
    return f"{_cpu()}, {os.cpu_count()} cores, {'?' if memory is None else memory} GiB, {_gpus()}"


def stamp(line: str, now: datetime.datetime | None = None) -> dict:
    """The bench's JSON object with ``date`` and ``machine`` added where missing."""
    result = json.loads(line)
    if not isinstance(result, dict):
        raise ValueError("a bench's last line must be a JSON object")
    when = (now or datetime.datetime.now(datetime.UTC)).strftime("%Y-%m-%d")
    result.setdefault("date", when)
    result.setdefault("machine", machine())
    return result


def main() -> int:
    lines = [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not lines:
        print("bench_stamp: no line on stdin (the bench printed no JSON result)", file=sys.stderr)
        return 1
    try:
        print(json.dumps(stamp(lines[-1])))
    except ValueError as e:  # json.JSONDecodeError is one
        print(f"bench_stamp: the bench's last line is not a JSON object: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
