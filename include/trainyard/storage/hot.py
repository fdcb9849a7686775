"""The hot tier's room: what is staged there, who is using it, and eviction.

Each staged dataset is a folder holding a staged manifest. A run pins the
folder it trains on (a file under ``.pins/``) and unpins it when its report is
written; staging touches ``.last_used``. When a new stage needs room, the
least recently used unpinned datasets go first.

Eviction deletes only what trainyard wrote: the files the folder's staged
manifest lists, then its own bookkeeping, then the manifest, then the folder
if that left it empty. A file someone else put there stays, and a dataset
folder that holds (or lies inside) a pinned one is not evicted at all: with
nested dataset names (``tokens`` and ``tokens/{{ ds }}``) the two share files.
Killed midway, eviction leaves the manifest, so the folder is evicted again
(or re-staged) later; nothing it lists is ever half-trusted.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from trainyard.atomic import read_json, write_bytes_atomic, write_text_atomic
from trainyard.errors import DataError
from trainyard.events.ledger import Ledger, safe_name
from trainyard.storage.keys import key_path

log = logging.getLogger(__name__)
STAGED_MANIFEST = "_staged.json"
PINS = ".pins"
LAST_USED = ".last_used"
JOURNAL = ".staging-journal.jsonl"  # what staging copied before its manifest (storage.staging)
RESERVED = frozenset({STAGED_MANIFEST, PINS, LAST_USED, JOURNAL})
"""trainyard's own names in a hot folder. A source key with one as any part (``.pins/x``, ``sub/_staged.json``:
nested datasets have their own) is never staged: someone else's object would pin, re-stage or fake a dataset."""
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


def reserved(key: str) -> bool:
    """Whether ``key`` names (or lies under) one of trainyard's own files of a hot folder, at any depth."""
    return any(part in RESERVED for part in PurePosixPath(key).parts)


def _size(folder: Path, nested: Collection[Path] = ()) -> int:
    """Bytes under ``folder``, not counting the ``nested`` dataset folders (they count on their own)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(folder):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if here / d not in nested]
        total += sum((here / f).lstat().st_size for f in filenames)
    return total


def _pins(folder: Path, now: float) -> tuple[str, ...]:
    pins = folder / PINS
    if not pins.is_dir():
        return ()
    return tuple(sorted(p.read_text() or p.name for p in pins.iterdir() if now - p.stat().st_mtime < PIN_TTL_S))


def staged_datasets(root: Path, now: float | None = None) -> list[StagedDataset]:
    """Every staged dataset under ``root`` (nested ones too), least recently used first."""
    now = time.time() if now is None else now
    folders = []
    for dirpath, dirnames, filenames in os.walk(root):  # does not follow links to folders
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        if STAGED_MANIFEST in filenames:
            folders.append(Path(dirpath))
    found = []
    for folder in folders:
        used = folder / LAST_USED
        last = used.stat().st_mtime if used.exists() else (folder / STAGED_MANIFEST).stat().st_mtime
        nested = [f for f in folders if f != folder and f.is_relative_to(folder)]
        found.append(StagedDataset(folder, _size(folder, nested), last, _pins(folder, now)))
    return sorted(found, key=lambda d: (d.last_used, str(d.path)))


def overlaps(a: Path, b: Path) -> bool:
    """One folder is the other or lies inside it: nested datasets share files."""
    return a.is_relative_to(b) or b.is_relative_to(a)


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
    used = sum(d.bytes for d in datasets) + (
        0 if any(d.path == keep for d in datasets) else _size(keep) if keep.exists() else 0
    )
    free = room.capacity_bytes - used
    if need <= free:
        return []
    held = [d.path for d in datasets if d.pinned_by] + [keep]
    candidates = [d for d in datasets if not any(overlaps(d.path, h) for h in held)]
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
        if _pins(victim.path, time.time()):
            continue  # pinned since we looked
        _evict(victim.path)
        free += victim.bytes
        evicted.append(victim)
        log.info("evicted %s (%s, last used %s)", victim.path, _mb(victim.bytes), time.ctime(victim.last_used))
        if ledger:
            ledger.append(
                "stage_dataset", "evicted", path=str(victim.path), bytes=victim.bytes, last_used=victim.last_used
            )
    return evicted


def staged_files(folder: Path) -> list[Path] | None:
    """The files ``folder``'s staged manifest lists (all inside it); None if it has no readable trainyard manifest.

    Keys come from a bucket listing and the folder is one pods can write: a
    key that would leave the folder (``..``, a link) is skipped, never followed.
    """
    try:
        manifest = read_json(folder / STAGED_MANIFEST)  # a folder pods can write: no link, any bytes a ValueError
        keys = list(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    files = []
    for key in keys:
        if isinstance(key, str) and reserved(key):
            log.warning("%s lists %r, one of trainyard's own names; left alone", folder / STAGED_MANIFEST, key)
            continue
        try:
            files.append(key_path(folder, key))
        except (DataError, TypeError):
            log.warning("%s lists %r, which is not inside the folder; left alone", folder / STAGED_MANIFEST, key)
    return files


def _evict(folder: Path) -> None:
    """Delete what staging wrote in ``folder`` and nothing else; the folder itself only if that empties it."""
    files = staged_files(folder)
    if files is None:
        log.warning("%s has no readable staged manifest; not evicted", folder)
        return
    nested = [Path(d) for d, _, names in os.walk(folder) if STAGED_MANIFEST in names and Path(d) != folder]
    for path in files:
        if any(path.is_relative_to(n) for n in nested):
            continue  # also the nested dataset's file: it goes when that dataset is evicted
        path.unlink(missing_ok=True)  # a link is removed, not followed
        _prune(path.parent, folder)
    for name in (LAST_USED, JOURNAL):
        (folder / name).unlink(missing_ok=True)
    pins = folder / PINS
    if pins.is_dir() and not pins.is_symlink():
        for stale in pins.iterdir():  # only expired pins are left: the victim was unpinned
            stale.unlink(missing_ok=True)
        _prune(pins, folder)
    (folder / STAGED_MANIFEST).unlink()  # last: until now the folder still says what to delete
    try:
        folder.rmdir()
    except OSError:
        log.info("%s keeps files trainyard did not stage; the folder stays", folder)


def _prune(directory: Path, stop: Path) -> None:
    """Remove ``directory`` and its parents below ``stop`` while they are empty."""
    while directory != stop and directory.is_relative_to(stop):
        try:
            directory.rmdir()
        except OSError:
            return  # not empty (someone else's files), or gone
        directory = directory.parent


def _mb(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
