"""One slice of a checkpoint's hash verification, run in a pod of a verification Job.

``python -m trainyard.checkpoint.slices CKPT INDEX COUNT`` checks every ``COUNT``-th file of the
manifest from ``INDEX`` (``format.slice_problems``) and prints one JSON line: its slice, the sha256 of
the manifest it read (the orchestrator holds every pod to the manifest it read itself), how many files
and bytes it checked, and the problems. ``backends.kubernetes.verify`` starts the pods and reads the
lines from their logs. Imports no torch.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from trainyard.checkpoint.format import manifest_digest, read_manifest, slice_of, slice_problems

RESULT_KEY = "trainyard_slice"
"""The key of a slice's line: what the orchestrator looks for in a pod's log."""


def check_slice(ckpt_dir: Path, index: int, count: int) -> dict[str, Any]:
    manifest = read_manifest(ckpt_dir)
    digest = manifest_digest(ckpt_dir)
    mine = slice_of(manifest, index, count)
    problems = slice_problems(ckpt_dir, manifest, index, count)
    size = sum(int(entry.get("size", 0)) for _, entry in mine if isinstance(entry, dict))
    return {RESULT_KEY: index, "of": count, "manifest": digest, "files": len(mine), "bytes": size, "problems": problems}


def main(argv: list[str]) -> int:
    if len(argv) != 3 or not argv[1].isdigit() or not argv[2].isdigit() or int(argv[1]) >= int(argv[2]):
        print("usage: python -m trainyard.checkpoint.slices CKPT INDEX COUNT (0 <= INDEX < COUNT)", file=sys.stderr)
        return 2
    result = check_slice(Path(argv[0]), int(argv[1]), int(argv[2]))
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
