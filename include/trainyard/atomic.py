"""Write-then-rename for small files: a reader sees the old content or the new, never half."""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Any

_TEMP = re.compile(r"\..+\.part-[0-9a-f]{8}\Z")


def temp_name(final: Path) -> Path:
    """A hidden sibling name: a partial file is never visible under its final name."""
    return final.with_name(f".{final.name}.part-{uuid.uuid4().hex[:8]}")


def is_temp_name(name: str) -> bool:
    """True for names made by ``temp_name``: copies in flight or left by a killed writer."""
    return bool(_TEMP.match(name))


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in ``directory`` durable, not just visible."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_name(path)
    try:
        with tmp.open("w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    finally:
        tmp.unlink(missing_ok=True)


def read_json(path: Path) -> Any:
    with path.open(encoding="utf-8") as fh:
        return json.load(fh)
