"""The files a training script reads beside its shards (``dataset.files``): found at the source, verified as staged.

A vocabulary (nanoGPT's ``meta.pkl``) or a tokenizer is not a shard: no format's gate reads it, and it is
never opened but to hash it (never unpickled: docs/architecture.md, rule 11). Staging (``storage.staging``)
picks the named files out of the source's listing (``pick``) and stages them with the shards whatever the
format, then checks what landed (``check_staged``); the data gate (``quality.dataset``) checks the staged
folder again the same way. What a format leaves at the source unnamed is a warning (``unstaged_warning``):
a script that silently falls back to another vocabulary is the failure this module exists for.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from trainyard.errors import DataError
from trainyard.spec import FORMAT_SUFFIXES, DataFile
from trainyard.storage.hashing import sha256_file
from trainyard.storage.hot import RESERVED, reserved
from trainyard.storage.keys import key_path
from trainyard.storage.tier import ObjectInfo

SHOWN = 10
"""How many unstaged source files a warning names; the rest are counted."""


@dataclass(frozen=True)
class Picked:
    """The named files found at the source (to stage with the shards), and the optional ones that are not there."""

    objects: list[ObjectInfo]
    warnings: list[str]


@dataclass(frozen=True)
class FilesChecked:
    """What a staged folder holds of ``dataset.files``: the names verified, and what is wrong or missing."""

    verified: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    """A required file missing, or a size or sha256 that is not the spec's: the data check fails on them."""
    warnings: list[str] = field(default_factory=list)
    """An optional file that is not there."""


def pick(files: Sequence[DataFile], listed: Mapping[str, ObjectInfo], source: str) -> Picked:
    """The named files in ``listed`` (the source's objects by key); ``DataError`` naming every required file that is
    not there and every size the listing already shows is wrong, before anything is copied."""
    found, problems, warnings = [], [], []
    for i, wanted in enumerate(files):
        obj = listed.get(wanted.name)
        if reserved(wanted.name):
            problems.append(
                f"dataset.files[{i}].name: {wanted.name!r} is named like trainyard's own files of a hot folder"
                f" ({', '.join(sorted(RESERVED))}), which staging never copies; rename it at the source and here"
            )
        elif obj is None and wanted.required:
            problems.append(
                f"dataset.files[{i}].name: {wanted.name} is not at the source {source}; put it there beside the"
                f" shards, or set dataset.files[{i}].required: false if the script does without it"
            )
        elif obj is None:
            warnings.append(_optional_missing(i, wanted.name, f"at the source {source}"))
        elif (wrong := _size_problem(i, wanted, obj.size, f"at the source {source}")) is not None:
            problems.append(wrong)
        else:
            found.append(obj)
    if problems:
        raise DataError("; ".join(problems))
    return Picked(found, warnings)


def check_staged(hot_dir: Path, files: Sequence[DataFile], staged: Mapping[str, Mapping[str, Any]]) -> FilesChecked:
    """Each named file in ``hot_dir`` as its manifest entry (``staged``) says, with the spec's size and sha256.

    The file is hashed where the spec gives a sha256: whatever digest staging verified the copy with (xxh3
    for a local copy, an S3 checksum), the spec's promise is a sha256 of the bytes the script will read.
    """
    checked = FilesChecked()
    for i, wanted in enumerate(files):
        entry = staged.get(wanted.name)
        if entry is None:
            if wanted.required:
                checked.problems.append(
                    f"dataset.files[{i}].name: {wanted.name} is not in the staged dataset {hot_dir}; clear"
                    " stage_dataset in the Airflow UI to stage it again (it must be at dataset.source)"
                )
            else:
                checked.warnings.append(_optional_missing(i, wanted.name, f"in the staged dataset {hot_dir}"))
            continue
        path = key_path(hot_dir, wanted.name)
        size = _regular_size(path)
        if size is None or size != entry.get("size"):
            checked.problems.append(
                f"dataset.files[{i}].name: {wanted.name} in {hot_dir} is missing or changed since it was staged"
                f" ({'not a regular file' if size is None else f'{size} bytes'}, staged {entry.get('size')});"
                " clear stage_dataset in the Airflow UI to stage it again"
            )
        elif (wrong := _size_problem(i, wanted, size, f"in {hot_dir}")) is not None:
            checked.problems.append(wrong)
        elif wanted.sha256 is not None and (found := sha256_file(path)) != wanted.sha256:
            checked.problems.append(
                f"dataset.files[{i}].sha256: {wanted.name} has sha256 {found}, expected {wanted.sha256}; fix the"
                " file at dataset.source (then stage again) or the sha256 in the spec"
            )
        else:
            checked.verified.append(wanted.name)
    return checked


def unstaged_keys(keys: Sequence[str]) -> list[str]:
    """The source keys a format leaves behind that a script might read: not hidden or marker files (a part
    starting with ``.`` or ``_``: Spark's ``_SUCCESS``, ``.crc`` sums, which Hadoop's readers skip too)."""
    return sorted(k for k in keys if not any(p.startswith((".", "_")) for p in PurePosixPath(k).parts))


def unstaged_warning(keys: Sequence[str], suffixes: Sequence[str]) -> str | None:
    """The warning for source files the format (its ``suffixes``) does not stage and ``dataset.files`` does not
    name, bounded."""
    if not keys:
        return None
    format = next((f for f, own in FORMAT_SUFFIXES.items() if tuple(own) == tuple(suffixes)), "of this dataset")
    shown = ", ".join(keys[:SHOWN]) + (f" and {len(keys) - SHOWN} more" if len(keys) > SHOWN else "")
    one = len(keys) == 1
    return (
        f"{shown} at the source {'is' if one else 'are'} not staged; name {'it' if one else 'them'} in"
        f" dataset.files if the script reads {'it' if one else 'them'} (dataset.format {format} stages only its"
        f" {'/'.join(suffixes)} files)"
    )


def _optional_missing(i: int, name: str, where: str) -> str:
    return (
        f"dataset.files[{i}].name: {name} is not {where}; not staged (required: false): the script must do without it"
    )


def _size_problem(i: int, wanted: DataFile, size: int, where: str) -> str | None:
    if wanted.size is None or wanted.size == size:
        return None
    return (
        f"dataset.files[{i}].size: {wanted.name} is {size} bytes {where}, expected {wanted.size}; fix the file at"
        " dataset.source or the size in the spec"
    )


def _regular_size(path: Path) -> int | None:
    """The size of a regular file at ``path`` (no link followed), else None."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_size if stat.S_ISREG(st.st_mode) else None
