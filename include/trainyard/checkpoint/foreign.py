"""Checkpoints that frameworks write, recognized and adopted into trainyard's own format.

A user's script saves the way its framework does, somewhere under ``TRAINYARD_CHECKPOINT_DIR`` (the lineage
root, or a folder of it up to ``MAX_DEPTH`` deep: ``<root>/lightning_logs/version_0/checkpoints/``)::

    <root>/hf/checkpoint-120/          "hf": Hugging Face Trainer (trainer_state.json + *.safetensors or
                                             pytorch_model*.bin; optimizer.pt, scheduler.pt, rng_state*.pth)
    <root>/lightning/epoch=0-step=120.ckpt   "lightning": a ModelCheckpoint file (torch.save zip)
    <root>/ckpt_000120.pt              "torch": a plain torch.save file (.pt, .pth)
    <root>/dcp/step-120/               "dcp": torch.distributed.checkpoint as torchtitan writes it (.metadata)

``scan`` finds them (never following a link, never entering trainyard's own ``step_NNNNNN/``, ``.tmp``,
``superseded/`` or ``quarantine/``) and says for each why it is not a complete save yet, if it is not.
``adopt`` makes a complete one an ordinary trainyard checkpoint ``step_NNNNNN/`` through the usual
staging -> manifest -> commit path: its files hard-linked in (copied across file systems, or when the
framework rewrites that name in place, e.g. ``last.ckpt``), and the manifest names the ``framework`` and
the ``source``. Nothing of the user's is moved or deleted: when a framework rotates its own folders
away (``save_total_limit``) the links keep the adopted bytes. From then on validation, promotion,
retention, the cold copy, publishing and the lineage treat it like any other checkpoint.

This module reads names, sizes, times and a few bounded JSON and zip-trailer bytes; it never unpickles
(docs/architecture.md, rule 11) and imports no torch, so training processes may import it too
(``resume_file``). What a file holds is judged by ``checkpoint.validate`` and its sandboxed inspector.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainyard.atomic import TooLarge, read_json_capped
from trainyard.checkpoint.format import (
    MANIFEST,
    SUPERSEDED,
    commit,
    is_step_name,
    list_checkpoints,
    prepare_staging,
    read_manifest,
    step_dir,
    step_of,
    write_manifest,
)
from trainyard.errors import CheckpointInvalid

FRAMEWORKS = ("hf", "lightning", "torch", "dcp")
"""The manifest's ``framework`` of an adopted checkpoint; absent: trainyard's own (DCP)."""
MAX_DEPTH = 3
"""How many folders below the root are searched: ``<root>/a/b/c/x.ckpt`` is found, one deeper is not. Three,
not two: Lightning's default with a logger is ``lightning_logs/version_0/checkpoints/epoch=0-step=120.ckpt``."""
SETTLE_S = 5.0
"""A save whose files have not changed for this long is complete (at a final sweep, or the first scan of it)."""
STATE_BYTES = 16 << 20
"""The cap on reading ``trainer_state.json`` (its log history grows with the run: kilobytes to a few MB)."""
FILE_BYTES = 1 << 40
"""The cap on one adopted file (1 TiB): a sparse file of petabytes is evidence, not a checkpoint."""
MAX_FILES = 10_000
"""The most files one foreign save may hold (a sharded HF model holds tens; DCP one per rank)."""
SKIP = frozenset({SUPERSEDED, "quarantine", MANIFEST, "__pycache__"})
HF_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
_HF_DIR = re.compile(r"checkpoint-([0-9]+)\Z")
_DCP_DIR = re.compile(r"step-([0-9]+)\Z")
_STEP_WORD = re.compile(r"step[=_-]?([0-9]+)")
_LAST_INT = re.compile(r"([0-9]+)(?!.*[0-9])")
_EOCD = b"PK\x05\x06"
_EOCD_SPAN = 22 + 65535  # the end-of-central-directory record and the longest zip comment


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
        """Whether its name carries the step (a framework writes such a name once; ``last.ckpt`` it rewrites)."""
        return self.kind in ("hf", "dcp") or _name_step(self.path.stem) is not None

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


def scan(root: Path) -> list[Found]:
    """Every foreign save under ``root`` (complete or not), lowest step first (unknown steps last)."""
    found: list[Found] = []
    _scan_folder(Path(root), Path(root), 0, found)
    return sorted(found, key=lambda f: (f.step is None, f.step or 0, f.source))


def _scan_folder(root: Path, folder: Path, depth: int, found: list[Found]) -> None:
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for entry in entries:
        if _skipped(entry.name) or entry.is_symlink():  # a link is never followed, whatever it names
            continue
        path = Path(entry.path)
        if entry.is_dir(follow_symlinks=False):
            if _HF_DIR.match(entry.name):
                found.append(_hf(root, path))
            elif _DCP_DIR.match(entry.name):
                found.append(_dcp(root, path))
            elif depth < MAX_DEPTH:
                _scan_folder(root, path, depth + 1, found)
        elif entry.is_file(follow_symlinks=False) and entry.name.endswith((".ckpt", ".pt", ".pth")):
            found.append(_torch_file(root, path))


def _files(folder: Path) -> tuple[tuple[tuple[str, int, int], ...], str]:
    """The regular files of a save's folder (one level of subfolders) and a problem if it holds anything else."""
    out: list[tuple[str, int, int]] = []
    stack = [(folder, "")]
    while stack:
        here, prefix = stack.pop()
        try:
            entries = list(os.scandir(here))
        except OSError as exc:
            return (), f"cannot list {prefix or '.'} ({exc.strerror or exc})"
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


def _hf(root: Path, path: Path) -> Found:
    files, problem = _files(path)
    source = path.relative_to(root).as_posix()
    step: int | None = int(_HF_DIR.match(path.name).group(1))  # type: ignore[union-attr]
    names = {rel for rel, _, _ in files}
    metrics: dict[str, float] = {}
    if not problem and HF_STATE not in names:
        problem = f"no {HF_STATE} (save incomplete?)"
    elif not problem and not any(n.endswith(".safetensors") or _hf_bin_weights(n) for n in names):
        problem = "no model weights (*.safetensors or pytorch_model*.bin)"
    if not problem:
        state_step, metrics, problem = _trainer_state(path / HF_STATE)
        step = state_step if state_step is not None else step
    if not problem:
        problem = _zip_problems(path, [n for n in names if n.endswith(TORCH_SUFFIXES)])
    return Found("hf", path, source, step, files, problem, metrics)


def _hf_bin_weights(name: str) -> bool:
    return name.startswith("pytorch_model") and name.endswith(".bin")


def _trainer_state(path: Path) -> tuple[int | None, dict[str, float], str]:
    """``global_step`` and the last logged losses of a ``trainer_state.json``, read bounded and schema-checked."""
    try:
        state = read_json_capped(path, STATE_BYTES)
    except (OSError, ValueError, TooLarge) as exc:  # a link, a FIFO, oversized, not JSON
        return None, {}, f"{HF_STATE} is unreadable ({exc})"
    if not isinstance(state, dict):
        return None, {}, f"{HF_STATE} is not a JSON object"
    step = state.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return None, {}, f"{HF_STATE} has no integer global_step"
    metrics: dict[str, float] = {}
    history = state.get("log_history")
    for entry in history if isinstance(history, list) else []:
        if not isinstance(entry, dict):
            continue
        for key in ("loss", "eval_loss"):
            value = entry.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[key] = float(value)  # the last logged value wins
    return step, metrics, ""


def _dcp(root: Path, path: Path) -> Found:
    files, problem = _files(path)
    if not problem and DCP_METADATA not in {rel for rel, _, _ in files}:
        problem = f"no {DCP_METADATA} (save incomplete?)"
    step = int(_DCP_DIR.match(path.name).group(1))  # type: ignore[union-attr]
    return Found("dcp", path, path.relative_to(root).as_posix(), step, files, problem)


def _torch_file(root: Path, path: Path) -> Found:
    kind = "lightning" if path.suffix == ".ckpt" else "torch"
    st = _lstat(path)
    source = path.relative_to(root).as_posix()
    if st is None or not stat.S_ISREG(st.st_mode):
        return Found(kind, path, source, None, (), "vanished or not a regular file")
    files = ((path.name, st.st_size, st.st_mtime_ns),)
    problem = f"{st.st_size} bytes, past the cap of {FILE_BYTES}" if st.st_size > FILE_BYTES else ""
    return Found(kind, path, source, _name_step(path.stem), files, problem or _zip_problems(path.parent, [path.name]))


def _zip_problems(folder: Path, names: Iterable[str]) -> str:
    """A torch.save file is whole when its zip's end-of-central-directory record is there (written last)."""
    for name in sorted(names):
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            return f"{name}: cannot open ({exc.strerror or exc})"
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, min(size, _EOCD_SPAN), max(0, size - _EOCD_SPAN))
        finally:
            os.close(fd)
        if _EOCD not in tail:
            return f"{name}: no zip end record (a torch.save cut short, still being written, or the legacy format)"
    return ""


def settled(found: Found, previous: dict[str, str], now_ns: int, settle_s: float = SETTLE_S) -> bool:
    """Complete, and done being written: unchanged since the previous scan (``previous``: source ->
    signature), or untouched for ``settle_s``."""
    if not found.complete:
        return False
    return previous.get(found.source) == found.signature or now_ns - found.newest_ns >= settle_s * 1e9


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
        raise CheckpointInvalid(f"{found.describe()}: not adoptable")
    final = step_dir(root, found.step)
    if final.is_dir() and not final.is_symlink():
        try:
            manifest = read_manifest(final)
        except CheckpointInvalid:
            manifest = {}
        if manifest.get("source_signature") == found.signature:
            return final
        raise CheckpointInvalid(f"{found.source}: step {found.step} already has a checkpoint, {final}")
    staging = prepare_staging(root, found.step)
    folder = found.path if found.kind in ("hf", "dcp") else found.path.parent
    link = found.step_named  # a name written once; ``last.ckpt`` is rewritten in place: a copy
    for rel, size, mtime in found.files:
        _bring(folder / rel, staging / rel, size, mtime, link)
    world = shape.world_size
    if found.kind == "dcp":
        ranks = [int(m.group(1)) for rel, _, _ in found.files if (m := re.match(r"__(\d+)_\d+\.distcp\Z", rel))]
        world = max(world, max(ranks, default=-1) + 1)
    write_manifest(
        staging,
        step=found.step,
        world_size=world,
        global_batch=shape.global_batch,
        micro_batch=shape.micro_batch,
        metrics={**found.metrics, **(metrics or {})},
        run_id=shape.run_id,
        extra={"framework": found.kind, "source": found.source, "source_signature": found.signature},
    )
    return commit(staging, root, found.step)


def _bring(src: Path, dst: Path, size: int, mtime_ns: int, link: bool) -> None:
    """Link (or copy) the regular file ``src`` to ``dst``: the file opened without following links is the one
    linked, and it must still be the size and age the scan saw."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise CheckpointInvalid(f"{src}: cannot open ({exc.strerror or exc}); a link or gone") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != size or st.st_mtime_ns != mtime_ns:
            raise CheckpointInvalid(f"{src}: changed since it was scanned (not a regular file, or written again)")
        if link and _link(fd, src, dst):
            return
        with open(dst, "wb") as out, os.fdopen(os.dup(fd), "rb") as data:
            copied = _copy(data, out, size)
        if copied != size:
            raise CheckpointInvalid(f"{src}: {copied} bytes read, {size} expected (written meanwhile)")
    finally:
        os.close(fd)


def _link(fd: int, src: Path, dst: Path) -> bool:
    """Hard-link ``src`` to ``dst`` if it is still the file open as ``fd`` (same device and inode: a file
    swapped in meanwhile, or a link, is never what gets linked); False where linking cannot be done
    (another file system) or the name now leads elsewhere."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            return False
        raise
    opened, linked = os.fstat(fd), os.lstat(dst)
    if (opened.st_dev, opened.st_ino) == (linked.st_dev, linked.st_ino):
        return True
    dst.unlink()
    return False


def _copy(data: Any, out: Any, size: int) -> int:
    copied = 0
    while copied <= size:
        chunk = data.read(min(1 << 24, size - copied + 1))
        if not chunk:
            break
        out.write(chunk)
        copied += len(chunk)
    out.flush()
    os.fsync(out.fileno())
    return copied


def framework(ckpt_dir: Path) -> str | None:
    """The framework an adopted checkpoint came from (None: trainyard's own, or not readable)."""
    try:
        kind = read_manifest(ckpt_dir).get("framework")
    except CheckpointInvalid:
        return None
    return kind if kind in FRAMEWORKS else None


def resume_file(step_dir: Path, kind: str | None = None) -> Path:
    """What a framework loads to resume from the adopted checkpoint ``step_dir`` (``TRAINYARD_RESUME_FROM``):
    the folder itself for hf, dcp and trainyard's own; the one ``.ckpt``/``.pt``/``.pth`` inside it for
    lightning and torch. ``kind`` defaults to the manifest's ``framework``. Torch-free: workers call it."""
    step_dir = Path(step_dir)
    kind = kind if kind is not None else framework(step_dir)
    if kind not in ("lightning", "torch"):
        return step_dir
    suffixes = (".ckpt",) if kind == "lightning" else (".pt", ".pth")
    files = sorted(p for p in step_dir.iterdir() if p.suffix in suffixes and p.is_file() and not p.is_symlink())
    if len(files) != 1:
        raise CheckpointInvalid(
            f"{step_dir}: expected one {'/'.join(suffixes)} file of a {kind} save, found {len(files)}"
        )
    return files[0]


FORMATS_HELP = (
    "trainyard understands: its own saves (trainyard.runtime's checkpointer: step_NNNNNN/ with manifest.json);"
    " Hugging Face Trainer checkpoint-N/ folders (trainer_state.json + *.safetensors or pytorch_model*.bin);"
    " Lightning ModelCheckpoint *.ckpt files; torch.save *.pt/*.pth files (zip format, tensors in plain"
    " dicts and lists: loadable with torch.load(weights_only=True)); torch.distributed.checkpoint step-N/"
    " folders (.metadata, as torchtitan writes them). Save them under TRAINYARD_CHECKPOINT_DIR (or a folder"
    f" of it, up to {MAX_DEPTH} deep), with the step in the name (step=120, _000120, checkpoint-120)."
)


def explain(root: Path) -> list[str]:
    """One line per foreign save under ``root``: what it is and, if it was not taken, why (for the gate)."""
    return [f.describe() for f in scan(root)]


__all__ = [
    "FORMATS_HELP",
    "FRAMEWORKS",
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
