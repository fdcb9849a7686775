"""The checkpoint directory format: layout, manifest, integrity check, atomic commit.

This module owns what a checkpoint *is* on disk, independent of torch::

    <root>/step_000120/            one checkpoint (torch.distributed.checkpoint files)
        .metadata, __0_0.distcp, ...
        manifest.json              written LAST: step, world size, batch, metrics,
                                   size + sha256 of every other file
    <root>/step_000130.tmp/        a save in progress (never read)
    <root>/superseded/step_000120-1764450000/
                                   an older save of the same step, or a checkpoint
                                   of a lineage that ended (restarted earlier), moved aside

A directory without a manifest is not a checkpoint (docs/architecture.md, nothing is lost): the
manifest is the commit record, so it is written after every tensor file and
the staged directory is renamed into place only once it is complete. Saving
never deletes a committed checkpoint; a re-save of the same step moves the old
one to ``superseded/``. Deeper validation (loadable, finite tensors, metric
expectations) builds on ``verify`` elsewhere; this module checks integrity.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from trainyard import held
from trainyard.atomic import TooLarge, fsync_dir, loads_untrusted, read_capped, write_json_atomic
from trainyard.errors import CheckpointInvalid
from trainyard.storage.hashing import sha256_file

FORMAT = "trainyard.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
SUPERSEDED = "superseded"
# ASCII digits to the very end: `$` would let "step_000040\n" through, `\d` any script's digits.
_STEP_DIR = re.compile(r"step_([0-9]{6,})\Z")
_REQUIRED = {"step": int, "world_size": int, "global_batch": int, "micro_batch": int, "files": dict}
MANIFEST_BYTES = 64 << 20
"""The cap on reading a manifest (about 150 bytes a file: far above any real checkpoint's)."""


def step_dir(root: str | Path, step: int) -> Path:
    """The final directory of the checkpoint at ``step`` (``step_000120``)."""
    return Path(root) / f"step_{step:06d}"


def staging_dir(root: str | Path, step: int) -> Path:
    """Where a save of ``step`` is assembled before it is committed (``step_000120.tmp``)."""
    return Path(root) / f"step_{step:06d}.tmp"


def step_of(ckpt_dir: str | Path) -> int | None:
    """The step encoded in a final checkpoint directory's name, or None for any other name."""
    match = _STEP_DIR.match(Path(ckpt_dir).name)
    return int(match.group(1)) if match else None


def is_step_name(name: str) -> bool:
    """Whether ``name`` is exactly a final checkpoint folder's name (``step_NNNNNN``): no path, no other text."""
    return _STEP_DIR.match(name) is not None


def _payload_files(ckpt_dir: Path) -> list[str]:
    """Relative POSIX paths of every file in the checkpoint except its manifest."""
    files = (p for p in ckpt_dir.rglob("*") if p.is_file() or p.is_symlink())
    return sorted(rel for p in files if (rel := p.relative_to(ckpt_dir).as_posix()) != MANIFEST)


def write_manifest(
    ckpt_dir: str | Path,
    *,
    step: int,
    world_size: int,
    global_batch: int,
    micro_batch: int,
    metrics: dict[str, Any],
    run_id: str,
    extra: dict[str, Any] | None = None,
    hashed: Mapping[str, tuple[int, str]] | None = None,
) -> dict[str, Any]:
    """Record the size and sha256 of every file in ``ckpt_dir`` and write ``manifest.json`` atomically; return it.

    Call this after all tensor files are written and synced: the manifest is
    the checkpoint's commit record. ``hashed``: ``name -> (size, sha256)`` of the files as their writers
    hashed them while writing (``runtime.dcpwriter``); a file of that size is not read again, any other
    file is hashed here. ``extra``: fields of an adopted framework save
    (``framework``, ``source``, ``source_signature``: ``checkpoint.foreign``); they
    never replace the fields above.
    """
    ckpt_dir = Path(ckpt_dir)
    known = hashed or {}
    files = {}
    for rel in _payload_files(ckpt_dir):
        size = (ckpt_dir / rel).stat().st_size
        written = known.get(rel)
        files[rel] = {
            "size": size,
            "sha256": written[1] if written and written[0] == size else sha256_file(ckpt_dir / rel),
        }
    manifest = new_manifest(
        files,
        step=step,
        world_size=world_size,
        global_batch=global_batch,
        micro_batch=micro_batch,
        metrics=metrics,
        run_id=run_id,
        extra=extra,
    )
    write_json_atomic(ckpt_dir / MANIFEST, manifest)
    return manifest


def new_manifest(
    files: dict[str, dict[str, Any]],
    *,
    step: int,
    world_size: int,
    global_batch: int,
    micro_batch: int,
    metrics: dict[str, Any],
    run_id: str,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of a checkpoint holding ``files`` (``name -> {"size", "sha256"}``), as ``write_manifest``
    writes it; for a writer that hashed every file itself and writes through a held folder (adoption)."""
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "step": int(step),
        "world_size": int(world_size),
        "global_batch": int(global_batch),
        "micro_batch": int(micro_batch),
        "metrics": dict(metrics),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "run_id": str(run_id),
        "files": files,
    }
    return {**(extra or {}), **manifest}


def read_manifest(ckpt_dir: str | Path) -> dict[str, Any]:
    """The parsed manifest of ``ckpt_dir``; ``CheckpointInvalid`` says why it is unusable."""
    path = Path(ckpt_dir) / MANIFEST
    try:
        data = read_capped(path, MANIFEST_BYTES)  # training code wrote it: never a FIFO, a link or gigabytes
    except FileNotFoundError:
        raise CheckpointInvalid(f"{ckpt_dir}: no {MANIFEST} (incomplete save or not a checkpoint)") from None
    except OSError as exc:
        raise CheckpointInvalid(f"{ckpt_dir}: cannot read {MANIFEST} ({exc.strerror or exc})") from exc
    except TooLarge as exc:
        raise CheckpointInvalid(f"{ckpt_dir}: {exc}") from exc
    try:
        manifest = loads_untrusted(data, MANIFEST)
    except ValueError as exc:  # not UTF-8, not JSON, or nested past what a reader walks
        raise CheckpointInvalid(f"{ckpt_dir}: {MANIFEST} is not valid JSON ({exc})") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointInvalid(f"{ckpt_dir}: {MANIFEST} has format {found!r}, expected {FORMAT!r}")
    if manifest.get("version") != VERSION:
        raise CheckpointInvalid(
            f"{ckpt_dir}: {MANIFEST} version {manifest.get('version')!r} is not supported (this trainyard reads {VERSION})"
        )
    for key, kind in _REQUIRED.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointInvalid(f"{ckpt_dir}: {MANIFEST} field {key!r} missing or not {kind.__name__}")
    return manifest


def _file_problems(ckpt_dir: Path, rel: str, entry: Any, hash_it: bool = True) -> list[str]:
    """Why one listed file does not match its manifest entry ([] when it does); ``hash_it`` False: all but
    the sha256 (the reader that checks its contents hashes what it reads: ``digest_problems``)."""
    target = ckpt_dir / rel
    if Path(rel).is_absolute() or ".." in Path(rel).parts:
        return [f"{rel}: path escapes the checkpoint directory"]
    if (
        not isinstance(entry, dict)
        or not isinstance(entry.get("size"), int)
        or not isinstance(entry.get("sha256"), str)
    ):
        return [f"{rel}: manifest entry malformed (needs integer size and sha256)"]
    if target.is_symlink() or (target.exists() and not target.resolve().is_relative_to(ckpt_dir.resolve())):
        # Followed, it would hash (and publish) a file from anywhere the worker can read.
        return [f"{rel}: a symbolic link; a checkpoint holds regular files only"]
    if not target.is_file():
        return [f"{rel}: missing"]
    size = target.stat().st_size
    if size != entry["size"]:
        return [f"{rel}: size mismatch (manifest {entry['size']} bytes, file {size})"]
    if hash_it and sha256_file(target) != entry["sha256"]:
        return [f"{rel}: sha256 mismatch (contents changed after the save)"]
    return []


def digest_problems(manifest: dict[str, Any], digests: Mapping[str, Any], names: Collection[str]) -> list[str]:
    """Each of ``names`` was read by the reader that checked it, as ``(size, sha256)`` in ``digests``, and
    those are the manifest's: the bytes checked are the bytes listed."""
    problems = []
    for rel in sorted(names):
        entry, got = manifest["files"].get(rel), digests.get(rel)
        if not isinstance(entry, dict):
            continue  # malformed or unlisted: ``verify`` says so
        if got is None:
            problems.append(f"{rel}: its contents were not read by the check that judges them")
        elif list(got) != [entry.get("size"), entry.get("sha256")]:
            problems.append(
                f"{rel}: sha256 mismatch (the bytes checked are not the manifest's: changed after the save)"
            )
    return problems


def verify(
    ckpt_dir: str | Path,
    hashed: Callable[[dict[str, Any]], list[str]] | None = None,
    elsewhere: Collection[str] = (),
    manifest: dict[str, Any] | None = None,
) -> list[str]:
    """Integrity problems of a checkpoint, one human-readable reason each; [] when valid.

    Sizes are compared before hashing, so a truncated file is reported without
    reading it. ``hashed``: what checks the listed files instead of this process (given the manifest;
    ``backends.kubernetes.verify``: a Job of pods, each a slice); by default ``slice_problems`` of all but
    ``elsewhere`` (files the reader that checks their contents hashes: ``digest_problems``). ``manifest``:
    the one already read, so one reading of it is judged throughout.
    """
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return [f"{ckpt_dir}: not a directory"]
    try:
        manifest = read_manifest(ckpt_dir) if manifest is None else manifest
    except CheckpointInvalid as exc:
        return [str(exc)]
    problems: list[str] = []
    named = step_of(ckpt_dir)
    if named is not None and named != manifest["step"]:
        problems.append(f"manifest step {manifest['step']} does not match directory name {ckpt_dir.name}")
    listed = manifest["files"]
    problems += hashed(manifest) if hashed is not None else slice_problems(ckpt_dir, manifest, 0, 1, elsewhere)
    problems.extend(f"{rel}: not listed in the manifest" for rel in _payload_files(ckpt_dir) if rel not in listed)
    return problems


def slice_of(manifest: dict[str, Any], index: int, count: int) -> list[tuple[str, Any]]:
    """Slice ``index`` of ``count`` of the manifest's files: (name, entry) of every ``count``-th in name order."""
    return sorted(manifest["files"].items())[index::count]


def manifest_digest(ckpt_dir: Path) -> str:
    """The sha256 of ``ckpt_dir``'s manifest as stored, read as ``read_manifest`` reads it (a regular file,
    capped): what a slice's answer and the gate hold each other to."""
    return hashlib.sha256(read_capped(ckpt_dir / MANIFEST, MANIFEST_BYTES)).hexdigest()


def slice_problems(
    ckpt_dir: Path, manifest: dict[str, Any], index: int, count: int, elsewhere: Collection[str] = ()
) -> list[str]:
    """The problems of slice ``index`` of ``count`` of the manifest's files (every ``count``-th in name order);
    those in ``elsewhere`` are not hashed here."""
    mine = slice_of(manifest, index, count)

    def one(item: tuple[str, Any]) -> list[str]:
        return _file_problems(ckpt_dir, *item, hash_it=item[0] not in elsewhere)

    # Files hash independently and hashlib releases the GIL: one thread per core.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        return [p for found in pool.map(one, mine) for p in found]


def list_checkpoints(root: str | Path) -> list[Path]:
    """Committed checkpoints under ``root`` (``step_NNNNNN`` with a manifest), oldest step first.

    Having a manifest is not the same as being valid; see ``verify``. A ``step_NNNNNN``
    that is a symbolic link is not a checkpoint: a save commits by renaming a real
    folder into place, and a link could lead to another pipeline's checkpoints.
    """
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if step_of(p) is not None and not p.is_symlink() and (p / MANIFEST).is_file()]
    return sorted(found, key=lambda p: step_of(p) or 0)


def latest_valid(root: str | Path, on_invalid: Callable[[Path, list[str]], None] | None = None) -> Path | None:
    """The highest-step checkpoint under ``root`` that passes ``verify``, or None.

    ``on_invalid(path, problems)`` hears about every newer checkpoint skipped on
    the way down, so callers can record why a resume went further back.

    The highest step is the lineage's newest because the orchestrator keeps it so:
    whenever a lineage (re)starts at a step (a run's resume point, a rollback), the
    checkpoints beyond it, of a lineage that ended there, are set aside to
    ``superseded/`` first (``trainyard.checkpoint.registry.set_aside``). ``LATEST``
    alone could not tell them apart from newer saves not yet promoted.
    """
    for ckpt in reversed(list_checkpoints(root)):
        problems = verify(ckpt)
        if not problems:
            return ckpt
        if on_invalid is not None:
            on_invalid(ckpt, problems)
    return None


def prepare_staging(root: str | Path, step: int) -> Path:
    """Create an empty staging directory for ``step``, clearing a stale one from a crashed save.

    A ``.tmp`` directory was never committed, so removing it cannot lose a checkpoint.
    """
    staging = staging_dir(root, step)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def supersede(final: Path) -> Path:
    """Move an existing checkpoint aside to ``<root>/superseded/`` (never deleted).

    The orchestrator moves checkpoints aside too, in a folder pods write: a ``superseded``
    that is a link is refused (``UnsafePath``), never moved into.
    """
    # Both ends held from the root (``trainyard.held``): the rename is made between folder handles, so a link
    # swapped in for ``superseded`` is refused and one swapped in for the checkpoint is moved as a link, never
    # followed (what it pointed at stays where it is).
    root = held.open_root(final.parent)
    try:
        folder = held.descend(root, [SUPERSEDED], create=True)
        try:
            stamp = int(time.time())
            name, suffix = f"{final.name}-{stamp}", 1
            while _present(name, folder):  # two re-saves within one second keep both old copies
                name, suffix = f"{final.name}-{stamp}.{suffix}", suffix + 1
            os.replace(final.name, name, src_dir_fd=root, dst_dir_fd=folder)
        finally:
            os.close(folder)
    finally:
        os.close(root)
    return final.parent / SUPERSEDED / name


def _present(name: str, folder: int) -> bool:
    try:
        os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def commit(staging: str | Path, root: str | Path, step: int) -> Path:
    """Rename a staged checkpoint (manifest already written) to its final name; return it.

    If a checkpoint of that step already exists it is moved to ``superseded/``
    first, so the only window without a final ``step_NNNNNN`` still keeps both
    copies on disk.
    """
    staging = Path(staging)
    if not (staging / MANIFEST).is_file():
        raise CheckpointInvalid(f"{staging}: refusing to commit a checkpoint without {MANIFEST}")
    final = step_dir(root, step)
    if final.exists():
        supersede(final)
    os.replace(staging, final)
    fsync_dir(final.parent)
    return final
