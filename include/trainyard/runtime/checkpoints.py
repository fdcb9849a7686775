"""Checkpoints as every rank saves and resumes them: the blocking save, the background ``Checkpointer``, resume.

All ranks write their DCP shards, hashing them as they write (``runtime.dcpwriter``); rank 0
assembles the manifest from the digests DCP gathered, reading nothing back, renames the folder
into place (``trainyard.checkpoint.format``) and broadcasts its outcome (``process.on_rank0``),
so ranks never disagree or deadlock on an error. Every call here is collective.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from trainyard.checkpoint import format as ckpt_format
from trainyard.errors import CheckpointInvalid
from trainyard.runtime import snapshots
from trainyard.runtime.dcpwriter import HashingWriter
from trainyard.runtime.process import RunContext, context, ledger_event, on_rank0, rank, world_size
from trainyard.runtime.progress import flush_progress, write_heartbeat
from trainyard.runtime.state import stateful

log = logging.getLogger("trainyard.workload")


def save_checkpoint(
    step: int,
    state_dict: dict[str, Any],
    metrics: dict[str, Any],
    *,
    micro_batch: int | None = None,
    ctx: RunContext | None = None,
) -> Path:
    """Collectively save ``state_dict`` as the checkpoint of ``step``; every rank must call it.

    All ranks write their DCP shards into ``step_NNNNNN.tmp``, hashing them as they write; once DCP
    has gathered every rank's results, rank 0 writes the manifest from their digests and renames the
    directory into place (moving an older save of the same step to ``superseded/``). ``micro_batch``
    is the effective micro-batch recorded in the manifest (default: the
    context's, else global / world). ``Checkpointer`` does the same in the
    background.
    """
    ctx = ctx or context()
    started = time.monotonic()
    flush_progress(ctx)  # the steps up to a checkpoint are in the ledger before it is
    write_heartbeat(ctx, step, metrics, "saving")  # a long save must not look like a hang
    staging = on_rank0(lambda: ckpt_format.prepare_staging(ctx.checkpoint_dir, step))
    writer = HashingWriter(staging)
    # On rank 0 this returns once every rank's files are written (DCP gathers their results and digests).
    dcp.save(stateful(state_dict), checkpoint_id=staging, storage_writer=writer)
    return on_rank0(lambda: _committer(ctx, staging, step, metrics, micro_batch, started)(hashed=writer.digests))


def _committer(
    ctx: RunContext, staging: Path, step: int, metrics: dict[str, Any], micro_batch: int | None, started: float
) -> Callable[..., Path]:
    """Rank 0's last act of a save, once every rank's files are written: manifest, rename, ledger event."""
    micro = micro_batch or ctx.micro_batch or ctx.global_batch // world_size()
    world = world_size()

    def commit(blocked_s: float | None = None, hashed: Mapping[str, tuple[int, str]] | None = None) -> Path:
        ckpt_format.write_manifest(
            staging, step=step, world_size=world, global_batch=ctx.global_batch,
            micro_batch=micro, metrics=metrics, run_id=ctx.run_id, hashed=hashed,
        )  # fmt: skip
        final = ckpt_format.commit(staging, ctx.checkpoint_dir, step)
        seconds = round(time.monotonic() - started, 3)
        # blocked_s: how long training waited for this save; seconds: until it was valid on disk.
        blocked = seconds if blocked_s is None else round(blocked_s, 3)
        ledger_event(ctx, "checkpoint_saved", step=step, path=str(final), seconds=seconds, blocked_s=blocked)
        log.info("saved checkpoint %s in %.2fs (training blocked %.2fs)", final, seconds, blocked)
        return final

    return commit


class Checkpointer:
    """A run's checkpoint saves, written in the background when ``ctx.checkpoint_async``.

    Every rank calls ``save`` at the same steps and ``close`` before it
    finishes. In the background mode, ``save`` copies the state to memory
    (training may change it as soon as the call returns), a thread writes the
    rank's DCP files over a process group of its own (a collective of the
    save must not interleave with the training's gradient all-reduce on the
    default group), and rank 0 commits the manifest once DCP reports every
    rank's files written. One save is in flight at a time. Until it commits,
    a save is a ``.tmp`` directory, which does not exist for resumption: a
    fault mid-save loses that save and nothing else.

    The thread is a daemon: after a fault, a save waiting on a dead peer
    must not keep the process alive (``close(wait=False)`` leaves it).
    ``on_commit(path)`` runs on rank 0 right after each commit (the
    ``corrupt_checkpoint`` drill strikes there).
    """

    def __init__(self, ctx: RunContext | None = None, on_commit: Callable[[Path], None] | None = None):
        self.ctx = ctx or context()
        self.on_commit = on_commit or (lambda path: None)
        self._group: Any = None
        self._stager: DefaultStager | None = None
        self._pending: Future | None = None
        self._thread: threading.Thread | None = None

    @property
    def group(self) -> Any:
        """The background saves' own process group (None until the first): a thread may still use it."""
        return self._group

    def prepare(self) -> None:
        """Make the background saves' process group now, while every rank of the world is known to be here
        (an elastic group calls this as each generation begins; ``save`` does it at the first save otherwise).

        Making a group is no collective that fails when a peer dies: each rank waits on the store for every
        other's address. A peer killed after its generation formed but before the first save would hold the
        survivors there until the group's timeout (in CI, past a 30 s heartbeat timeout: the supervisor took them
        for hung and relaunched the attempt) instead of failing their next collective at once, to regroup in place."""
        if not self.ctx.checkpoint_async or self._group is not None or not dist.is_initialized():
            return
        timeout = self.ctx.collective_timeout_s
        self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout) if timeout else None)

    def save(self, step: int, state_dict: dict[str, Any], metrics: dict[str, Any], *,
             micro_batch: int | None = None) -> None:  # fmt: skip
        """Save ``state_dict`` as the checkpoint of ``step`` (collective)."""
        if not self.ctx.checkpoint_async:
            final = save_checkpoint(step, state_dict, metrics, micro_batch=micro_batch, ctx=self.ctx)
            if rank() == 0:
                self.on_commit(final)
            return
        started = time.monotonic()
        flush_progress(self.ctx)  # the steps up to a checkpoint are in the ledger before it is
        self.wait()  # also frees the staging buffers, which the stager reuses
        if self._stager is None:
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=False,
                    use_shared_memory=False,
                    use_async_staging=False,
                    use_non_blocking_copy=False,
                )
            )
        self.prepare()
        staging = on_rank0(lambda: ckpt_format.prepare_staging(self.ctx.checkpoint_dir, step))
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in stateful(state_dict).items()}
        copy = self._stager.stage(plain)
        commit = _committer(self.ctx, staging, step, metrics, micro_batch, started)
        blocked_s = time.monotonic() - started
        pending: Future = Future()
        group = self._group  # this save's, even once ``abandon`` has forgotten it

        def write() -> None:
            try:
                # On rank 0 this returns once every rank's files are written (DCP gathers their results).
                writer = HashingWriter(staging)
                dcp.save(copy, checkpoint_id=staging, storage_writer=writer, process_group=group)
                if rank() == 0:
                    self.on_commit(commit(blocked_s, hashed=writer.digests))
                pending.set_result(None)
            except BaseException as exc:
                pending.set_exception(exc)

        self._thread = threading.Thread(target=write, name=f"trainyard-checkpoint-{step}", daemon=True)
        self._thread.start()
        self._pending = pending

    def wait(self) -> None:
        """Block until the save in flight, if any, is committed; re-raise its error here."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self, wait: bool = True) -> None:
        """Wait for the save in flight (``wait=False``: leave it, after a fault), then free the buffers."""
        if wait:
            self.wait()
            # A generation that ends well may destroy every group next (a world that grows leaves its group):
            # the next one's ``prepare`` makes the saves' group of its own world, with every member. (After a
            # fault, ``abandon`` hands the group to the graveyard instead.)
            self._group = None
        elif self._pending is not None:
            return  # its thread still reads the staging buffers
        if self._stager is not None:
            self._stager.close()
            self._stager = None

    def abandon(self) -> Any:
        """Forget the save in flight, its buffers and its group after a fault; the next save starts afresh.

        The save's thread may be blocked on a dead peer: it keeps what it reads, and the caller keeps the
        returned group alive (destructing it would wait for that thread). An in-place regroup calls this.
        """
        group, self._group, self._pending = self._group, None, None
        self._stager = None  # plain tensors (no pinned or shared memory): the collector frees them
        if self._thread is not None and self._thread.is_alive():
            outlive(self._thread)
        return group


EXIT_WAIT_S = 10.0
"""How long a process's exit waits for the threads of abandoned saves (``outlive``), all together."""
_abandoned: list[threading.Thread] = []


def outlive(thread: threading.Thread) -> None:
    """Have this process's exit wait (up to ``EXIT_WAIT_S``) for ``thread``, a daemon blocked in a collective
    with a peer of a buried group, before the interpreter finalizes.

    The survivors of a regroup finish together, and a peer's exit closes the sockets the thread waits on: its
    collective fails and it returns to Python. During finalization that return ends the thread by forced
    unwinding through torch's C++ frames, which aborts the process (SIGABRT, "terminate called without an
    active exception") after a run that finished. Waiting at ``atexit`` (before finalization) lets it end as
    an ordinary failed save. The reference workload leaves by ``os._exit``; any script now may end normally.
    """
    if not _abandoned:
        atexit.register(_wait_for_abandoned)
    _abandoned.append(thread)


def _wait_for_abandoned() -> None:
    deadline = time.monotonic() + EXIT_WAIT_S
    for thread in _abandoned:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))


def resolve_resume(ctx: RunContext) -> tuple[Path, dict[str, Any]] | None:
    """Which checkpoint TRAINYARD_RESUME_FROM names, with its manifest; None for a fresh start."""
    mode = ctx.resume_from.strip()
    if mode.lower() in ("", "none"):
        return None
    if mode.lower() == "latest":

        def skipped(path: Path, problems: list[str]) -> None:
            log.warning("skipping invalid checkpoint %s: %s", path, "; ".join(problems))
            ledger_event(ctx, "checkpoint_skipped", path=str(path), problems=problems)

        found = ckpt_format.latest_valid(ctx.checkpoint_dir, on_invalid=skipped)
        if found is None:
            log.info("no valid checkpoint under %s; starting fresh", ctx.checkpoint_dir)
            return None
        return found, ckpt_format.read_manifest(found)
    path = Path(mode)
    problems = ckpt_format.verify(path)
    if problems:
        raise CheckpointInvalid(f"TRAINYARD_RESUME_FROM={mode}: " + "; ".join(problems))
    return path, ckpt_format.read_manifest(path)


def load_latest(state_dict: dict[str, Any], *, ctx: RunContext | None = None) -> int:
    """Resume per TRAINYARD_RESUME_FROM by loading into ``state_dict`` in place; return the step.

    Returns 0 for a fresh start. Every rank must call it. Rank 0 picks and
    verifies the checkpoint (hashing once, not once per rank) and broadcasts
    the choice, so all ranks load the same one. ``CheckpointInvalid`` if an
    explicitly named checkpoint fails verification.
    """
    ctx = ctx or context()
    chosen = on_rank0(lambda: resolve_resume(ctx))
    why = "resume_from names this checkpoint"
    if ctx.resume_from.strip().lower() == "latest":  # a relaunch of this run: a newer in-memory snapshot wins
        from_snapshot, why = snapshots.restore(ctx, stateful(state_dict), int(chosen[1]["step"]) if chosen else 0)
        if from_snapshot is not None:
            return from_snapshot
    if chosen is None:
        return 0
    path, manifest = chosen
    started = time.monotonic()
    dcp.load(stateful(state_dict), checkpoint_id=path)
    step = int(manifest["step"])
    if rank() == 0:
        log.info("resumed from %s at step %d (saved on %d ranks)", path, step, manifest["world_size"])
        ledger_event(
            ctx, "resumed", step=step, path=str(path), from_world_size=manifest["world_size"],
            from_global_batch=manifest["global_batch"], seconds=round(time.monotonic() - started, 3),
            source="checkpoint", why=why,
        )  # fmt: skip
    return step
