"""The batch settings a script applies: ``follow_batch`` splits ``TRAINYARD_GLOBAL_BATCH`` over the world.

The supervisor keeps a run's global batch when it changes the world (a scale-down, a regroup) or the
micro-batch (an OOM) by changing ``TRAINYARD_MICRO_BATCH``, and its decision says so only where the script
applies the settings: ``follow_batch`` tells it, once per attempt (rank 0's ``batch_followed`` event). A
script that never calls it keeps its own batch size, so its global batch changes with the world, and the
decision says that instead (``recovery.policy``). ``BatchPlan`` is the one arithmetic of the split.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

import torch.distributed as dist

from trainyard.runtime.process import RunContext, context, ledger_event


@dataclass(frozen=True)
class BatchPlan:
    """How one step's global batch is split across ranks and micro-batches."""

    global_batch: int
    micro_batch: int
    world_size: int
    rank: int

    def __post_init__(self) -> None:
        if min(self.global_batch, self.micro_batch, self.world_size) < 1:
            raise ValueError(f"global_batch, micro_batch and world_size must be >= 1: {self}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.global_batch % (self.micro_batch * self.world_size):
            raise ValueError(
                f"global_batch ({self.global_batch}) must be divisible by micro_batch ({self.micro_batch}) "
                f"x world_size ({self.world_size}) = {self.micro_batch * self.world_size}"
            )

    @classmethod
    def for_world(cls, global_batch: int, micro_batch: int | None, world_size: int, rank: int) -> BatchPlan:
        """A plan where ``micro_batch=None`` means no accumulation (global / world per rank)."""
        if micro_batch is None:
            if global_batch % world_size:
                raise ValueError(f"global_batch ({global_batch}) must be divisible by world_size ({world_size})")
            micro_batch = global_batch // world_size
        return cls(global_batch, micro_batch, world_size, rank)

    @property
    def accumulation(self) -> int:
        """Micro-batches per rank per step (gradient accumulation steps)."""
        return self.global_batch // (self.micro_batch * self.world_size)

    @property
    def per_rank(self) -> int:
        return self.global_batch // self.world_size


class Batch(NamedTuple):
    micro_batch: int
    """Sequences per forward pass on each rank."""
    accumulation: int
    """Micro-batches per rank per optimizer step (gradient accumulation steps)."""


_followed: set[tuple[str, int]] = set()
"""(run, attempt) this process already reported: one event an attempt, however many generations it forms."""


def _world() -> tuple[int, int]:
    """This process's rank and the world size: the process group's, else torchrun's environment (a script
    may ask before it forms its group)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


def batch_plan(ctx: RunContext, micro_batch: int | None = None) -> BatchPlan:
    """The split of ``ctx.global_batch`` over this world (``micro_batch``: a regrouped generation's; None: the
    context's); ``ValueError`` when it does not divide."""
    rank, world = _world()
    return BatchPlan.for_world(ctx.global_batch, micro_batch or ctx.micro_batch, world, rank)


def follow_batch(ctx: RunContext | None = None, *, micro_batch: int | None = None) -> Batch:
    """The micro-batch and accumulation steps that keep ``TRAINYARD_GLOBAL_BATCH`` on this world: train with
    them, and the supervisor's decisions may say the global batch is kept. Rank 0 records ``batch_followed``
    once per attempt. Call it on every rank, each time the world changes (``micro_batch``: the generation's)."""
    ctx = ctx or context()
    plan = batch_plan(ctx, micro_batch)
    if plan.rank == 0 and (ctx.run_id, ctx.attempt) not in _followed:
        _followed.add((ctx.run_id, ctx.attempt))
        ledger_event(ctx, "batch_followed", global_batch=plan.global_batch, micro_batch=plan.micro_batch,
                     accumulation=plan.accumulation)  # fmt: skip
    return Batch(plan.micro_batch, plan.accumulation)
