"""A pipeline's checkpoints over time: promote, quarantine, retain, set aside, tier.

``LATEST`` is the pointer to the latest valid checkpoint; it moves by one
atomic rename, so a reader sees the old pointer or the new one. It lives in
the lineage's folder, which training pods write, so it is read like anything
a worker wrote (docs/architecture.md, rule 14): through the one bounded
reader, and only a plain ``step_NNNNNN`` name of a real folder directly in the
root is taken (``pointer``); anything else is no pointer, with a warning. It
helps the watcher and the progress line; what the gate checks comes from the
ledger (``trainyard.pipeline.lineage.final_checkpoint``), never from it.

An invalid checkpoint moves to ``quarantine/`` with its reasons (a move:
nothing is deleted). A lineage restarted at a step sets aside the checkpoints
beyond it to ``superseded/`` (``set_aside``), so a later ``latest`` resume
never picks up a lineage that ended. Retention deletes only valid checkpoints
older than the newest ``keep`` and never the pointer's target, and of each
only what its manifest lists: a file someone else put in the folder stays, and
so does the folder. Every decision is a ledger event. Which run may train on
the lineage at all is ``trainyard.checkpoint.lease``.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from trainyard import held
from trainyard.atomic import json_bytes, read_json_capped, write_json_atomic
from trainyard.checkpoint import foreign
from trainyard.checkpoint.foreign import Adoption
from trainyard.checkpoint.format import (
    MANIFEST,
    is_step_name,
    list_checkpoints,
    read_manifest,
    step_of,
    supersede,
)
from trainyard.checkpoint.validate import Validation
from trainyard.errors import CheckpointInvalid
from trainyard.events.fold import fold
from trainyard.events.ledger import Ledger
from trainyard.text import printable

log = logging.getLogger(__name__)
LATEST = "LATEST"
QUARANTINE = "quarantine"
REASONS = "reasons.json"
STAGE = "train"
POINTER_BYTES = 1024
"""The cap on reading ``LATEST`` (what trainyard writes there is about a hundred bytes)."""
_warned: dict[str, str] = {}  # root -> the pointer problem last logged, so a poll loop warns once per change


def in_root(root: Path, path: str | Path) -> Path | None:
    """``path`` if it is a checkpoint folder directly in ``root``: named ``step_NNNNNN``, a real folder
    (not a link, FIFO or file); None for anything else (another root, ``..``, a link out)."""
    candidate = Path(path)
    if candidate.parent != root or not is_step_name(candidate.name):
        return None
    try:
        mode = os.lstat(candidate).st_mode
    except OSError:
        return None
    return candidate if stat.S_ISDIR(mode) else None


def pointer(root: Path) -> tuple[Path | None, str]:
    """The checkpoint ``LATEST`` names and "", or None and why not ("" when there is no ``LATEST``).

    Only ``{"path": "step_NNNNNN", ...}`` naming a real folder in ``root`` counts: an absolute
    path, ``..``, a link, a FIFO, an oversized or malformed file is refused, never followed.
    """
    file = root / LATEST
    try:
        raw = read_json_capped(file, POINTER_BYTES)
    except FileNotFoundError:
        return None, ""
    except (OSError, ValueError) as exc:
        return None, f"{file} is refused: {exc}"
    name = raw.get("path") if isinstance(raw, dict) else None
    if not isinstance(name, str) or not is_step_name(name):
        return None, f"{file} names {str(name)[:120]!r}, not a step_NNNNNN folder of {root}; ignored"
    target = in_root(root, root / name)
    if target is None and os.path.lexists(root / name):  # gone (a re-save's instant, a rollback): no pointer
        return None, f"{file} names {name}, which is a link or not a folder in {root}; ignored"
    return target, ""


def latest(root: Path) -> Path | None:
    """The checkpoint the pointer names, if it is one of ``root``'s own; a bad pointer is a warning and None."""
    target, problem = pointer(root)
    key = str(root)
    if problem and _warned.get(key) != problem:
        if len(_warned) > 256:  # a process sees few roots; never grow without bound
            _warned.clear()
        _warned[key] = problem
        log.warning("checkpoint pointer: %s", problem)
    elif not problem:
        _warned.pop(key, None)
    return target


def promote(root: Path, ckpt: Path, ledger: Ledger | None = None) -> bool:
    """Point ``LATEST`` at ``ckpt`` unless it already names a later step; True if it moved."""
    current = latest(root)
    if current is not None and (step_of(current) or 0) >= (step_of(ckpt) or 0):
        return False
    write_json_atomic(root / LATEST, {"path": ckpt.name, "step": step_of(ckpt), "promoted_at": time.time()})
    if ledger:
        ledger.append(STAGE, "checkpoint_promoted", path=str(ckpt), step=step_of(ckpt))
    return True


def set_aside(root: Path, start: Path | None) -> list[Path]:
    """Move every checkpoint of ``root`` that is not of a lineage starting at ``start`` to ``superseded/``
    (nothing is deleted); where the moved ones went.

    ``start`` in ``root``: those beyond its step (a lineage that ended there). ``start`` None (a fresh
    start) or elsewhere (resumed from another root): all of them. Call it before ``reset``, while the
    run holds the lineage's lease.
    """
    real = start.resolve() if start is not None else None  # one folder may be spelled two ways
    beyond = -1 if real is None or real.parent != root.resolve() else (step_of(real) or 0)
    moved = []
    for ckpt in list_checkpoints(root):
        if (step_of(ckpt) or 0) > beyond and ckpt.resolve() != real:  # never the start itself
            moved.append(supersede(ckpt))
    if moved:
        log.warning("set aside %d checkpoint(s) of an earlier lineage: %s", len(moved), ", ".join(map(str, moved)))
    return moved


def reset(root: Path, ckpt: Path | None, ledger: Ledger | None = None, moved: list[Path] | None = None) -> None:
    """Start a lineage at ``ckpt`` (None: a fresh start): later saves must follow its step.

    ``moved``: what ``set_aside`` moved out of its way, recorded with the reset.
    """
    if ckpt is None or ckpt.parent != root:
        (root / LATEST).unlink(missing_ok=True)  # a pointer, not a checkpoint: nothing is lost
    else:
        write_json_atomic(root / LATEST, {"path": ckpt.name, "step": step_of(ckpt), "promoted_at": time.time()})
    if ledger:
        ledger.append(STAGE, "lineage_reset", path=str(ckpt) if ckpt else None, set_aside=[str(p) for p in moved or ()])


def quarantine(root: Path, ckpt: Path, problems: list[str], ledger: Ledger | None = None) -> Path:
    """Move an invalid checkpoint of ``root`` out of the way with its reasons; never the pointer's target.

    By held folders (``trainyard.held``): the rename is relative to the root and to a ``quarantine/``
    opened without following links, so one a rank planted as a link is refused (``UnsafePath``) and the
    checkpoint stays where it is; the reasons go into the folder that was moved, wherever it is now.
    """
    if latest(root) == ckpt:
        raise ValueError(f"{ckpt} is the latest valid checkpoint; it cannot be quarantined")
    if ckpt.parent != root:
        raise ValueError(f"{ckpt} is not a checkpoint folder of {root}")
    shown = [printable(p, 1000) for p in problems]  # they name the rank's files: one line each
    name = f"{ckpt.name}-{int(time.time() * 1000)}"
    root_fd = held.open_root(root)
    try:
        aside = held.descend(root_fd, [QUARANTINE], create=True)
        try:
            moving = held.descend(root_fd, [ckpt.name])
            try:
                while held.entry_identity(aside, name) is not None:  # planted there: never replaced
                    name += "-1"
                os.rename(ckpt.name, name, src_dir_fd=root_fd, dst_dir_fd=aside)  # it stops being a candidate
                os.fsync(aside)
                held.write_atomic(moving, REASONS, json_bytes({"problems": shown, "quarantined_at": time.time()}))
            finally:
                os.close(moving)
        finally:
            os.close(aside)
    finally:
        os.close(root_fd)
    target = root / QUARANTINE / name
    log.warning("quarantined %s: %s", ckpt, "; ".join(shown))
    if ledger:
        ledger.append(STAGE, "checkpoint_quarantined", path=str(ckpt), to=str(target), problems=shown)
    return target


def retain(root: Path, keep: int, valid: set[str], pinned: set[str], ledger: Ledger | None = None) -> list[Path]:
    """Delete valid checkpoints older than the newest ``keep`` valid ones.

    Only names in ``valid`` count or go; the pointer's target and ``pinned``
    names (not yet copied to the cold tier) always stay.
    """
    target = latest(root)
    known = [c for c in list_checkpoints(root) if c.name in valid]
    doomed = [c for c in known[:-keep] if c != target and c.name not in pinned]
    for ckpt in doomed:
        kept = [printable(name) for name in remove_listed(ckpt)]  # names the rank chose
        if kept:
            log.warning("retired %s but kept what its manifest does not list: %s", ckpt, ", ".join(kept))
        if ledger:
            ledger.append(STAGE, "checkpoint_retired", path=str(ckpt), step=step_of(ckpt), kept=kept)
    return doomed


def remove_listed(ckpt: Path) -> list[str]:
    """Delete what ``ckpt``'s manifest lists, then the manifest, then the folder if now empty.

    Never a whole tree: a file the manifest does not list (or that changed size
    since the save, or sits behind a symbolic link) stays. Each step opens the
    next folder without following links, so a link swapped in meanwhile leads
    nowhere. Returns the names left in the folder ([] when it is gone).
    """
    try:
        files = read_manifest(ckpt)["files"]
    except CheckpointInvalid:
        files = None
    if files is not None:
        try:
            root = held.open_root(ckpt.parent)
        except OSError:
            return [ckpt.name]
        try:
            for rel, entry in files.items():
                if (path := _listed(rel)) is not None:
                    size = entry.get("size") if isinstance(entry, dict) else None
                    held.unlink_regular(root, [ckpt.name, *path.parts], size if isinstance(size, int) else -1)
            held.unlink_regular(root, [ckpt.name, MANIFEST])  # last: until now the folder still says what it holds
            for folder in sorted(
                {p for rel in files for p in PurePosixPath(rel).parents if p.parts}, key=_deepest_first
            ):
                held.remove_empty_dir(root, [ckpt.name, *folder.parts])
        finally:
            os.close(root)
    try:
        os.rmdir(ckpt)
    except FileNotFoundError:
        return []
    except OSError:
        return sorted(os.listdir(ckpt)) if ckpt.is_dir() and not ckpt.is_symlink() else [ckpt.name]
    return []


def _deepest_first(path: PurePosixPath) -> int:
    return -len(path.parts)  # the deepest folder first: each is empty before its parent is tried


def _listed(rel: str) -> PurePosixPath | None:
    path = PurePosixPath(rel)
    return path if rel and not path.is_absolute() and ".." not in path.parts and path.parts else None


BACKGROUND_NICE = 10
"""How much lower the watcher thread's CPU priority is than the process's. On the local backend it shares the
ranks' cores: a save's hashing, promotion and cold copy can wait a moment, a step cannot (every rank's step
waits for the slowest rank's)."""


def yield_cpu(by: int = BACKGROUND_NICE) -> None:
    """Lower the calling thread's CPU priority by ``by`` (Linux: a thread's nice value is its own)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + by))
    except (OSError, AttributeError):
        pass  # no per-thread priority here: the thread runs as before


class Watcher:
    """Validates each new checkpoint as soon as its manifest appears, on a background thread (at a lower CPU
    priority than training: ``yield_cpu``).

    ``validate(path, after_step)`` does the checking; valid checkpoints are
    promoted (and handed to ``on_valid``, e.g. to copy to the cold tier),
    invalid ones quarantined, and retention applied after each decision.
    With ``adoption``, each sweep first adopts the framework saves that completed
    (``adopt``): a user's Hugging Face, Lightning, torch.save or DCP checkpoint
    becomes a ``step_NNNNNN`` that the same sweep then judges.
    """

    def __init__(
        self,
        root: Path,
        validate: Callable[[Path, int | None], Validation],
        ledger: Ledger,
        keep: int,
        on_valid: Callable[[Path], None] | None = None,
        poll_s: float = 0.5,
        adoption: Adoption | None = None,
    ):
        self.root, self.validate, self.ledger, self.keep = root, validate, ledger, keep
        self.on_valid, self.poll_s = on_valid, poll_s
        self.adopter = foreign.Adopter(root, adoption, self._adopted) if adoption is not None else None
        self.seen: set[str] = set()
        self.valid: set[str] = set()
        self.pinned: set[str] = set()
        self.results: list[Validation] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="checkpoint-watcher", daemon=True)
        self._sweeping = threading.RLock()  # the thread's sweeps and a driver's catch_up take turns

    def __enter__(self) -> Watcher:
        self.seen = {c.name for c in list_checkpoints(self.root)}  # earlier runs' checkpoints were judged then
        self.valid = set(self.seen)
        self._thread.start()
        return self

    def carry_on(self, start_step: int) -> Watcher:
        """Pick up where an earlier process of this run left off, without a thread; then ``sweep()``.

        Checkpoints up to ``start_step`` came before this run; later ones are
        judged unless the ledger already holds their verdict -- a deferred
        train task sweeps once per wake-up, in a new process each time.
        """
        judged = fold(self.ledger.events(STAGE, "checkpoint_validated")).checkpoints
        verdicts = {row.name: row.valid is True for row in judged}
        before = {c.name for c in list_checkpoints(self.root) if (step_of(c) or 0) <= start_step}
        self.seen = before | set(verdicts)
        self.valid = before | {name for name, ok in verdicts.items() if ok}
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.sweep()  # a checkpoint written in the last instant is judged too

    def _loop(self) -> None:
        yield_cpu()
        while not self._stop.wait(self.poll_s):
            try:
                self.sweep()
            except Exception:
                log.exception("checkpoint watcher failed; will retry")

    def sweep(self) -> None:
        with self._sweeping:
            self.adopt()
            for ckpt in list_checkpoints(self.root):
                if ckpt.name not in self.seen:
                    self.seen.add(ckpt.name)
                    self._judge(ckpt)

    def catch_up(self, wait_s: float = 1.0) -> None:
        """Judge everything saved up to now before a recovery decision reads the lineage: a framework's save
        written just before a fault is adopted once it stops changing (``wait_s`` more at most), so the relaunch
        resumes from it rather than from the one before."""
        with self._sweeping:
            self.adopt(wait_s)
            self.sweep()

    def _judge(self, ckpt: Path) -> None:
        current = latest(self.root)
        result = self.validate(ckpt, step_of(current) if current else None)
        self.results.append(result)
        self.ledger.append(STAGE, "checkpoint_validated", **result.as_dict())
        if result.valid:
            self.valid.add(ckpt.name)
            promote(self.root, ckpt, self.ledger)
            if self.on_valid:
                self.pinned.add(ckpt.name)
                self.on_valid(ckpt)
                self.pinned.discard(ckpt.name)
        elif latest(self.root) != ckpt:
            try:
                quarantine(self.root, ckpt, result.problems, self.ledger)
            except OSError as exc:  # a link planted at quarantine/: the invalid one stays, judged invalid
                log.warning("cannot quarantine %s: %s", ckpt, printable(exc, 1000))
        retain(self.root, self.keep, self.valid, self.pinned, self.ledger)

    def adopt(self, wait_s: float = 0.0) -> list[Path]:
        """Adopt the framework saves that are complete now (``foreign.Adopter``); the checkpoints made."""
        return self.adopter.adopt(wait_s) if self.adopter is not None else []

    def _adopted(self, ckpt: Path, save: foreign.Found) -> None:
        self.ledger.append(
            STAGE,
            "checkpoint_adopted",
            path=str(ckpt),
            step=save.step,
            framework=save.kind,
            source=printable(save.source),  # shown by the fold's fate line: one line
        )
