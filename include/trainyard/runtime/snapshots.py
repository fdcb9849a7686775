"""In-memory snapshots: the training state of recent steps in node-local shared memory, for a relaunch.

A checkpoint is written to shared storage every few hundred steps; a relaunch from it replays every step
since. A snapshot is the same state (model, optimizer, scheduler, RNG, the step; the data position follows
from the step or is the framework's own) kept at every step (``TRAINYARD_SNAPSHOT_EVERY``) in the node's
memory tier, ``TRAINYARD_SNAPSHOT_DIR/<node>/`` (``/dev/shm``: RAM, not the hot tier), so a relaunch of
the same run loses at most the step in flight.

Snapshots are not checkpoints: the gate, publishing and the lineage never see them; a relaunch uses one only
when it is newer than the checkpoint it would otherwise resume, only when it is whole, and only within its
run (the tier is the run's; the orchestrator drops it when the train stage ends).

A snapshot is a folder ``step_NNNNNN/`` of files and ``WHOLE``, written last, which lists each file with its
size: a folder without ``WHOLE``, with a file missing or of another size (torn: a process killed while
writing, memory lost) is never resumed from. Folders are written under a temporary name and renamed.

Replicated state (data parallel: every rank holds the whole model and optimizer) is kept once per node, by
its local rank 0, so every node holds a whole copy: a node lost with its memory is resumed from a peer's
copy. At a relaunch the ranks agree on the newest snapshot any of them holds (``fetch``); a rank whose node
lacks it receives its files from the lowest rank that has it and keeps them in its own tier.

A snapshot costs the step one memory copy: the state's tensors go straight into a memory-mapped file of the
tier (``write_tree``), nothing is serialised but the small layout around them, and nothing runs beside the
training thread afterwards (``Snapshotter``).
"""

from __future__ import annotations

import json
import logging
import math
import mmap
import os
import pickle
import shutil
import stat
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainyard.runtime.process import RunContext, ledger_event, rank, world_size

log = logging.getLogger("trainyard.workload")

WHOLE = "WHOLE"
"""The file written last into a snapshot's folder: its step, run and files with their sizes."""
KEEP = 2
"""Whole snapshots a node keeps: the newest, and the one before while the newest may still be read."""
_PREFIX = "step_"


def node_tier(ctx: RunContext) -> Path | None:
    """This node's folder in the run's snapshot tier; None where snapshots are off."""
    if ctx.snapshot_dir is None or ctx.snapshot_every <= 0:
        return None
    return Path(ctx.snapshot_dir) / (ctx.node or "node")


def due(ctx: RunContext, step: int) -> bool:
    """Whether ``step`` is one to snapshot (every ``snapshot_every`` steps; never past the last step)."""
    return node_tier(ctx) is not None and step % ctx.snapshot_every == 0 and step < ctx.max_steps


def local_writer() -> bool:
    """Whether this process keeps its node's copy (its local rank 0)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


# --- a tier's folders --------------------------------------------------------------------------------------


def folder(tier: Path, step: int) -> Path:
    return tier / f"{_PREFIX}{step:06d}"


def whole(path: Path, run_id: str | None = None) -> dict[str, Any] | None:
    """The ``WHOLE`` record of the snapshot folder ``path`` when every file it lists is there at its size (and
    it belongs to ``run_id``, where given); None for a torn or foreign one."""
    try:
        record = json.loads((path / WHOLE).read_text())
        files = record["files"]
        if not isinstance(files, dict) or not isinstance(record["step"], int):
            return None
        if run_id is not None and record.get("run_id") != run_id:
            return None
        for name, size in files.items():
            if "/" in name or name in ("", ".", ".."):
                return None
            seen = (path / name).lstat()  # never a link: only a regular file of the listed size
            if not stat.S_ISREG(seen.st_mode) or seen.st_size != size:
                return None
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None
    return record


def whole_steps(tier: Path, run_id: str | None = None) -> list[int]:
    """The steps of the whole snapshots in ``tier``, newest first."""
    steps = []
    try:
        names = os.listdir(tier)
    except OSError:
        return []
    for name in names:
        if name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
            record = whole(tier / name, run_id)
            if record is not None and record["step"] == int(name[len(_PREFIX) :]):
                steps.append(record["step"])
    return sorted(steps, reverse=True)


def commit(
    tier: Path, step: int, fill: Callable[[Path], None], run_id: str, kind: str, replace: bool = True,
    recycle: bool = False,
) -> Path:  # fmt: skip
    """Write the snapshot of ``step``: ``fill`` writes its files into a fresh folder, then ``WHOLE`` lists them
    and the folder is renamed into place; older snapshots beyond ``KEEP`` go. Its final path. ``replace``: an
    existing snapshot of the step (a step trained again after a relaunch) is replaced; else ``OSError``.
    ``recycle``: ``fill`` is written over the files of the oldest snapshot, the one this commit makes surplus
    (its memory is already the process's: no page is allocated, zeroed or freed again at every step)."""
    tier.mkdir(parents=True, exist_ok=True)
    staging = tier / f".{_PREFIX}{step:06d}.{os.getpid()}.{threading.get_ident()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    held = whole_steps(tier, run_id) if recycle else []
    if len(held) >= KEEP and held[-1] != step:
        oldest = folder(tier, held[-1])
        os.unlink(oldest / WHOLE)  # torn from now on, under any name: never resumed from while it is rewritten
        os.rename(oldest, staging)
        for entry in os.scandir(staging):  # what a resume wrote beside it (a framework's own files)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path, ignore_errors=True)
    else:
        staging.mkdir()
    try:
        fill(staging)
        files = {p.name: p.stat().st_size for p in sorted(staging.iterdir()) if p.is_file()}
        record = {"step": step, "run_id": run_id, "kind": kind, "files": files, "ts": time.time()}
        (staging / WHOLE).write_text(json.dumps(record))
        final = folder(tier, step)
        if replace and final.exists():  # this step's snapshot again (a replay after a relaunch): the new one wins
            shutil.rmtree(final, ignore_errors=True)
        os.rename(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    prune(tier, run_id)
    return final


def prune(tier: Path, run_id: str) -> None:
    """Keep the ``KEEP`` newest whole snapshots; drop older ones, torn ones older than the newest, and leftovers."""
    keep = whole_steps(tier, run_id)[:KEEP]
    newest = keep[0] if keep else None
    for entry in os.scandir(tier):
        name = entry.name
        if name.startswith(f".{_PREFIX}") and name.endswith(".tmp"):
            stale = newest is not None and _step_of(name[1:]) < newest
            if stale:
                shutil.rmtree(entry.path, ignore_errors=True)
        elif name.startswith(_PREFIX) and name[len(_PREFIX) :].isdigit():
            step = int(name[len(_PREFIX) :])
            if step not in keep and (newest is None or step < newest):
                shutil.rmtree(entry.path, ignore_errors=True)


def _step_of(name: str) -> int:
    digits = name[len(_PREFIX) :].split(".", 1)[0]
    return int(digits) if digits.isdigit() else -1


# --- at a relaunch: the newest snapshot any rank holds ------------------------------------------------------


def fetch(ctx: RunContext, newer_than: int) -> Fetched | None:
    """Collectively: the newest whole snapshot of this run that some rank holds, if newer than step
    ``newer_than`` (the checkpoint a resume would otherwise load): this rank's path to it, its step and the
    ranks that received it from a peer.

    Every rank of the default group must call it (one process without a group: its own tier). A rank whose
    node lacks the chosen snapshot receives its files from the lowest rank that holds it and keeps them in
    its node's tier."""
    tier = node_tier(ctx)
    held = whole_steps(tier, ctx.run_id)[:1] if tier is not None else []
    mine = held[0] if held else -1
    steps = [mine]
    if dist.is_initialized() and world_size() > 1:
        gathered: list[Any] = [None] * world_size()
        dist.all_gather_object(gathered, mine)
        steps = [int(s) for s in gathered]
    best = max(steps)
    if best <= newer_than or best < 0:
        return None
    source = steps.index(best)
    lacking = [r for r, s in enumerate(steps) if s != best]
    if lacking:
        box: list[Any] = [_files(folder(tier, best)) if rank() == source and tier is not None else None]
        dist.broadcast_object_list(box, src=source)
        if mine != best:
            if tier is None:
                return None  # pragma: no cover - every rank of a run has the same settings
            return Fetched(_keep(tier, best, box[0], ctx.run_id), best, lacking, box[0][0])
    assert tier is not None
    record = whole(folder(tier, best), ctx.run_id) or {}
    return Fetched(folder(tier, best), best, lacking, record.get("kind", ""))


@dataclass(frozen=True)
class Fetched:
    path: Path
    """This rank's whole copy of the chosen snapshot, in its node's tier."""
    step: int
    copied_to: list[int]
    """The ranks whose node lacked it and received it from a peer."""
    kind: str
    """Who wrote it: ``runtime`` (``restore`` loads it), ``hf``, ``lightning`` (their adapters)."""


def _files(path: Path) -> tuple[str, dict[str, bytes]]:
    """A whole snapshot as it travels to a peer: its kind and its files' bytes."""
    record = whole(path)
    assert record is not None
    return record.get("kind", ""), {name: (path / name).read_bytes() for name in record["files"]}


def _keep(tier: Path, step: int, sent: tuple[str, Mapping[str, bytes]], run_id: str) -> Path:
    """A peer's copy of a snapshot, kept in this node's tier; another local rank may have kept it first (then
    that one is used: it may be being read already)."""
    kind, files = sent

    def fill(staging: Path) -> None:
        for name, data in files.items():
            (staging / Path(name).name).write_bytes(data)

    try:
        return commit(tier, step, fill, run_id, kind, replace=False)
    except OSError:
        if whole(folder(tier, step), run_id) is not None:
            return folder(tier, step)
        raise


# --- the reference runtime: a snapshot per step of the ``Stateful`` state ---------------------------------


TENSORS_FILE = "tensors.bin"
"""A snapshot's tensors, back to back (each at a 64-byte boundary), as raw bytes."""
LAYOUT_FILE = "layout.pkl"
"""The rest of a snapshot's state (its shape and plain values) and where each tensor's bytes are."""
_ALIGN = 64


@dataclass(frozen=True)
class _Tensor:
    """A tensor's place in ``TENSORS_FILE``."""

    index: int


_TENSOR, _MAP, _NAMED, _SEQ, _LEAF = range(5)
_KINDS: dict[type, int] = {}


def _kind(of: type) -> int:
    """What a value of type ``of`` is to a walk of a state tree, looked up once per type: ``isinstance`` against
    ``torch.Tensor`` and ``Mapping`` goes through metaclass checks that cost ~20 us a value, and a state dict has
    thousands of values (a snapshot of the reference workload's spent 9 ms a step in them)."""
    kind = _KINDS.get(of)
    if kind is None:
        if issubclass(of, torch.Tensor):
            kind = _TENSOR
        elif issubclass(of, Mapping):
            kind = _MAP
        elif issubclass(of, tuple) and hasattr(of, "_fields"):  # a named tuple takes its fields by position
            kind = _NAMED
        elif issubclass(of, list | tuple):
            kind = _SEQ
        else:
            kind = _LEAF
        _KINDS[of] = kind
    return kind


def _hollow(tree: Any, tensors: list[torch.Tensor], seen: dict[tuple[Any, ...], int]) -> Any:
    """``tree`` with each tensor replaced by its index in ``tensors`` (appended); tensors that share memory (tied
    weights) are kept once and stay shared."""
    kind = _kind(type(tree))
    if kind == _TENSOR:
        key = (tree.device, tree.untyped_storage().data_ptr(), tree.storage_offset(), tree.shape, tree.stride(),
               tree.dtype)  # fmt: skip
        if key not in seen or key[1] == 0:
            seen[key] = len(tensors)
            tensors.append(tree)
        return _Tensor(seen[key])
    if kind == _MAP:
        return {k: _hollow(v, tensors, seen) for k, v in tree.items()}
    if kind == _NAMED:
        return type(tree)(*(_hollow(v, tensors, seen) for v in tree))
    if kind == _SEQ:
        return type(tree)(_hollow(v, tensors, seen) for v in tree)
    return tree


def _fill(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, _Tensor):
        return tensors[tree.index]
    kind = _kind(type(tree))
    if kind == _MAP:
        return {k: _fill(v, tensors) for k, v in tree.items()}
    if kind == _NAMED:
        return type(tree)(*(_fill(v, tensors) for v in tree))
    if kind == _SEQ:
        return type(tree)(_fill(v, tensors) for v in tree)
    return tree


class Maps:
    """The memory maps of the tier's files that this process writes, kept open from one snapshot to the next,
    with the views of each tensor's place in them.

    A snapshot recycles the oldest one's ``tensors.bin`` (same file, same size, same layout): mapping it again at
    every step faults its every page in again, which cost more than the copy itself (38 MB of a 3.2 M-parameter
    model's state with Adam: 28 ms mapped lazily, 13 ms with ``MAP_POPULATE``, 6.7 ms into a map kept open), and
    a view per tensor per step is Python's time, not the copy's. A map is found by the file's identity (device,
    inode, size) through a descriptor opened without following links, so only the file being rewritten is
    written; at most ``KEEP + 1`` stay open (a dropped file's pages are freed when its map closes)."""

    def __init__(self) -> None:
        self.open: dict[tuple[int, int, int], tuple[mmap.mmap, dict[tuple[Any, ...], list[torch.Tensor]]]] = {}

    def views(self, fd: int, size: int, places: list[tuple[int, str, tuple[int, ...]]]) -> list[torch.Tensor]:
        """A tensor over ``fd``'s map at each place (offset, dtype, shape) of ``places``."""
        info = os.fstat(fd)
        key = (info.st_dev, info.st_ino, size)
        entry = self.open.pop(key, None)
        if entry is None:
            if info.st_size != size:
                os.ftruncate(fd, size)
                # Its pages now, or ENOSPC here: a page of a full tmpfs first touched through a map is a SIGBUS.
                os.posix_fallocate(fd, 0, size)
            entry = (mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), {})
        self.open[key] = entry  # the newest last
        while len(self.open) > KEEP + 1:
            self._close(self.open.pop(next(iter(self.open))))
        mapped, cached = entry
        layout = tuple(places)
        if layout not in cached:
            cached.clear()  # another layout in the same file: the state's shapes changed
            flat = torch.frombuffer(mapped, dtype=torch.uint8)
            cached[layout] = [
                flat[offset : offset + _nbytes(dtype, shape)].view(getattr(torch, dtype)).view(shape)
                for offset, dtype, shape in places
            ]
        return cached[layout]

    def close(self) -> None:
        while self.open:
            self._close(self.open.popitem()[1])

    @staticmethod
    def _close(entry: tuple[mmap.mmap, dict[tuple[Any, ...], list[torch.Tensor]]]) -> None:
        mapped, cached = entry
        cached.clear()  # the map cannot close while a tensor holds it
        mapped.close()


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of ``dtype`` (a layout's name, ``float32``) and ``shape``."""
    return math.prod(shape) * torch.empty((), dtype=getattr(torch, dtype)).element_size()


def write_tree(folder: Path, tree: Any, maps: Maps | None = None) -> None:
    """Copy ``tree`` (nested dicts, lists and tuples of tensors and plain values: state dicts) into ``folder``:
    every tensor's bytes straight into one memory-mapped file of the tier (one copy, from the CPU or a GPU, no
    serialisation of the bytes), the rest into a small layout. ``maps``: the writer's maps kept open (``Maps``);
    None maps the file for this write only."""
    tensors: list[torch.Tensor] = []
    skeleton = _hollow(tree, tensors, {})
    places, size = [], 0
    for t in tensors:
        places.append((size, str(t.dtype).removeprefix("torch."), tuple(t.shape)))
        size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    fd = os.open(folder / TENSORS_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    own = maps is None
    writer = Maps() if maps is None else maps
    try:
        if size:
            pairs = [(v, t.detach()) for v, t in zip(writer.views(fd, size, places), tensors, strict=True) if t.numel()]
            if pairs:
                into, sources = (list(x) for x in zip(*pairs, strict=True))
                try:
                    torch._foreach_copy_(into, sources)  # one call for every tensor, not a Python loop
                except (RuntimeError, TypeError):  # sources on several devices, or dtypes it will not pair
                    for v, t in pairs:
                        v.copy_(t)
        else:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)
        if own:
            writer.close()
    with open(folder / LAYOUT_FILE, "wb") as out:
        pickle.dump({"tree": skeleton, "tensors": places}, out, protocol=pickle.HIGHEST_PROTOCOL)


def read_tree(folder: Path) -> Any:
    """What ``write_tree`` wrote, its tensors on the CPU.

    The layout is unpickled: a snapshot is this run's own state, written by its own ranks into their nodes'
    memory and read back only by the run's training processes (the orchestrator never reads a tier), so no
    trust boundary is crossed; a snapshot of another run is never read (``whole``)."""
    with open(folder / LAYOUT_FILE, "rb") as f:
        layout = pickle.load(f)
    places = layout["tensors"]
    size = (folder / TENSORS_FILE).stat().st_size
    flat = torch.from_file(str(folder / TENSORS_FILE), shared=False, size=size, dtype=torch.uint8) if size else None
    tensors = []
    for offset, dtype, shape in places:
        kind = getattr(torch, dtype)
        nbytes = _nbytes(dtype, shape)
        if flat is None or nbytes == 0:
            tensors.append(torch.empty(shape, dtype=kind))
        else:
            # A tensor of its own, not a view of the file's: one that is saved again (a framework's own files)
            # must not drag the whole file along, and torch.set_rng_state reads a view's storage from its start.
            tensors.append(flat[offset : offset + nbytes].view(kind).view(shape).clone())
    return _fill(layout["tree"], tensors)


class Snapshotter:
    """Takes the snapshot of a due step, on the training thread: the state's tensors are copied straight into the
    node's memory tier (``write_tree``: one memory copy, the step's only stall), then the folder is committed.

    No background writer: one that serialises (``torch.save``) holds the interpreter's lock and, on a machine
    whose cores all train, costs the step far more than the copy (a writer thread measured 38-48% of the
    reference workload's step, and 80% of the adapters' tiny models').

    ``take`` is for ``Stateful`` values (written as ``{name: value.state_dict()}``, loaded back by ``restore``);
    ``keep`` for any state, e.g. a framework adapter's (``runtime.hf``, ``runtime.lightning``). Both return the
    seconds the step was held up.
    """

    def __init__(self, ctx: RunContext, kind: str = "runtime"):
        self.ctx = ctx
        self.kind = kind
        self.tier = node_tier(ctx)
        self.failed: str | None = None
        self.maps = Maps()

    def take(self, step: int, state: Mapping[str, Any]) -> float:
        return self.keep(step, lambda: {"step": step, "state": {k: v.state_dict() for k, v in state.items()}})

    def keep(self, step: int, state: Callable[[], Any]) -> float:
        """Where ``step`` is due and this process keeps its node's copy: ``state()``'s tree, copied into the tier."""
        if not due(self.ctx, step) or not local_writer() or self.tier is None or self.failed:
            return 0.0
        began = time.perf_counter()
        try:
            tree = state()
            commit(self.tier, step, lambda staging: write_tree(staging, tree, self.maps), self.ctx.run_id, self.kind,
                   recycle=True)  # fmt: skip
        except Exception as exc:  # a full tier must not stop training: the checkpoints still hold
            self.failed = f"{type(exc).__name__}: {exc}"
            self.maps.close()
            log.warning("snapshots off for this process: the snapshot of step %d to %s failed: %s", step, self.tier,
                        self.failed)  # fmt: skip
        return time.perf_counter() - began


def chosen(ctx: RunContext, checkpoint_step: int, kind: str) -> tuple[Fetched | None, str]:
    """Collectively (``fetch``): the newest whole snapshot newer than ``checkpoint_step`` if it is ``kind``'s, else
    None; and why not, in words. A snapshot of another kind (the run's script changed its framework between
    attempts) is never loaded."""
    if node_tier(ctx) is None:
        return None, "in-memory snapshots are off"
    found = fetch(ctx, checkpoint_step)
    if found is None:
        return None, "no whole in-memory snapshot is newer"
    if found.kind != kind:
        log.warning("the in-memory snapshot %s is %r's, not %r's: resuming from the checkpoint", found.path,
                    found.kind, kind)  # fmt: skip
        return None, f"the snapshot of step {found.step} is {found.kind!r}'s, not {kind!r}'s"
    return found, ""


def restore(ctx: RunContext, state: Mapping[str, Any], checkpoint_step: int) -> tuple[int | None, str]:
    """Collectively load the newest snapshot newer than ``checkpoint_step`` into ``state``: its step, or None
    where the caller's checkpoint stands; and why, in words (the ``resumed`` event's ``why``)."""
    found, why = chosen(ctx, checkpoint_step, "runtime")
    if found is None:
        return None, why
    path, step = found.path, found.step
    started = time.monotonic()
    saved = read_tree(path)
    for name, value in state.items():
        value.load_state_dict(saved["state"][name])
    return step, resumed(ctx, found, checkpoint_step, started)


def resumed(ctx: RunContext, found: Fetched, checkpoint_step: int, started: float) -> str:
    """Say that this process resumed from ``found`` (its log line and rank 0's ``resumed`` event, ``started``:
    when its state began to load), for the runtime and the framework adapters alike; why, in words."""
    why = f"the snapshot of step {found.step} is newer than " + (
        f"the checkpoint of step {checkpoint_step}" if checkpoint_step > 0 else "any checkpoint"
    )
    if rank() == 0:
        log.info("resumed from the in-memory snapshot of step %d (%s)", found.step, why)
    ledger_event(
        ctx, "resumed", step=found.step, path=str(found.path), source="snapshot", why=why,
        copied_to_ranks=found.copied_to, seconds=round(time.monotonic() - started, 3),
    )  # fmt: skip
    return why
