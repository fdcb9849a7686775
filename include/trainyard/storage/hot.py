"""The hot tier's room: what is staged there, who is using it, and eviction.

Each staged dataset is a folder holding a staged manifest. A run pins the
folder it trains on (a file under ``.pins/``) and unpins it when its report is
written; staging touches ``.last_used``. When a new stage needs room, the
least recently used unpinned datasets go first, each renamed away before it
is deleted, so a half-deleted folder never looks staged.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from trainyard.atomic import write_bytes_atomic, write_text_atomic
from trainyard.errors import DataError
from trainyard.ledger import Ledger, safe_name

log = logging.getLogger(__name__)
STAGED_MANIFEST = "_staged.json"
PINS = ".pins"
LAST_USED = ".last_used"
# A worker killed hard never unpins; after this long a pin no longer protects its dataset.
PIN_TTL_S = 3 * 24 * 3600


@dataclass(frozen=True)
class StagedDataset:
    path: Path
    bytes: int
    last_used: float
    pinned_by: tuple[str, ...]


@dataclass(frozen=True)
class HotRoom:
    """How much the hot root may hold, and who is asking for room."""

    root: Path
    capacity_bytes: int | None
    holder: str
    """The run that pins what it stages (``dag_id/run_id``)."""


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def _pins(folder: Path, now: float) -> tuple[str, ...]:
    pins = folder / PINS
    if not pins.is_dir():
        return ()
    return tuple(sorted(p.read_text() or p.name for p in pins.iterdir() if now - p.stat().st_mtime < PIN_TTL_S))


def staged_datasets(root: Path, now: float | None = None) -> list[StagedDataset]:
    """Every staged dataset under ``root``, least recently used first."""
    now = time.time() if now is None else now
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if STAGED_MANIFEST in filenames:
            folder = Path(dirpath)
            used = folder / LAST_USED
            last = used.stat().st_mtime if used.exists() else (folder / STAGED_MANIFEST).stat().st_mtime
            found.append(StagedDataset(folder, _size(folder), last, _pins(folder, now)))
            dirnames.clear()  # a dataset does not nest another
        else:
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
    return sorted(found, key=lambda d: (d.last_used, str(d.path)))


def pin(folder: Path, holder: str) -> None:
    (folder / PINS).mkdir(parents=True, exist_ok=True)
    write_text_atomic(folder / PINS / safe_name(holder), holder)


def unpin(folder: Path, holder: str) -> None:
    (folder / PINS / safe_name(holder)).unlink(missing_ok=True)


def touch(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(folder / LAST_USED, b"")  # a fresh mtime, never through a planted link


def make_room(room: HotRoom, keep: Path, need: int, ledger: Ledger | None = None) -> list[StagedDataset]:
    """Evict least recently used, unpinned datasets (never ``keep``) until ``need`` bytes fit.

    Raises ``DataError`` naming the sizes before anything is evicted if even
    evicting every candidate would not be enough.
    """
    if room.capacity_bytes is None or need <= 0:
        return []
    datasets = staged_datasets(room.root)
    used = sum(d.bytes for d in datasets) + (0 if any(d.path == keep for d in datasets) else _size(keep) if keep.exists() else 0)
    free = room.capacity_bytes - used
    if need <= free:
        return []
    candidates = [d for d in datasets if d.path != keep and not d.pinned_by]
    if need > free + sum(d.bytes for d in candidates):
        pinned = [d for d in datasets if d.pinned_by and d.path != keep]
        raise DataError(
            f"hot tier {room.root} is full: staging needs {_mb(need)} more, {_mb(max(free, 0))} of {_mb(room.capacity_bytes)}"
            f" is free and evicting every unpinned dataset frees only {_mb(sum(d.bytes for d in candidates))};"
            f" {len(pinned)} dataset(s) ({_mb(sum(d.bytes for d in pinned))}) are pinned by running pipelines."
            " Raise dataset.hot_capacity_gb or wait for those runs."
        )
    evicted = []
    for victim in candidates:
        if need <= free:
            break
        _evict(room.root, victim.path)
        free += victim.bytes
        evicted.append(victim)
        log.info("evicted %s (%s, last used %s)", victim.path, _mb(victim.bytes), time.ctime(victim.last_used))
        if ledger:
            ledger.append("stage_dataset", "evicted", path=str(victim.path), bytes=victim.bytes, last_used=victim.last_used)
    return evicted


def _evict(root: Path, folder: Path) -> None:
    doomed = root / f".evicting-{uuid.uuid4().hex[:8]}"
    os.replace(folder, doomed)  # one rename: from here on it is not a staged dataset
    shutil.rmtree(doomed)


def _mb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
