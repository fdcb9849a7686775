"""The runtime's calls (the face is ``trainyard.runtime``): context, heartbeats, failure records, checkpoints, resume."""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.checkpoint.stateful import Stateful

from trainyard.checkpoint import format as ckpt_format
from trainyard.errors import CheckpointInvalid
from trainyard.events.ledger import EventWriter
from trainyard.protocol import records
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.heartbeat import write_beat
from trainyard.protocol.steps import ProgressDigest

log = logging.getLogger("trainyard.workload")
T = TypeVar("T")
STAGE = "train"


RunContext = TrainEnv
"""The TRAINYARD_* environment of one training process, parsed and checked (``trainyard.protocol.env``)."""


def context(env: Mapping[str, str] | None = None) -> RunContext:
    """Parse the TRAINYARD_* environment; ``ValueError`` names the variable that is missing or malformed.

    An unset node or host is this machine's name. The first context with a
    heartbeat folder also makes an uncaught exception leave a failure record,
    and what the process creates from then on is writable by its group.
    """
    ctx = TrainEnv.from_env(os.environ if env is None else env)
    here = socket.gethostname()
    ctx = replace(ctx, node=ctx.node or here, host=ctx.host or here)
    if env is None:
        _record_uncaught(ctx)
        share_with_group()
    return ctx


def share_with_group() -> None:
    """Let the group write what this process creates (the umask keeps its bits for others).

    On Kubernetes the trainer (uid 1000) and the orchestrator (uid 50000) share the hot tier
    through group 0 (``fsGroup``, setgid folders): the orchestrator sets checkpoints aside and
    tidies them, which needs write on the folders a rank made.
    """
    os.umask(os.umask(0) & ~0o070)


# --- process-group helpers: the contract also works in a plain single process ---


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on rank 0 only and give every rank its result (or re-raise its error everywhere).

    Without this, an exception on rank 0 would leave the other ranks waiting
    in the next collective until the timeout, and the failure would look like
    a hang instead of what it is.
    """
    outcome: list[Any] = [None]
    if rank() == 0:
        try:
            outcome[0] = ("ok", fn())
        except Exception as exc:
            outcome[0] = ("error", exc if _picklable(exc) else RuntimeError(f"rank 0 failed: {exc!r}"))
    if dist.is_initialized():
        dist.broadcast_object_list(outcome, src=0)
    status, value = outcome[0]
    if status == "error":
        raise value
    return value


def _picklable(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


# Fields every train event carries; a metric with one of these names must not clobber them.
_RESERVED = {"stage", "event", "ts", "run_id", "attempt", "node", "world_size", "step", "first_step", "steps"}


def _ledger_event(ctx: RunContext, event: str, **fields: Any) -> None:
    """Append a ``train`` event to rank 0's own file in the run's events folder (no folder configured: no-op)."""
    if ctx.events_dir is not None and rank() == 0:
        fixed = {"run_id": ctx.run_id, "attempt": ctx.attempt, "node": ctx.node, "world_size": world_size()}
        EventWriter.in_dir(ctx.events_dir, ctx.writer_name(0)).append(STAGE, event, **{**fields, **fixed})


def _metric_fields(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k not in _RESERVED}  # a copy: the caller may reuse its dict


# --- heartbeats ---


LIVENESS_S = 1.0
_pulse: threading.Thread | None = None
_pulse_path: Path | None = None
"""This rank's ``rank-N.alive``: set by every heartbeat, since an in-place regroup renumbers the ranks."""


def _keep_alive() -> None:
    """Touch ``_pulse_path`` every second from a daemon thread, whatever the training loop is doing.

    A rank blocked in a collective still pulses (gloo waits without the GIL);
    a stopped or frozen process does not. The supervisor tells the node that
    hung from the ones merely waiting for it by this pulse.
    """
    while True:
        if _pulse_path is not None:
            _pulse_path.touch()
        time.sleep(LIVENESS_S)


def _write_heartbeat(ctx: RunContext, step: int, metrics: dict[str, Any], status: str) -> None:
    global _pulse, _pulse_path
    if ctx.heartbeat_dir is None:
        return
    ctx.heartbeat_dir.mkdir(parents=True, exist_ok=True)
    me = rank()
    _pulse_path = ctx.heartbeat_dir / f"rank-{me}.alive"
    if _pulse is None:
        _pulse_path.touch()
        _pulse = threading.Thread(target=_keep_alive, daemon=True)
        _pulse.start()
    record = {
        "rank": me, "node": ctx.node, "host": ctx.host, "pid": os.getpid(), "step": step, "time": time.time(),
        "status": status, "metrics": metrics, "attempt": ctx.attempt, "run_id": ctx.run_id,
    }  # fmt: skip
    write_beat(ctx.heartbeat_dir, me, record)


# Rank 0's steps not yet in the ledger: one digest per process (and context), flushed at exit too,
# so the steps before a crash in user code are not lost (a killed process loses them; the
# supervisor's ``attempt_end`` records the last step from the heartbeats).
_progress: tuple[RunContext, ProgressDigest] | None = None
_clock: Callable[[], float] = time.monotonic  # a test's fake clock replaces it


def _flush_at_exit() -> None:
    if _progress is not None:
        flush_progress(_progress[0])


def _digest(ctx: RunContext) -> ProgressDigest:
    global _progress
    if _progress is None or (_progress[0] is not ctx and _progress[0] != ctx):
        if _progress is None:
            atexit.register(_flush_at_exit)
        else:
            flush_progress(_progress[0])
        _progress = (ctx, ProgressDigest(ctx.progress_every_s, _clock))
    return _progress[1]


def flush_progress(ctx: RunContext | None = None) -> None:
    """Write the ``step`` event of the steps not yet in the ledger (rank 0; a no-op elsewhere)."""
    ctx = ctx or context()
    if ctx.events_dir is not None and rank() == 0 and (record := _digest(ctx).flush()) is not None:
        _ledger_event(ctx, "step", **record)


def heartbeat(step: int, metrics: dict[str, Any], *, status: str = "running", ctx: RunContext | None = None) -> None:
    """Record progress: this rank's heartbeat file, plus (rank 0) the ledger's ``step`` events at a bounded rate."""
    ctx = ctx or context()
    _write_heartbeat(ctx, step, metrics, status)
    if status == "running" and ctx.events_dir is not None and rank() == 0:
        # A checkpoint step is written at once: the metric gate needs its exact loss.
        for record in _digest(ctx).add(step, _metric_fields(metrics), force=ctx.should_checkpoint(step)):
            _ledger_event(ctx, "step", **record)


def regrouped(
    generation: int, micro_batch: int, from_step: int, joiners: list[str], *, ctx: RunContext | None = None
) -> None:
    """A new generation formed in place: rank 0's ``regrouped`` event, and the next step's event at once.

    Call it on every rank once the generation's group is formed (ranks and world size are the new ones)."""
    ctx = ctx or context()
    _digest(ctx).write_next()
    _ledger_event(ctx, "regrouped", generation=generation, micro_batch=micro_batch, from_step=from_step,
                  joiners=list(joiners))  # fmt: skip


def finish(step: int, metrics: dict[str, Any], *, ctx: RunContext | None = None) -> None:
    """Mark this rank finished (heartbeat status "finished"); rank 0 logs a ``finished`` event."""
    ctx = ctx or context()
    _write_heartbeat(ctx, step, metrics, "finished")
    flush_progress(ctx)
    _ledger_event(ctx, "finished", **_metric_fields(metrics), step=step)


# --- failure records ---


_recorded = False
_hooked = False


def record_failure(exc: BaseException, ctx: RunContext | None = None) -> Path | None:
    """Leave this rank's failure record for ``exc`` in the heartbeat folder; its path, or None if none was written.

    Only the first failure of a process is recorded. Never raises: the rank
    is dying already, and the supervisor falls back to its log.
    """
    global _recorded
    try:
        ctx = ctx or context()
        if ctx.heartbeat_dir is None or _recorded:
            return None
        me = rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        path = records.write_record(ctx.heartbeat_dir, records.failure_record(exc, me, ctx.node, ctx.host))
        _recorded = True
        return path
    except Exception as problem:  # a failure to record must not hide the failure itself
        log.warning("could not write the failure record: %s", problem)
        return None


def _record_uncaught(ctx: RunContext) -> None:
    """Make an exception that ends the process leave a failure record first (once per process)."""
    global _hooked
    if _hooked or ctx.heartbeat_dir is None:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(exc, KeyboardInterrupt):
            record_failure(exc, ctx)
        previous(kind, exc, tb)

    sys.excepthook = hook


# --- checkpoints ---


def save_checkpoint(
    step: int,
    state_dict: dict[str, Any],
    metrics: dict[str, Any],
    *,
    micro_batch: int | None = None,
    ctx: RunContext | None = None,
) -> Path:
    """Collectively save ``state_dict`` as the checkpoint of ``step``; every rank must call it.

    All ranks write their DCP shards into ``step_NNNNNN.tmp``; after a barrier
    rank 0 hashes them into the manifest and renames the directory into place
    (moving an older save of the same step to ``superseded/``). ``micro_batch``
    is the effective micro-batch recorded in the manifest (default: the
    context's, else global / world). ``Checkpointer`` does the same in the
    background.
    """
    ctx = ctx or context()
    started = time.monotonic()
    flush_progress(ctx)  # the steps up to a checkpoint are in the ledger before it is
    _write_heartbeat(ctx, step, metrics, "saving")  # a long save must not look like a hang
    staging = _on_rank0(lambda: ckpt_format.prepare_staging(ctx.checkpoint_dir, step))
    dcp.save(state_dict, checkpoint_id=staging)
    if dist.is_initialized():
        dist.barrier()  # every rank's files are on disk before rank 0 hashes them
    return _on_rank0(_committer(ctx, staging, step, metrics, micro_batch, started))


def _committer(
    ctx: RunContext, staging: Path, step: int, metrics: dict[str, Any], micro_batch: int | None, started: float
) -> Callable[..., Path]:
    """Rank 0's last act of a save, once every rank's files are written: manifest, rename, ledger event."""
    micro = micro_batch or ctx.micro_batch or ctx.global_batch // world_size()
    world = world_size()

    def commit(blocked_s: float | None = None) -> Path:
        ckpt_format.write_manifest(
            staging, step=step, world_size=world, global_batch=ctx.global_batch,
            micro_batch=micro, metrics=metrics, run_id=ctx.run_id,
        )  # fmt: skip
        final = ckpt_format.commit(staging, ctx.checkpoint_dir, step)
        seconds = round(time.monotonic() - started, 3)
        # blocked_s: how long training waited for this save; seconds: until it was valid on disk.
        blocked = seconds if blocked_s is None else round(blocked_s, 3)
        _ledger_event(ctx, "checkpoint_saved", step=step, path=str(final), seconds=seconds, blocked_s=blocked)
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

    @property
    def group(self) -> Any:
        """The background saves' own process group (None until the first): a thread may still use it."""
        return self._group

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
            self._group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        staging = _on_rank0(lambda: ckpt_format.prepare_staging(self.ctx.checkpoint_dir, step))
        plain = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
        copy = self._stager.stage(plain)
        commit = _committer(self.ctx, staging, step, metrics, micro_batch, started)
        blocked_s = time.monotonic() - started
        pending: Future = Future()

        def write() -> None:
            try:
                # On rank 0 this returns once every rank's files are written (DCP gathers their results).
                dcp.save(copy, checkpoint_id=staging, process_group=self._group)
                if rank() == 0:
                    self.on_commit(commit(blocked_s))
                pending.set_result(None)
            except BaseException as exc:
                pending.set_exception(exc)

        threading.Thread(target=write, name=f"trainyard-checkpoint-{step}", daemon=True).start()
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
        elif self._pending is not None:
            return  # its thread still reads the staging buffers
        if self._stager is not None:
            self._stager.close()
            self._stager = None


def _resolve_resume(ctx: RunContext) -> tuple[Path, dict[str, Any]] | None:
    """Which checkpoint TRAINYARD_RESUME_FROM names, with its manifest; None for a fresh start."""
    mode = ctx.resume_from.strip()
    if mode.lower() in ("", "none"):
        return None
    if mode.lower() == "latest":

        def skipped(path: Path, problems: list[str]) -> None:
            log.warning("skipping invalid checkpoint %s: %s", path, "; ".join(problems))
            _ledger_event(ctx, "checkpoint_skipped", path=str(path), problems=problems)

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
    chosen = _on_rank0(lambda: _resolve_resume(ctx))
    if chosen is None:
        return 0
    path, manifest = chosen
    started = time.monotonic()
    dcp.load(state_dict, checkpoint_id=path)
    step = int(manifest["step"])
    if rank() == 0:
        log.info("resumed from %s at step %d (saved on %d ranks)", path, step, manifest["world_size"])
        _ledger_event(
            ctx, "resumed", step=step, path=str(path), from_world_size=manifest["world_size"],
            from_global_batch=manifest["global_batch"], seconds=round(time.monotonic() - started, 3),
        )  # fmt: skip
    return step
