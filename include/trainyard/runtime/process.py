"""This training process as the runtime sees it: its context, its rank, and rank 0's ledger events.

``context()`` parses the TRAINYARD_* environment (``trainyard.protocol.env``
declares it) and sets the process up once; ``rank``/``world_size`` also work
in a plain single process; ``on_rank0`` is how every collective call of the
runtime lets rank 0 decide and all ranks agree, errors included.
"""

from __future__ import annotations

import os
import pickle
import socket
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import torch.distributed as dist

from trainyard.events.ledger import EventWriter
from trainyard.protocol.env import TrainEnv
from trainyard.runtime.failures import record_uncaught

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
        record_uncaught(ctx)
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


def on_rank0(fn: Callable[[], T]) -> T:
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


# --- rank 0's ledger events ---

# Fields every train event carries; a metric with one of these names must not clobber them.
_RESERVED = {"stage", "event", "ts", "run_id", "attempt", "node", "world_size", "step", "first_step", "steps"}


def ledger_event(ctx: RunContext, event: str, **fields: Any) -> None:
    """Append a ``train`` event to rank 0's own file in the run's events folder (no folder configured: no-op)."""
    if ctx.events_dir is not None and rank() == 0:
        fixed = {"run_id": ctx.run_id, "attempt": ctx.attempt, "node": ctx.node, "world_size": world_size()}
        EventWriter.in_dir(ctx.events_dir, ctx.writer_name(0)).append(STAGE, event, **{**fields, **fixed})


def metric_fields(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` without the fields every event carries (a copy: the caller may reuse its dict)."""
    return {k: v for k, v in metrics.items() if k not in _RESERVED}
