"""An adopted save put back at the script's own place before an attempt resumes from it.

A script that resumes from its own file (nanoGPT's ``out/ckpt.pt`` read with ``--init_from=resume``, a Lightning
``last.ckpt``, a ``latest/`` folder) looks for it where it wrote it, not in trainyard's ``step_NNNNNN/``. The
attempt that was killed may have left that file torn, or a later save there that failed validation. ``put_back`` copies the checkpoint
trainyard chose back to the manifest's ``source`` (relative to the lineage root), so the script resumes from the
chosen bytes as it wrote them; nothing of the lineage is moved.

The lineage root is the ranks' folder (untrusted, docs/architecture.md rule 11): every read and write goes
through held folder handles from the root (``held``), a link anywhere on the way is refused, never followed, and
each file lands under a temporary name first, hashed as it is copied, renamed over the name only once it is the
manifest's bytes. A file already there with the same bytes is left alone: first the cheap check (each file's
size and mtime as adopted, which is the manifest's ``source_signature``), then size and sha256 against the
manifest.
"""

from __future__ import annotations

import logging
import os
import stat
import uuid
from pathlib import Path, PurePosixPath
from typing import Any

from trainyard import held
from trainyard.checkpoint.format import read_manifest
from trainyard.checkpoint.frameworks import FORMATS
from trainyard.checkpoint.saves import Found
from trainyard.errors import CheckpointInvalid
from trainyard.text import printable

log = logging.getLogger(__name__)


def put_back(root: Path, ckpt_dir: Path) -> Path:
    """Copy the adopted checkpoint ``ckpt_dir`` (a folder of the lineage ``root``) back to its manifest's
    ``source`` unless the same bytes are there; the path the script's own file (or folder) now has.
    Trainyard's own checkpoints, and one not adopted from a script's save: ``ckpt_dir`` itself.
    ``CheckpointInvalid`` when a link is on the way or a copy is not the manifest's bytes."""
    root, ckpt_dir = Path(root), Path(ckpt_dir)
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointInvalid:  # nothing known to put back: the ranks' own resume says what is wrong with it
        return ckpt_dir
    kind, source = manifest.get("framework"), manifest.get("source")
    parts = _parts(source)
    if kind not in FORMATS or parts is None or ckpt_dir.parent != root:
        return ckpt_dir
    folder = parts if FORMATS[kind].folder is not None else parts[:-1]
    files: dict[str, Any] = manifest["files"]
    try:
        root_fd = held.open_root(root)
        try:
            src, dst = held.descend(root_fd, [ckpt_dir.name]), held.descend(root_fd, folder, create=True)
            try:
                if _signature(dst, str(kind), str(source), files) == manifest.get("source_signature"):
                    put: list[str] = []  # untouched since it was adopted: the same bytes, nothing read
                else:
                    put = [rel for rel, entry in sorted(files.items()) if _copy_unless_same(src, dst, rel, entry)]
            finally:
                os.close(src)
                os.close(dst)
        finally:
            os.close(root_fd)
    except OSError as exc:  # a link on the way (UnsafePath), a folder gone
        raise CheckpointInvalid(
            f"cannot put {printable(source)} back from {ckpt_dir.name}: {printable(exc.strerror or exc, 400)}"
        ) from None
    where = root.joinpath(*parts)
    what = f"put {', '.join(printable(p) for p in put[:5])} back at {where}" if put else f"{where} already holds it"
    log.info("resuming from %s: %s", ckpt_dir.name, what)
    return where


def _parts(source: Any) -> tuple[str, ...] | None:
    """The manifest's ``source`` as plain names under the root; None if it is not one (absolute, ``..``)."""
    if not isinstance(source, str) or not source:
        return None
    parts = PurePosixPath(source).parts
    if PurePosixPath(source).is_absolute() or any(p in ("", ".", "..") for p in parts):
        return None
    return parts


def _entry(parent: int, rel: str) -> tuple[int, int] | None:
    """(size, mtime_ns) of the regular file ``rel`` under the held ``parent``; None if not one (or a link)."""
    *sub, name = PurePosixPath(rel).parts
    try:
        fd = held.descend(parent, sub)
    except OSError:
        return None
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
    except OSError:
        return None
    finally:
        os.close(fd)
    return (st.st_size, st.st_mtime_ns) if stat.S_ISREG(st.st_mode) else None


def _signature(dst: int, kind: str, source: str, files: dict[str, Any]) -> str | None:
    """The ``saves.Found.signature`` of what is at the source now (the cheap check: sizes and mtimes only)."""
    now = []
    for rel in sorted(files):
        entry = _entry(dst, rel)
        if entry is None:
            return None
        now.append((rel, *entry))
    return Found(kind, Path(source), source, None, tuple(now)).signature


def _copy_unless_same(src: int, dst: int, rel: str, entry: dict[str, Any]) -> bool:
    """Put ``rel`` of the held checkpoint folder ``src`` at ``rel`` under ``dst`` unless it holds the same bytes
    (size, then sha256); whether it was copied."""
    *sub, name = PurePosixPath(rel).parts
    here = held.descend(dst, sub, create=True)
    try:
        current = _entry(dst, rel)
        if current is not None and current[0] == entry["size"]:
            fd = held.open_file(here, name)
            try:
                same = held.sha256_copy(fd, entry["size"], None, name)[0] == entry["sha256"]
            finally:
                os.close(fd)
            if same:
                return False
        _copy(src, sub, name, here, entry)
        return True
    finally:
        os.close(here)


def _copy(src: int, sub: list[str], name: str, here: int, entry: dict[str, Any]) -> None:
    """The checkpoint's file copied to a temporary name in ``here``, checked against the manifest, renamed over
    ``name`` (a link there is replaced, never written through)."""
    folder = held.descend(src, sub)
    try:
        fd = held.open_file(folder, name)
    finally:
        os.close(folder)
    tmp = f".{name}.putback-{uuid.uuid4().hex[:8]}"
    try:
        sha, count = held.sha256_copy(fd, entry["size"], here, tmp)
        if (sha, count) != (entry["sha256"], entry["size"]):
            raise CheckpointInvalid(
                f"{printable(name)}: the checkpoint's copy is not the manifest's bytes; not put back"
            )
        os.replace(tmp, name, src_dir_fd=here, dst_dir_fd=here)
        os.fsync(here)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=here)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(fd)
