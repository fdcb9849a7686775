"""A rank's progress: its heartbeat file and liveness pulse, and rank 0's ``step`` events at a bounded rate.

Heartbeats are files rather than ledger events because the watcher needs the
latest state of *every* rank cheaply (``trainyard.protocol.heartbeat``); rank 0
folds its steps into one ``step`` event per ``TRAINYARD_PROGRESS_EVERY_S``
(``trainyard.protocol.steps``), so a long run's ledger stays small.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainyard.protocol.heartbeat import (
    NODE_PULSE,
    local_folder,
    node_beat,
    publish_pulse,
    read_local_beats,
    write_beat,
    write_node_beat,
)
from trainyard.protocol.steps import ProgressDigest
from trainyard.runtime import live_metrics
from trainyard.runtime.device import local_ranks
from trainyard.runtime.process import RunContext, context, ledger_event, metric_fields, rank

LIVENESS_S = 1.0
_pulse: threading.Thread | None = None
_pulse_path: Path | None = None
"""This rank's pulse in its node's local folder (``rank-L.alive`` by local rank)."""
_node_pulse: tuple[Path, Path] | None = None
"""Local rank 0's: (the node's pulse on the shared volume, the node's local folder)."""
_pulse_lock = threading.Lock()
"""Held while the pulse is touched, and while a finished rank removes it."""
_local_folders: dict[Path, Path] = {}
"""Node folder -> its local folder (made once per process)."""
_last_metrics: dict[str, Any] = {}
"""The metrics of this process's last ``running`` heartbeat: a regrouping rank's heartbeat repeats them."""


def _keep_alive() -> None:
    """Touch this rank's pulse every second from a daemon thread, whatever the training loop is doing; local
    rank 0's thread also stamps the node's pulse with its oldest rank's (``protocol.heartbeat.publish_pulse``).

    A rank blocked in a collective still pulses (gloo waits without the GIL);
    a stopped or frozen process does not. The supervisor tells the node that
    hung from the ones merely waiting for it by this pulse.
    """
    while True:
        with _pulse_lock, contextlib.suppress(OSError):
            if _pulse_path is not None:
                _pulse_path.touch()
        if _node_pulse is not None:
            with contextlib.suppress(OSError):
                publish_pulse(*_node_pulse)
        time.sleep(LIVENESS_S)


def write_heartbeat(ctx: RunContext, step: int, metrics: dict[str, Any], status: str) -> None:
    """This rank's heartbeat (no heartbeat folder configured: no-op); starts its pulse the first time.

    One writer per node (``protocol.heartbeat``): the beat goes to the node's local folder; local rank 0
    then writes the node's beat to the shared volume, from its own and its node's other ranks'."""
    global _pulse, _pulse_path, _node_pulse
    if ctx.heartbeat_dir is None:
        return
    ctx.heartbeat_dir.mkdir(parents=True, exist_ok=True)
    local, _ = local_ranks(os.environ)
    here = _local_folders.get(ctx.heartbeat_dir) or _local_folders.setdefault(
        ctx.heartbeat_dir, local_folder(ctx.heartbeat_dir)
    )
    me = rank()
    record = {
        "rank": me, "node": ctx.node, "host": ctx.host, "pid": os.getpid(), "step": step, "time": time.time(),
        "status": status, "metrics": metrics, "attempt": ctx.attempt, "run_id": ctx.run_id,
    }  # fmt: skip
    write_beat(here, local, record)
    if local == 0:
        write_node_beat(ctx.heartbeat_dir, node_beat(record, read_local_beats(here, skip=local)))
    if status == "finished":  # a finished rank no longer pulses: its pulse must not stop the node's
        with _pulse_lock, contextlib.suppress(OSError):  # not touched again after it is gone
            _pulse_path = None
            (here / f"rank-{local}.alive").unlink()
        return
    _pulse_path = here / f"rank-{local}.alive"
    if local == 0:
        _node_pulse = (ctx.heartbeat_dir / NODE_PULSE, here)
    if _pulse is None:
        _pulse_path.touch()
        if _node_pulse is not None:
            publish_pulse(*_node_pulse)
        _pulse = threading.Thread(target=_keep_alive, daemon=True)
        _pulse.start()


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
        ledger_event(ctx, "step", **record)


def heartbeat(step: int, metrics: dict[str, Any], *, status: str = "running", ctx: RunContext | None = None) -> None:
    """Record progress: this rank's heartbeat file, plus (rank 0) the ledger's ``step`` events at a bounded rate
    and the live metrics, where the deployment collects them (``live_metrics``)."""
    global _last_metrics
    ctx = ctx or context()
    write_heartbeat(ctx, step, metrics, status)
    if status == "running":
        _last_metrics = metrics
        live_metrics.report(ctx, step, metrics)
    if status == "running" and ctx.events_dir is not None and rank() == 0:
        # A checkpoint step is written at once: the metric gate needs its exact loss.
        for record in _digest(ctx).add(step, metric_fields(metrics), force=ctx.should_checkpoint(step)):
            ledger_event(ctx, "step", **record)


def regrouping(step: int, ctx: RunContext) -> None:
    """This rank lost its group after ``step``: its heartbeat says so (with the last step's metrics), and the
    steps before the fault go to the ledger while its rank number still holds (call it before regrouping)."""
    heartbeat(step, _last_metrics, status="regrouping", ctx=ctx)
    flush_progress(ctx)


def regrouped(
    generation: int, micro_batch: int, from_step: int, joiners: list[str], *, ctx: RunContext | None = None
) -> None:
    """A new generation formed in place: rank 0's ``regrouped`` event, and the next step's event at once.

    Call it on every rank once the generation's group is formed (ranks and world size are the new ones)."""
    ctx = ctx or context()
    live_metrics.at_generation(generation)
    _digest(ctx).write_next()
    ledger_event(ctx, "regrouped", generation=generation, micro_batch=micro_batch, from_step=from_step,
                 joiners=list(joiners))  # fmt: skip


def finish(step: int, metrics: dict[str, Any], *, ctx: RunContext | None = None) -> None:
    """Mark this rank finished (heartbeat status "finished"); rank 0 logs a ``finished`` event."""
    ctx = ctx or context()
    write_heartbeat(ctx, step, metrics, "finished")
    flush_progress(ctx)
    ledger_event(ctx, "finished", **metric_fields(metrics), step=step)
    live_metrics.close()
