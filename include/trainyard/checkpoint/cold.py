"""Checkpoints in the cold tier: write-once copies, and the pointer that names the published one.

::

    <cold>/<pipeline>/step_000120.3f9a0c1d2b4e5f60/   one copy: the files its manifest lists, the
                                                     manifest last; never written again
    <cold>/<pipeline>/PUBLISHED                      {"path": "step_000120.3f9a...", "step": 120, ...},
                                                     written after the copy is verified

A copy's name ends with a hash of its manifest, so a second save of the same
step (say at a smaller world size) lands beside the first instead of over it,
and a retried upload of the same save rewrites the same bytes. Publishing
uploads exactly the files the manifest lists, checks each against the
manifest's sha256 as it reads it to send it (one read: a file that changed
is refused before it is stored), checks the listing holds nothing else, and
only then moves the pointer: one atomic step (a rename on a file system, one
PUT in S3). A publish that dies midway leaves the previous copy whole and
still named.
Readers follow the pointer (``published``), never a bare ``step_NNNNNN``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.atomic import loads_untrusted
from trainyard.checkpoint.format import MANIFEST, read_manifest, step_of
from trainyard.errors import CheckpointInvalid, ContentChanged, DataError
from trainyard.storage.hashing import sha256_file
from trainyard.storage.keys import key_path
from trainyard.storage.tier import Tier

POINTER = "PUBLISHED"
POINTER_FORMAT = "trainyard.pointer"
_COPY = re.compile(r"^step_\d{6,}\.[0-9a-f]{16}\Z")


@dataclass(frozen=True)
class ColdCopy:
    name: str
    """The copy's prefix in the tier, e.g. ``step_000120.3f9a0c1d2b4e5f60``."""
    step: int
    bytes: int


def copy_name(ckpt: Path) -> str:
    """``step_NNNNNN.<first 16 hex of the manifest's sha256>``: one name per save, the same for a retry."""
    return f"{ckpt.name}.{sha256_file(ckpt / MANIFEST)[:16]}"


def upload_copy(ckpt: Path, tier: Tier, concurrency: int = 4, on_file: Callable[[], None] | None = None) -> ColdCopy:
    """Upload the files ``ckpt``'s manifest lists under a prefix of their own, the manifest last, and verify;
    ``on_file`` is called after each file (the publishing run renews its lease there)."""
    manifest = read_manifest(ckpt)
    name = copy_name(ckpt)
    files: dict[str, Any] = manifest["files"]

    def put(rel: str) -> int:
        try:  # one read: hashed as it is sent, and refused before it is stored if it is not what was validated
            size, _ = tier.upload(key_path(ckpt, rel), f"{name}/{rel}", expect_sha256=files[rel]["sha256"])
        except ContentChanged as exc:
            raise CheckpointInvalid(
                f"{ckpt / rel}: changed since it was validated (sha256 differs from {MANIFEST}: {exc});"
                " validate the checkpoint again before publishing it"
            ) from None
        if on_file:
            on_file()
        return size

    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        moved = sum(pool.map(put, sorted(files)))
    moved += tier.upload(ckpt / MANIFEST, f"{name}/{MANIFEST}")[0]  # last: a copy without it does not exist
    if problems := copy_problems(tier, name, files, (ckpt / MANIFEST).stat().st_size):
        raise CheckpointInvalid(f"{tier.uri}/{name}: the uploaded copy does not match {ckpt}: " + "; ".join(problems))
    return ColdCopy(name, int(manifest["step"]), moved)


def copy_problems(tier: Tier, name: str, files: dict[str, Any], manifest_size: int) -> list[str]:
    """The tier holds under ``name/`` exactly the listed files at their sizes, and the manifest."""
    expected = {rel: entry["size"] for rel, entry in files.items()} | {MANIFEST: manifest_size}
    stored = {o.key.removeprefix(f"{name}/"): o.size for o in tier.list(f"{name}/")}
    problems = [f"{rel}: missing" for rel in sorted(expected) if rel not in stored]
    problems += [
        f"{rel}: {stored[rel]} bytes, expected {size}"
        for rel, size in sorted(expected.items())
        if rel in stored and stored[rel] != size
    ]
    problems += [
        f"{rel}: not listed in the manifest (remove it from the tier)" for rel in sorted(set(stored) - set(expected))
    ]
    return problems


def publish(ckpt: Path, tier: Tier, run_id: str, on_file: Callable[[], None] | None = None) -> ColdCopy:
    """Upload and verify a copy of ``ckpt``, then point ``PUBLISHED`` at it; the pointer moves last."""
    copy = upload_copy(ckpt, tier, on_file=on_file)
    pointer = {
        "format": POINTER_FORMAT,
        "path": copy.name,
        "step": copy.step,
        "run_id": run_id,
        "published_at": time.time(),
    }
    tier.write_bytes(POINTER, json.dumps(pointer, sort_keys=True).encode())
    return copy


def published(tier: Tier) -> str | None:
    """The name of the copy ``PUBLISHED`` points at, or None before the first publish.

    The pointer lives in a bucket others may write to: a name that is not a
    copy's name is refused (``DataError``), never followed.
    """
    data = tier.read_bytes(POINTER)
    if data is None:
        return None
    try:
        pointer = loads_untrusted(data, f"{POINTER}")
        name = pointer["path"] if pointer.get("format") == POINTER_FORMAT else None
    except (ValueError, TypeError, KeyError, AttributeError):
        name = None
    if not isinstance(name, str) or not _COPY.match(name):
        raise DataError(
            f"{tier.uri}/{POINTER} does not name a checkpoint copy (step_NNNNNN.<16 hex>); publish again to rewrite it"
        )
    return name


def download_copy(tier: Tier, name: str, dest: Path) -> Path:
    """Fetch the copy ``name`` into ``dest/<step_NNNNNN>`` (a checkpoint folder ``verify`` and ``validate`` read)."""
    folder = Path(dest) / name.rsplit(".", 1)[0]
    if step_of(folder) is None:
        raise DataError(f"{tier.uri}/{name}: not a checkpoint copy's name")
    for obj in tier.list(f"{name}/"):
        tier.download(obj.key, key_path(folder, obj.key.removeprefix(f"{name}/")), obj)
    return folder
