"""Staging: copy a dataset from a cold tier to a folder in the hot tier.

Plan, transfer, commit. Only objects that are missing or changed are copied;
each lands under a temporary name, is verified and renamed; the staged
manifest is written last, so a folder whose manifest lists a file holds that
file, whole. Running it again after a kill finishes the job.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.atomic import read_json, write_json_atomic
from trainyard.errors import DataError
from trainyard.ledger import Ledger
from trainyard.storage.keys import key_path
from trainyard.storage.tier import ObjectInfo, Tier

log = logging.getLogger(__name__)
STAGED_MANIFEST = "_staged.json"


@dataclass(frozen=True)
class StageResult:
    hot_dir: Path
    files: int
    bytes_total: int
    transferred: int
    bytes_transferred: int
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "hot_dir": str(self.hot_dir)}


def read_staged(hot_dir: Path) -> dict[str, dict[str, Any]]:
    """The committed manifest's entries by key (empty if nothing was staged)."""
    path = hot_dir / STAGED_MANIFEST
    if not path.exists():
        return {}
    try:
        return read_json(path)["files"]
    except (ValueError, KeyError, OSError):
        log.warning("%s is unreadable; staging everything again", path)
        return {}


def plan(objects: list[ObjectInfo], staged: dict[str, dict[str, Any]], hot_dir: Path) -> list[ObjectInfo]:
    """The objects to transfer: new, changed at the source, or missing or resized in the hot tier."""
    todo = []
    for obj in objects:
        entry = staged.get(obj.key)
        path = key_path(hot_dir, obj.key)
        unchanged = (
            entry is not None
            and entry["version"] == obj.version
            and entry["size"] == obj.size
            and path.is_file()
            and path.stat().st_size == obj.size
        )
        if not unchanged:
            todo.append(obj)
    return todo


def stage(source: Tier, hot_dir: Path, ledger: Ledger | None = None, concurrency: int = 4) -> StageResult:
    started = time.monotonic()
    objects = [o for o in source.list() if o.key != STAGED_MANIFEST]
    if not objects:
        raise DataError(f"{source.uri} holds no objects to stage; check dataset.source and the partition date")
    staged = read_staged(hot_dir)
    todo = plan(objects, staged, hot_dir)
    if ledger:
        ledger.append("stage_dataset", "plan", source=source.uri, objects=len(objects), to_transfer=len(todo))
    log.info("staging %s -> %s: %d objects, %d to transfer", source.uri, hot_dir, len(objects), len(todo))

    def transfer(obj: ObjectInfo) -> tuple[ObjectInfo, int, str]:
        size, sha = source.download(obj.key, key_path(hot_dir, obj.key), expect=obj)
        return obj, size, sha

    todo_keys = {o.key for o in todo}
    entries = {o.key: staged[o.key] for o in objects if o.key not in todo_keys}
    moved = 0
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for obj, size, sha in pool.map(transfer, todo):
            entries[obj.key] = {"size": size, "sha256": sha, "version": obj.version}
            moved += size
            log.info("staged %s (%d bytes)", obj.key, size)

    write_json_atomic(hot_dir / STAGED_MANIFEST, {"source": source.uri, "staged_at": time.time(), "files": entries})
    for stale in set(staged) - set(entries):
        key_path(hot_dir, stale).unlink(missing_ok=True)  # gone at the source: not part of this dataset
    result = StageResult(
        hot_dir=hot_dir,
        files=len(objects),
        bytes_total=sum(o.size for o in objects),
        transferred=len(todo),
        bytes_transferred=moved,
        seconds=round(time.monotonic() - started, 3),
    )
    if ledger:
        ledger.append("stage_dataset", "staged", **result.as_dict())
    return result
