"""What frameworks' checkpoints look like on disk, and whether one is a complete save.

A user's script saves the way its framework does, somewhere under ``TRAINYARD_CHECKPOINT_DIR`` (the lineage
root, or a folder of it up to ``MAX_DEPTH`` deep: ``<root>/lightning_logs/version_0/checkpoints/``)::

    <root>/hf/checkpoint-120/          "hf": Hugging Face Trainer (trainer_state.json + *.safetensors or
                                             pytorch_model*.bin; optimizer.pt, scheduler.pt, rng_state*.pth)
    <root>/lightning/epoch=0-step=120.ckpt   "lightning": a ModelCheckpoint file (torch.save zip)
    <root>/ckpt_000120.pt              "torch": a plain torch.save file (.pt, .pth)
    <root>/dcp/step-120/               "dcp": torch.distributed.checkpoint as torchtitan writes them (.metadata)
    <root>/out/latest/                 "torch_folder": torch.save files the script overwrites in place (latest/,
                                             last/, checkpoint/, ckpt/ or the spec's ``checkpoint.save_folder``)

Each format is one record of ``checkpoint.frameworks`` (how it is recognised, when it is complete, where its
step comes from); ``scan`` finds them (never following a link, never entering trainyard's own ``step_NNNNNN/``, ``.tmp``,
``superseded/`` or ``quarantine/``) and says of each why it is not a complete save, if it is not;
``settled`` whether it is done being written. Only names, sizes, times, a bounded ``trainer_state.json``
and zip trailers are read: nothing is unpickled (docs/architecture.md, rules 11 and 14), and no torch is
imported. ``checkpoint.foreign`` adopts what this module finds.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path

from trainyard.checkpoint import frameworks
from trainyard.checkpoint.format import MANIFEST, SUPERSEDED, is_step_name
from trainyard.checkpoint.frameworks import Framework, Reading
from trainyard.checkpoint.pickles import TORCH_FILES
from trainyard.text import printable

log = logging.getLogger(__name__)
_capped: set[str] = set()  # roots whose scan stopped at the cap: warned once, until a scan fits again

MAX_DEPTH = 3
"""How many folders below the root are searched: ``<root>/a/b/c/x.ckpt`` is found, one deeper is not. Three,
not two: Lightning's default with a logger is ``lightning_logs/version_0/checkpoints/epoch=0-step=120.ckpt``."""
SETTLE_S = 5.0
"""A save whose files have not changed for this long is complete (at a final sweep, or the first scan of it)."""
FILE_BYTES = 1 << 40
"""The cap on one adopted file (1 TiB): a sparse file of petabytes is evidence, not a checkpoint."""
MAX_FILES = 10_000
"""The most files one foreign save may hold (a sharded HF model holds tens; DCP one per rank)."""
SCAN_ENTRIES = 50_000
"""The most folder entries one scan lists, the saves' own files included: a sweep runs every half second, and a
root stuffed with folders (40,000 empty ones cost 0.5 s of CPU a sweep) must cost a bounded walk, not more.
Past it the scan stops, with one warning per root, and what it did not reach is not adopted."""
SKIP = frozenset({SUPERSEDED, "quarantine", MANIFEST, "__pycache__"})
_STEP_WORD = re.compile(r"step[=_-]?([0-9]+)")
_LAST_INT = re.compile(r"([0-9]+)(?!.*[0-9])")


@dataclass(frozen=True)
class Found:
    """One foreign save: what it is, where, its step (None: unknown from its name), its files, and why it is
    not complete (``problem``; "" when it is)."""

    kind: str
    path: Path
    source: str
    """``path`` relative to the root (POSIX): what the manifest records and messages name."""
    step: int | None
    files: tuple[tuple[str, int, int], ...] = ()
    """(name relative to ``path``'s folder for hf/dcp, the file's own name for lightning/torch, size, mtime_ns)."""
    problem: str = ""
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return not self.problem

    @property
    def signature(self) -> str:
        """Changes whenever any of its files is written: the same save is adopted once."""
        return hashlib.sha256(json.dumps([self.kind, self.source, self.files]).encode()).hexdigest()[:32]

    @property
    def newest_ns(self) -> int:
        return max((mtime for _, _, mtime in self.files), default=0)

    @property
    def step_named(self) -> bool:
        """Whether its name carries the step (a framework writes such a name once; ``last.ckpt`` and ``latest/``
        it rewrites, so their files are copied, never linked)."""
        fw = frameworks.FORMATS.get(self.kind)
        if fw is not None and fw.folder is not None:
            return fw.folder.groups > 0
        return _name_step(self.path.stem) is not None

    def describe(self) -> str:
        step = "step unknown" if self.step is None else f"step {self.step}"
        return f"{self.source} ({self.kind}, {step}): {self.problem or 'complete'}"


def _name_step(stem: str) -> int | None:
    """The step in a file's name: ``step=120``/``step_120`` wins, else the last integer (``ckpt_000120``)."""
    match = _STEP_WORD.search(stem) or _LAST_INT.search(stem)
    return int(match.group(1)) if match else None


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except OSError:
        return None


def _skipped(name: str) -> bool:
    """trainyard's own entries and hidden ones: a checkpoint, a save in progress, set-aside or quarantined ones."""
    return name in SKIP or name.startswith(".") or name.endswith(".tmp") or is_step_name(name)


def scan(root: Path, save_folder: str | None = None) -> list[Found]:
    """Every foreign save under ``root`` (complete or not), lowest step first (unknown steps last); at most
    ``SCAN_ENTRIES`` entries listed (a warning when it stops short). ``save_folder``: the spec's
    ``checkpoint.save_folder``, a folder name the script overwrites in place beside the common ones."""
    found: list[Found] = []
    budget = _Budget(SCAN_ENTRIES, save_folder)
    _scan_folder(Path(root), Path(root), 0, found, budget)
    key = str(root)
    if budget.over and key not in _capped:
        if len(_capped) > 256:  # a process sees few roots; never grow without bound
            _capped.clear()
        _capped.add(key)
        log.warning(
            "checkpoint scan of %s stopped at its cap of %d entries (folders and files listed): saves beyond"
            " it are not adopted. Remove what does not belong under the checkpoint folder",
            printable(root),
            SCAN_ENTRIES,
        )
    elif not budget.over:
        _capped.discard(key)
    return sorted(found, key=lambda f: (f.step is None, f.step or 0, f.source))


class _Budget:
    """How many more entries this scan may list (and the spec's ``save_folder``, which the whole scan asks)."""

    def __init__(self, left: int, save_folder: str | None = None):
        self.left, self.over, self.save_folder = left, False, save_folder

    def listing(self, folder: Path) -> list[os.DirEntry[str]]:
        """At most what is left of the budget of ``folder``'s entries (never the whole of a huge folder)."""
        if self.over:  # spent: nothing more is listed this scan
            return []
        with os.scandir(folder) as it:
            entries = list(itertools.islice(it, self.left + 1))
        if len(entries) > self.left:
            self.over, entries = True, entries[: self.left]
        self.left -= len(entries)
        return entries


def _scan_folder(root: Path, folder: Path, depth: int, found: list[Found], budget: _Budget) -> None:
    try:
        entries = sorted(budget.listing(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if _skipped(entry.name) or entry.is_symlink():  # a link is never followed, whatever it names
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            named = frameworks.of_folder(entry.name, budget.save_folder)
            if named is not None and not _a_parent(path, named[1], entry.name == budget.save_folder, budget):
                found.append(_folder_save(root, path, *named, budget))
            elif depth < MAX_DEPTH:
                _scan_folder(root, path, depth + 1, found, budget)
        elif entry.is_file(follow_symlinks=False) and (fw := frameworks.of_file(entry.name)) is not None:
            found.append(_file_save(root, path, fw))


def _a_parent(path: Path, step: int | None, named_by_spec: bool, budget: _Budget) -> bool:
    """Whether a folder with a common name and no step (``checkpoint/``) is a parent of saves rather than a save
    overwritten in place: it holds saves named with their step (``checkpoint-120/``, ``step_120.pt``), or no
    torch.save file at its top. The spec's ``save_folder`` is a save whatever it holds: the user said so."""
    if step is not None or named_by_spec:
        return False
    try:
        names = [e.name for e in budget.listing(path)]
    except OSError:
        return False
    return any(map(_names_a_step, names)) or not any(n.endswith(TORCH_FILES) for n in names)


def _names_a_step(name: str) -> bool:
    folder = frameworks.of_folder(name)
    return _STEP_WORD.search(name) is not None or (folder is not None and folder[1] is not None)


def _files(folder: Path, budget: _Budget) -> tuple[tuple[tuple[str, int, int], ...], str]:
    """The regular files of a save's folder (one level of subfolders) and a problem if it holds anything else."""
    out: list[tuple[str, int, int]] = []
    stack = [(folder, "")]
    while stack:
        here, prefix = stack.pop()
        try:
            entries = budget.listing(here)
        except OSError as exc:
            return (), f"cannot list {prefix or '.'} ({exc.strerror or exc})"
        if budget.over:
            return (), f"not listed whole: the scan's cap of {SCAN_ENTRIES} entries was reached"
        for entry in entries:
            rel = prefix + entry.name
            st = _lstat(Path(entry.path))
            if st is None:
                return (), f"{rel} vanished while it was listed (a save or rotation in progress?)"
            if stat.S_ISDIR(st.st_mode) and not prefix:
                stack.append((Path(entry.path), rel + "/"))
            elif not stat.S_ISREG(st.st_mode):
                return (), f"{rel} is a link or not a regular file; a checkpoint holds regular files only"
            # (a folder two deep counts as "not a regular file": no framework nests its save deeper)
            elif st.st_size > FILE_BYTES:
                return (), f"{rel} holds {st.st_size} bytes, past the cap of {FILE_BYTES}"
            else:
                out.append((rel, st.st_size, st.st_mtime_ns))
            if len(out) > MAX_FILES:
                return (), f"more than {MAX_FILES} files"
    return tuple(sorted(out)), ""


def _folder_save(root: Path, path: Path, fw: Framework, named: int | None, budget: _Budget) -> Found:
    files, problem = _files(path, budget)
    reading = fw.read(path, frozenset(rel for rel, _, _ in files)) if not problem else Reading(problem)
    step = reading.step if reading.step is not None else named
    return Found(fw.name, path, path.relative_to(root).as_posix(), step, files, reading.problem, reading.metrics)


def _file_save(root: Path, path: Path, fw: Framework) -> Found:
    st = _lstat(path)
    source = path.relative_to(root).as_posix()
    if st is None or not stat.S_ISREG(st.st_mode):
        return Found(fw.name, path, source, None, (), "vanished or not a regular file")
    files = ((path.name, st.st_size, st.st_mtime_ns),)
    if st.st_size > FILE_BYTES:
        return Found(
            fw.name, path, source, _name_step(path.stem), files, f"{st.st_size} bytes, past the cap of {FILE_BYTES}"
        )
    reading = fw.read(path, frozenset({path.name}))
    step = reading.step if reading.step is not None else _name_step(path.stem)
    return Found(fw.name, path, source, step, files, reading.problem, reading.metrics)


def settled(found: Found, previous: dict[str, str], now_ns: int, settle_s: float = SETTLE_S) -> bool:
    """Complete, and done being written: unchanged since the previous scan (``previous``: source ->
    signature), or untouched for ``settle_s``."""
    if not found.complete:
        return False
    return previous.get(found.source) == found.signature or now_ns - found.newest_ns >= settle_s * 1e9
