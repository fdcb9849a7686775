"""Object keys: the relative names of files inside a tier root.

A key comes from a listing we do not control (a bucket anyone may write to),
so before it becomes a path it must be proven to stay inside its root.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path, PurePosixPath

from trainyard.errors import DataError


def check_key(key: str) -> str:
    """Return ``key`` if it is a safe relative POSIX key, else raise ``DataError``."""
    parts = PurePosixPath(key).parts
    if (
        not key
        or key.startswith("/")
        or "\\" in key
        or "\x00" in key
        or any(part in ("..", ".") for part in parts)
        or key != str(PurePosixPath(*parts))
    ):
        raise DataError(
            f"object key {key!r} would escape the tier root; keys must be relative without '..', '\\' or NUL"
        )
    return key


def key_path(root: Path, key: str) -> Path:
    """The path of ``key`` under ``root``, refused if it would land outside it."""
    return key_paths(root, [key])[key]


def key_paths(root: Path, keys: Iterable[str]) -> dict[str, Path]:
    """``key_path`` of each key, each folder resolved once: a stage names thousands of keys in a few folders, and
    resolving every path whole (a ``stat`` per component, and the root again) cost ~70 us a key."""
    real_root = root.resolve()
    inside: dict[Path, bool] = {}
    paths = {}
    for key in keys:
        path = root.joinpath(*PurePosixPath(check_key(key)).parts)
        folder = path.parent
        if (ok := inside.get(folder)) is None:
            ok = inside[folder] = folder.resolve().is_relative_to(real_root)
        if not ok or (path.is_symlink() and not path.resolve().is_relative_to(real_root)):
            raise DataError(f"object key {key!r} resolves outside {root} (through a symbolic link)")
        paths[key] = path
    return paths
