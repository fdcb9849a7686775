"""Held folder handles: reads and writes inside a folder training code can write, by descriptors, never by path.

A lineage root (a pipeline's checkpoint folder) is written by its ranks, which are untrusted
(docs/architecture.md, rule 11). A path like ``<root>/step_000120.tmp/model.safetensors`` is looked up
again, component by component, at every use: a rank that swaps any folder on it for a symbolic link
between two uses makes a by-path write land wherever the link leads (another pipeline's root). So the
orchestrator holds descriptors instead (``openat``-style):

- ``open_root``: the root, the one path taken as it is (its parents are the operator's; ranks write
  inside it, not above it).
- ``descend``: from a held folder down by names, each opened ``O_NOFOLLOW|O_DIRECTORY``: a link at
  any level is refused (``UnsafePath``), not only at the last one. ``create`` makes a missing level
  with ``mkdir`` relative to its held parent.
- ``make_dir``: a new folder (``mkdir`` fails if anything is there) and its descriptor.
- ``open_file`` / ``create_file`` / ``write_atomic``: a regular file read, a new file
  (``O_CREAT|O_EXCL|O_NOFOLLOW``), a whole-file replace (temporary name, rename), each relative to a
  held folder.
- ``link_opened`` / ``sha256_copy``: a file opened by descriptor linked (only if the name is still that
  file) or copied into a held folder, hashed from the one read.
- ``identity`` / ``entry_identity``: what a held descriptor is and what a name leads to now, so a
  rename of a name can be checked against the folder this process made and wrote.
- ``unlink_regular`` / ``remove_empty_dir`` / ``remove_tree``: removals that never follow a link: one
  regular file, one empty folder, a stale folder of this process's with everything in it.

Once held, a folder stays the one written into even if a rank renames it away meanwhile: the writes
land in that folder wherever it went (somewhere the rank could already write), never through a link.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import uuid
from collections.abc import Iterable, Sequence
from pathlib import Path

from trainyard.atomic import UnsafePath

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO must not hang the open
_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _refused(name: str, what: str) -> UnsafePath:
    return UnsafePath(
        errno.ELOOP,
        f"{name!r} is {what}; trainyard reads and writes there only through folders it opened without"
        " following links. Remove it (and find out who made it), then retry",
    )


def open_root(root: Path) -> int:
    """A descriptor of the folder ``root`` (``FileNotFoundError`` if missing)."""
    return os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def _open_dir(parent: int, name: str) -> int:
    if not name or name in (".", "..") or "/" in name:
        raise _refused(name, "not one plain name")
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise _refused(name, "a symbolic link or not a folder") from None
        raise


def descend(parent: int, names: Iterable[str], create: bool = False) -> int:
    """A new descriptor of the folder ``names`` leads to from the held ``parent``, no link followed at any level
    (``UnsafePath``); missing levels are made if ``create``. The caller closes it; ``parent`` stays open."""
    fd = os.dup(parent)
    try:
        for name in names:
            try:
                child = _open_dir(fd, name)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except FileExistsError:  # made meanwhile by someone else: opened below, a link refused
                    pass
                child = _open_dir(fd, name)
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_dir(parent: int, name: str, mode: int = 0o755) -> int:
    """A folder ``name`` made new in ``parent`` (``FileExistsError`` if anything is there) and its descriptor."""
    os.mkdir(name, mode, dir_fd=parent)
    return _open_dir(parent, name)


def open_file(parent: int, name: str) -> int:
    """``name`` in the held ``parent`` opened to read: a regular file only (not a link, FIFO or device)."""
    try:
        fd = os.open(name, _FILE, dir_fd=parent)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refused(name, "a symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise _refused(name, "not a regular file")
    os.set_blocking(fd, True)
    return fd


def create_file(parent: int, name: str, mode: int = 0o644) -> int:
    """A new regular file ``name`` in the held ``parent``, opened to write (``FileExistsError`` if anything,
    a link included, is there: never written through)."""
    return os.open(name, _NEW, mode, dir_fd=parent)


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_atomic(parent: int, name: str, data: bytes) -> None:
    """Replace ``name`` in the held ``parent`` with ``data`` whole and durably: a hidden temporary made there
    exclusively, fsynced, renamed over ``name`` (a link at ``name`` is replaced, not followed)."""
    tmp = f".{name}.part-{uuid.uuid4().hex[:8]}"
    fd = create_file(parent, tmp)
    try:
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, name, src_dir_fd=parent, dst_dir_fd=parent)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=parent)
        except FileNotFoundError:
            pass
        raise
    os.fsync(parent)


def link_opened(fd: int, parent: int, name: str, out: int) -> bool:
    """Hard-link ``name`` of the held ``parent`` into the held ``out`` if it is still the file open as ``fd``
    (same device and inode: a file swapped in meanwhile, or a link, is never what gets linked); False where
    linking cannot be done (another file system) or the name now leads elsewhere (nothing left behind)."""
    try:
        os.link(name, name, src_dir_fd=parent, dst_dir_fd=out, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            return False
        raise
    if entry_identity(out, name) == identity(fd):
        return True
    os.unlink(name, dir_fd=out)
    return False


def sha256_copy(fd: int, size: int, out: int | None, name: str) -> tuple[str, int]:
    """The sha256 and length of what ``fd`` holds (read once, at most one byte past ``size``), copied on the
    way into a new file ``name`` of the held folder ``out`` (fsynced) unless ``out`` is None (already linked).
    The bytes hashed are the bytes written: one read, never a second open of the name."""
    digest, offset = hashlib.sha256(), 0
    dst = create_file(out, name) if out is not None else None
    try:
        while offset <= size:
            chunk = os.pread(fd, min(1 << 24, size - offset + 1), offset)
            if not chunk:
                break
            digest.update(chunk)
            if dst is not None:
                write_all(dst, chunk)
            offset += len(chunk)
        if dst is not None:
            os.fsync(dst)
    finally:
        if dst is not None:
            os.close(dst)
    return digest.hexdigest(), offset


def identity(fd: int) -> tuple[int, int]:
    """(device, inode) of a held descriptor."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def entry_identity(parent: int, name: str) -> tuple[int, int] | None:
    """(device, inode) of what ``name`` in ``parent`` is now (a link's own, never its target's); None if nothing."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def unlink_regular(parent: int, names: Sequence[str], size: int | None = None) -> None:
    """Unlink the regular file ``names`` leads to from the held ``parent`` (of ``size`` bytes unless None),
    reached without following links; anything else there (a link, a folder, another size, nothing) stays."""
    *folders, name = names
    try:
        fd = descend(parent, folders)
    except OSError:  # gone, not a folder, or a link on the way
        return
    try:
        st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and (size is None or st.st_size == size):
            os.unlink(name, dir_fd=fd)
    except FileNotFoundError:
        pass  # a removal killed midway already took it
    finally:
        os.close(fd)


def remove_empty_dir(parent: int, names: Sequence[str]) -> None:
    """Remove the folder ``names`` leads to from the held ``parent`` if it is empty; otherwise it stays."""
    *folders, name = names
    try:
        fd = descend(parent, folders)
    except OSError:
        return
    try:
        os.rmdir(name, dir_fd=fd)
    except OSError:
        pass  # not empty (someone else's file), a link, or gone
    finally:
        os.close(fd)


def remove_tree(parent: int, name: str) -> None:
    """Remove ``name`` from the held ``parent``: a link or file unlinked (its target untouched), a folder with
    everything in it, no link inside followed (``shutil.rmtree`` by descriptors). Missing: nothing to do."""
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return
    if stat.S_ISDIR(st.st_mode):
        if not shutil.rmtree.avoids_symlink_attacks:  # Linux has the descriptor-based walk; elsewhere: refuse
            raise _refused(name, "a folder this platform cannot remove without following links")
        shutil.rmtree(name, dir_fd=parent)
    else:
        os.unlink(name, dir_fd=parent)
