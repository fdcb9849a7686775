"""What a hot dataset folder says it holds, and what a stage must copy again.

The committed staged manifest (``read_staged``, ``read_manifest``) and its
entries (``manifest_entry``), the journal a killed stage left behind
(``read_journal``), the digest an earlier stage recorded for an object
(``recorded_digest``), and the plan: which listed objects are new, changed at
the source, or missing or resized in the folder. Staging
(``storage.staging``) reads and writes these; the data gate reads the
manifest too (``quality.dataset``).
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path, PurePosixPath
from typing import Any

from trainyard.atomic import loads_untrusted, read_json
from trainyard.storage.boot import BOOT_ID, entry_digest, trusted
from trainyard.storage.hot import JOURNAL, STAGED_MANIFEST
from trainyard.storage.keys import check_key, key_path
from trainyard.storage.tier import Landed, ObjectInfo

log = logging.getLogger(__name__)


def read_staged(hot_dir: Path) -> dict[str, dict[str, Any]]:
    """The committed manifest's entries by key (empty if nothing was staged)."""
    files: dict[str, dict[str, Any]] = read_manifest(hot_dir).get("files", {})
    return files


def read_manifest(hot_dir: Path) -> dict[str, Any]:
    """The committed manifest (``files``, and ``boot_id`` where it was written without fsyncs); {} if none."""
    path = hot_dir / STAGED_MANIFEST
    if not path.exists():
        return {}
    try:
        manifest = read_json(path)
        if not isinstance(manifest.get("files"), dict):
            raise KeyError("files")
        return dict(manifest)
    except (ValueError, KeyError, OSError, AttributeError):
        log.warning("%s is unreadable; staging everything again", path)
        return {}


def manifest_entry(landed: Landed, version: str) -> dict[str, Any]:
    """A staged manifest entry: size, version, digest and how it was checked (plus ``sha256`` where it is one)."""
    entry: dict[str, Any] = {"size": landed.size, "version": version, "digest": landed.digest, "check": landed.check}
    algo, _, value = landed.digest.partition(":")
    if algo == "sha256":
        entry["sha256"] = value  # quality/dataset.py shows it and compares shards by it
    return entry


def recorded_digest(entry: dict[str, Any] | None, obj: ObjectInfo) -> str | None:
    """The digest an earlier stage recorded for this very version of ``obj``, to check a re-fetch against."""
    if entry is None or entry.get("version") != obj.version or entry.get("size") != obj.size:
        return None
    return entry_digest(entry)


def read_journal(hot_dir: Path, boot_id: str | None) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    """Objects a killed stage finished before it could commit the manifest: (trusted, from another boot).

    A line from another boot (``storage.boot.trusted``) may name a copy a crash took back: its object
    is copied again; its digest still says what the source held.
    """
    entries: dict[str, dict[str, Any]] = {}
    earlier: dict[str, dict[str, Any]] = {}
    path = hot_dir / JOURNAL
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                record = loads_untrusted(line, "a journal line")
                key = record.pop("key")
                if not isinstance(key, str):
                    raise TypeError("key")  # a list would fail as a dict key, out of the stage
            except (ValueError, KeyError, AttributeError, TypeError):
                continue  # a torn last line: that object is simply copied again
            written_in = record.pop(BOOT_ID, None)
            if trusted(written_in, boot_id):
                entries[key] = record
                earlier.pop(key, None)
            else:
                earlier[key] = record
                entries.pop(key, None)
    return entries, earlier


def plan(objects: list[ObjectInfo], staged: dict[str, dict[str, Any]], hot_dir: Path) -> list[ObjectInfo]:
    """The objects to transfer: new, changed at the source, or missing or resized in the hot tier.

    One pass over the listing against the manifest, one ``lstat`` per object
    the manifest says is there, and one per folder above those: a staged file
    that is gone, resized or a link (or under a folder that became a link) is
    copied again, through ``key_path``'s check that it stays inside ``hot_dir``.
    """
    todo = []
    folders: dict[str, bool] = {}  # folder key -> a real folder (not a link), looked at once
    for obj in objects:
        entry = staged.get(obj.key)
        if entry is None or entry["version"] != obj.version or entry["size"] != obj.size:
            todo.append(obj)
            continue
        if _staged_size(hot_dir, obj.key, folders) != obj.size:
            todo.append(obj)
    return todo


def _staged_size(hot_dir: Path, key: str, folders: dict[str, bool]) -> int | None:
    """The size of ``key``'s regular file, reached through real folders only; None otherwise.

    No link below ``hot_dir`` means the path cannot leave it, so the full
    ``resolve`` of ``key_path`` (a few ``lstat`` calls per path part) is needed
    only where a link is found.
    """
    parts = PurePosixPath(check_key(key)).parts
    for depth in range(1, len(parts)):
        folder = "/".join(parts[:depth])
        if folder not in folders:
            try:
                folders[folder] = stat.S_ISDIR(os.lstat(hot_dir.joinpath(*parts[:depth])).st_mode)
            except OSError:
                folders[folder] = False
        if not folders[folder]:
            key_path(hot_dir, key)  # a link that leaves the hot folder is refused now, not later
            return None
    try:
        st = os.lstat(hot_dir.joinpath(*parts))
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None
