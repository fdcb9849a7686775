"""Framework checkpoints adopted into trainyard's own format, and what a framework loads to resume.

``checkpoint.saves`` recognizes a complete Hugging Face, Lightning, torch.save or DCP save under the
lineage root. ``adopt`` makes one an ordinary trainyard checkpoint ``step_NNNNNN/`` through the usual
staging -> manifest -> commit path: its files hard-linked in (copied across file systems, or when the
framework rewrites that name in place, e.g. ``last.ckpt`` or a ``latest/`` folder), and the manifest names the ``framework`` and
the ``source``. Nothing of the user's is moved or deleted: when a framework rotates its own folders
away (``save_total_limit``) the links keep the adopted bytes. From then on validation, promotion,
retention, the cold copy, publishing and the lineage treat it like any other checkpoint. Each save is
adopted once (``adopted``: by the signature of its files, wherever its checkpoint went since).
``Adopter`` is what the checkpoint watcher runs at every sweep.

Torch-free and never unpickling (docs/architecture.md, rule 11): training processes import it for
``resume_file``. What a file holds is judged by ``checkpoint.validate`` and its sandboxed inspector.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from trainyard import held
from trainyard.atomic import json_bytes
from trainyard.checkpoint.format import (
    MANIFEST,
    SUPERSEDED,
    list_checkpoints,
    new_manifest,
    read_manifest,
    staging_dir,
    step_dir,
    step_of,
    supersede,
)
from trainyard.checkpoint.frameworks import FORMATS, STEP_KEYS
from trainyard.checkpoint.saves import MAX_DEPTH, SETTLE_S, Found, scan, settled
from trainyard.errors import CheckpointInvalid
from trainyard.text import printable

log = logging.getLogger(__name__)


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def unsettled(root: Path, found: list[Found], previous: dict[str, str], now_ns: int, since_ns: int = 0,
              settle_s: float = SETTLE_S) -> bool:  # fmt: skip
    """Whether a complete save that could be adopted is still too fresh to call done (a final sweep waits)."""
    newest = max((step_of(c) or 0 for c in list_checkpoints(root)), default=-1)
    return any(
        f.complete and (f.step is None or f.step > newest) and f.newest_ns >= since_ns
        and not settled(f, previous, now_ns, settle_s)
        for f in found
    )  # fmt: skip


@dataclass(frozen=True)
class RunShape:
    """What an adopted checkpoint's manifest records of the run that wrote it (the framework does not say).

    ``world_size``: the attempt's; ``global_batch``/``micro_batch``: the spec's training batch. For DCP the
    world size is at least one more than the highest rank file, so validation's rank check holds.
    """

    world_size: int
    global_batch: int
    micro_batch: int
    run_id: str


def adopted(root: Path) -> dict[str, tuple[int, bool]]:
    """signature -> (step, whether it was quarantined) of every save adopted into ``root``: its checkpoints and
    those set aside or quarantined (a save adopted once is never adopted again, even after a rollback)."""
    out: dict[str, tuple[int, bool]] = {}
    folders = [(c, False) for c in [*list_checkpoints(root), *_aside(root / SUPERSEDED)]]
    folders += [(c, True) for c in _aside(root / "quarantine")]
    for ckpt, refused in folders:
        try:
            manifest = read_manifest(ckpt)
        except CheckpointInvalid:
            continue
        if isinstance(manifest.get("source_signature"), str):
            out[manifest["source_signature"]] = (manifest["step"], refused)
    return out


def _aside(folder: Path) -> list[Path]:
    st = _lstat(folder)
    if st is None or not stat.S_ISDIR(st.st_mode):
        return []
    return [p for p in folder.iterdir() if not p.is_symlink() and p.is_dir() and (p / MANIFEST).is_file()]


def adoptable(
    root: Path,
    found: list[Found],
    previous: dict[str, str],
    now_ns: int,
    since_ns: int = 0,
    step_reader: Callable[[Path], int | None] | None = None,
    settle_s: float = SETTLE_S,
) -> list[Found]:
    """The complete saves to adopt now, lowest step first: settled, written since ``since_ns`` (this run's
    lineage start), beyond the root's newest checkpoint, not adopted before, one per step (a name that
    carries the step wins over ``last.ckpt``), not of a step whose adopted save was quarantined. ``step_reader`` asks the sandboxed inspector for the step of a
    file whose name does not say it; without one such files wait."""
    newest = max((step_of(c) or 0 for c in list_checkpoints(root)), default=-1)
    candidates = [
        f
        for f in found
        if (f.step is None or f.step > newest) and f.newest_ns >= since_ns and settled(f, previous, now_ns, settle_s)
    ]
    if not candidates:  # the usual poll: nothing new, no manifest read
        return []
    done = adopted(root)
    refused = {step for step, quarantined in done.values() if quarantined}  # last.ckpt: the same save again
    chosen: dict[int, Found] = {}
    for f in candidates:
        if f.signature in done:
            continue
        if f.step is None and step_reader is not None:
            f = Found(f.kind, f.path, f.source, step_reader(f.path), f.files, f.problem, f.metrics)
        if f.step is None or f.step <= newest or f.step in refused:
            continue
        if f.step not in chosen or (f.step_named and not chosen[f.step].step_named):
            chosen[f.step] = f
    return [chosen[s] for s in sorted(chosen)]


def adopt(root: Path, found: Found, shape: RunShape, metrics: dict[str, Any] | None = None) -> Path:
    """Commit ``found`` as ``<root>/step_NNNNNN/`` (its files linked in, manifest written last); its path.

    Idempotent: a save already adopted under that step is returned as it is. ``CheckpointInvalid`` if it is
    not complete, its step is unknown, another checkpoint holds that step, or a file changed meanwhile.
    """
    root = Path(root)
    if not found.complete or found.step is None:
        raise CheckpointInvalid(f"{printable(found.describe())}: not adoptable")
    final = step_dir(root, found.step)
    if final.is_dir() and not final.is_symlink():
        try:
            manifest = read_manifest(final)
        except CheckpointInvalid:
            manifest = {}
        if manifest.get("source_signature") == found.signature:
            return final
        raise CheckpointInvalid(f"{printable(found.source)}: step {found.step} already has a checkpoint, {final}")
    source = PurePosixPath(found.source)
    fw = FORMATS[found.kind]
    folder = source.parts if fw.folder is not None else source.parts[:-1]
    world = shape.world_size
    if fw.ranks is not None:
        ranks = [int(m.group(1)) for rel, _, _ in found.files if (m := fw.ranks.match(rel))]
        world = max(world, max(ranks, default=-1) + 1)
    tmp = staging_dir(root, found.step).name
    root_fd = held.open_root(root)
    try:
        # The lineage root is the ranks' folder: a staging folder only this call made, held by descriptor, so
        # a rank that swaps ``step_N.tmp`` (or anything under it) for a link redirects nothing.
        held.remove_tree(root_fd, tmp)  # a stale one of a killed adoption: never committed, nothing lost
        staging = held.make_dir(root_fd, tmp)
        made = held.identity(staging)
        try:
            files = _bring_all(root_fd, folder, staging, found)
            manifest = new_manifest(
                files,
                step=found.step,
                world_size=world,
                global_batch=shape.global_batch,
                micro_batch=shape.micro_batch,
                metrics={**found.metrics, **(metrics or {})},
                run_id=shape.run_id,
                extra={"framework": found.kind, "source": found.source, "source_signature": found.signature},
            )
            held.write_atomic(staging, MANIFEST, json_bytes(manifest))  # last: the commit record
        except CheckpointInvalid:
            if held.entry_identity(root_fd, tmp) == made:  # a torn copy leaves nothing behind (only ours)
                held.remove_tree(root_fd, tmp)
            raise
        finally:
            os.close(staging)
        return _commit(root_fd, root, tmp, made, found.step)
    finally:
        os.close(root_fd)


def _bring_all(root_fd: int, folder: tuple[str, ...], staging: int, found: Found) -> dict[str, dict[str, Any]]:
    """Each file of ``found`` brought into ``staging``, read from the save's folder as reached from the root
    now without following a link at any level (a folder swapped for a link since the scan is refused, not
    followed to a decoy elsewhere); name -> its manifest entry."""
    try:
        src = held.descend(root_fd, folder)
    except OSError as exc:
        raise CheckpointInvalid(
            f"{printable(found.source)}: a folder on its path is now a link, or gone ({exc.strerror or exc})"
        ) from None
    try:
        return {rel: _bring(src, rel, staging, size, mtime, found.step_named) for rel, size, mtime in found.files}
    finally:
        os.close(src)


def _bring(src: int, rel: str, staging: int, size: int, mtime_ns: int, link: bool) -> dict[str, Any]:
    """Link (or copy) the regular file ``rel`` of the held folder ``src`` into the held ``staging``: the file
    opened without following links is the one linked, and it must still be the size and age the scan saw.
    ``link``: a name written once; ``last.ckpt`` is rewritten in place, so it is copied."""
    *sub, name = PurePosixPath(rel).parts
    try:
        parent = held.descend(src, sub)
    except OSError as exc:
        raise CheckpointInvalid(f"{printable(rel)}: cannot open ({exc.strerror or exc}); a link or gone") from None
    try:
        try:
            fd = held.open_file(parent, name)
        except OSError as exc:
            raise CheckpointInvalid(f"{printable(rel)}: cannot open ({exc.strerror or exc}); a link or gone") from None
        try:
            st = os.fstat(fd)
            if st.st_size != size or st.st_mtime_ns != mtime_ns:
                raise CheckpointInvalid(f"{printable(rel)}: changed since it was scanned (written again)")
            out = held.descend(staging, sub, create=True)
            try:
                linked = link and held.link_opened(fd, parent, name, out)
                sha, count = held.sha256_copy(fd, size, None if linked else out, name)
            finally:
                os.close(out)
            if not linked:
                _unchanged_by_copy(rel, fd, parent, name, st)
        finally:
            os.close(fd)
    finally:
        os.close(parent)
    if count != size:
        raise CheckpointInvalid(f"{printable(rel)}: {count} bytes read, {size} expected (written meanwhile)")
    return {"size": size, "sha256": sha}


def _unchanged_by_copy(rel: str, fd: int, parent: int, name: str, before: os.stat_result) -> None:
    """A copy is of one save only if the file was not written during it: the same size and mtime as before
    (rewritten in place, ``torch.save`` over the name) and still the file the name leads to (replaced by a
    rename). Else the copy may be torn: refused for this look, the next look tries the next save."""
    after, now = os.fstat(fd), held.entry_identity(parent, name)
    if (after.st_size, after.st_mtime_ns) != (before.st_size, before.st_mtime_ns) or now != held.identity(fd):
        raise CheckpointInvalid(f"{printable(rel)}: written again while it was copied; this copy is not adopted")


def _commit(root_fd: int, root: Path, tmp: str, made: tuple[int, int], step: int) -> Path:
    """Rename the staged folder ``tmp`` (the one made and written, ``made``) to ``step_NNNNNN`` in the held
    root; a ``tmp`` swapped for anything else meanwhile is not committed."""
    final = step_dir(root, step)
    if held.entry_identity(root_fd, final.name) is not None:
        supersede(final)  # never deleted: moved aside, the only window keeps both
    if held.entry_identity(root_fd, tmp) != made:
        raise CheckpointInvalid(f"{root / tmp} was replaced while a save was adopted into it; not committed")
    os.rename(tmp, final.name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
    os.fsync(root_fd)
    if held.entry_identity(root_fd, final.name) != made:  # swapped between the check and the rename: a rank's
        raise CheckpointInvalid(f"{final}: not the folder adopted (replaced meanwhile); judged as a rank's save")
    return final


@dataclass(frozen=True)
class Adoption:
    """How a watcher adopts framework saves: the manifest's run fields (``shape``, asked at each adoption: the
    attempt's world size changes), only saves written since ``since_ns`` (the lineage's start: a fresh run
    does not take last night's ``checkpoint-120``), and who reads the step of a file whose name does not say
    it (the sandboxed inspector; None: such files are not adopted); ``save_folder``: the spec's name of a folder
    the script overwrites in place (``checkpoint.save_folder``)."""

    shape: Callable[[], RunShape]
    since_ns: int = 0
    step_reader: Callable[[Path], int | None] | None = None
    settle_s: float = SETTLE_S
    save_folder: str | None = None


class Adopter:
    """Adopts, at each look, the saves under ``root`` that completed since the last (``adoptable``), and hands
    each checkpoint made to ``on_adopted(ckpt, save)`` (the watcher's ledger event)."""

    def __init__(self, root: Path, adoption: Adoption, on_adopted: Callable[[Path, Found], None]):
        self.root, self.adoption, self.on_adopted = root, adoption, on_adopted
        self.scanned: dict[str, str] = {}  # source -> signature at the last look: unchanged since is complete
        self.steps: dict[str, int | None] = {}  # a save's version -> the inspector's step, asked once

    def adopt(self, wait_s: float = 0.0) -> list[Path]:
        """The checkpoints made. ``wait_s`` (a final sweep): if a save it could adopt is still too fresh to
        call settled, look again once after that long (unchanged between the two looks is settled)."""
        made, pending = self._once()
        if wait_s > 0 and pending:
            time.sleep(wait_s)
            made += self._once()[0]
        return made

    def _once(self) -> tuple[list[Path], bool]:
        a = self.adoption
        found, now = scan(self.root, a.save_folder), time.time_ns()
        versions = {f.path: f.signature for f in found}
        reader = (lambda path: self._step(path, versions[path])) if a.step_reader else None
        chosen = adoptable(self.root, found, self.scanned, now, a.since_ns, reader, a.settle_s)
        pending = unsettled(self.root, found, self.scanned, now, a.since_ns, a.settle_s)
        self.scanned = {f.source: f.signature for f in found}
        made = []
        for save in chosen:
            try:
                ckpt = adopt(self.root, save, a.shape())
            except (CheckpointInvalid, OSError) as exc:  # changed meanwhile or a step taken: the next look tries
                log.warning("cannot adopt %s: %s", printable(save.source), printable(exc, 1000))
                self.scanned.pop(save.source, None)
                continue
            self.on_adopted(ckpt, save)
            made.append(ckpt)
        return made, pending

    def _step(self, path: Path, signature: str) -> int | None:
        # By the signature of all its files: a folder overwritten in place keeps its own mtime.
        assert self.adoption.step_reader is not None
        key = f"{path}:{signature}"
        if key not in self.steps:
            if len(self.steps) > 1024:  # a file rewritten at every save (last.ckpt): never grow without bound
                self.steps.clear()
            self.steps[key] = self.adoption.step_reader(path)
        return self.steps[key]


def framework(ckpt_dir: Path) -> str | None:
    """The framework an adopted checkpoint came from (None: trainyard's own, or not readable)."""
    try:
        kind = read_manifest(ckpt_dir).get("framework")
    except CheckpointInvalid:
        return None
    return kind if kind in FORMATS else None


def resume_file(step_dir: Path, kind: str | None = None) -> Path:
    """What a framework loads to resume from the adopted checkpoint ``step_dir`` (``TRAINYARD_RESUME_FROM``):
    the folder itself for a folder format and trainyard's own; the one file of its suffixes inside it for a
    one-file format (``Framework.resume_file``). ``kind`` defaults to the manifest's ``framework``. Torch-free:
    workers call it."""
    step_dir = Path(step_dir)
    kind = kind if kind is not None else framework(step_dir)
    fw = FORMATS.get(kind) if kind is not None else None
    return fw.resume_file(step_dir) if fw is not None else step_dir


FORMATS_HELP = (
    "trainyard understands: its own saves (trainyard.runtime's checkpointer: step_NNNNNN/ with manifest.json); "
    + "; ".join(fw.help for fw in FORMATS.values())
    + f". Save them under TRAINYARD_CHECKPOINT_DIR (or a folder of it, up to {MAX_DEPTH} deep), with the step in"
    " the name (step=120, _000120, checkpoint-120) or, for a torch.save file, in it (its top-level "
    + ", ".join(STEP_KEYS)
    + ", or checkpoint.step_key)."
)
"""Built from the registered formats when this module is imported (a format registered later is not named)."""


def explain(root: Path, save_folder: str | None = None) -> list[str]:
    """One line per foreign save under ``root``: what it is and, if it was not taken, why (for the gate)."""
    return [printable(f.describe(), 400) for f in scan(root, save_folder)]  # rank-chosen names: one line each


__all__ = [
    "FORMATS",
    "FORMATS_HELP",
    "MAX_DEPTH",
    "SETTLE_S",
    "Adopter",
    "Adoption",
    "Found",
    "RunShape",
    "adopt",
    "adoptable",
    "adopted",
    "explain",
    "framework",
    "resume_file",
    "scan",
    "settled",
    "unsettled",
]
