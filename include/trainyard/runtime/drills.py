"""Fault drills acted out inside the training workload, for rehearsals and tests.

The supervisor passes the drills of one attempt in ``TRAINYARD_DRILLS`` (JSON,
``TrainEnv.drills``); a drill fires on the ranks of its node (or every rank, for
``nan``) at its step, records ``drill_fired`` in the rank's own event file (the
fault's time, for the recovery figures) and then does what a real fault does: a SIGKILLed or frozen node, a
slow one, a SIGTERM (preemption notice), a corrupted checkpoint, a NaN loss, an out-of-memory error, a bug.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from trainyard.checkpoint.format import step_of
from trainyard.events.ledger import EventWriter
from trainyard.protocol.env import FaultDrill, TrainEnv

ENV = "TRAINYARD_DRILLS"  # declared by ``TrainEnv.drills``


class Drills:
    """The drills of this node, for one process: what it already did stays done across generations."""

    def __init__(self, ctx: TrainEnv, rank: int | None = None):
        self.items = [d for d in ctx.drills if d.node in (None, ctx.node)]  # a drill without a node: every node
        self.ctx, self.node, self.rank = ctx, ctx.node, 0
        self.events: EventWriter | None = None
        self.corrupted = False
        if rank is not None:
            self.at_rank(rank)

    def at_rank(self, rank: int) -> None:
        """This process's rank in the generation it trains in now; its event file keeps the first one's number."""
        self.rank = rank
        if self.events is None and self.ctx.events_dir:
            self.events = EventWriter.in_dir(self.ctx.events_dir, self.ctx.writer_name(rank))
            if self.items:  # the supervisor leaves these to this process (``recovery.drills``)
                self.events.append("train", "drills_acted", attempt=self.ctx.attempt, node=self.node,
                                   faults=[d.fault for d in self.items])  # fmt: skip

    def _fired(self, drill: FaultDrill, step: int) -> None:
        if self.events is not None and (self.rank == 0 or drill.node):
            self.events.append("train", "drill_fired", fault=drill.fault, node=self.node, step=step)

    def before_step(self, step: int, step_s: float) -> None:
        """Faults that strike a node at the start of ``step``."""
        for drill in self.items:
            fault, at = drill.fault, drill.step
            if fault == "slow" and step >= at:
                time.sleep(step_s * drill.factor)  # a straggler: every step takes longer
            if step != at or fault in ("slow", "nan", "corrupt_checkpoint"):
                continue
            self._fired(drill, step)
            # The node's torchrun agent and everything in its session; a process started without torchrun
            # (an elastic node of one process) is the node itself: its parent is the supervisor, spare it.
            agent = os.getpgid(os.getppid()) if "TORCHELASTIC_RUN_ID" in os.environ else None
            if fault == "kill":
                if agent is not None:
                    os.killpg(agent, signal.SIGKILL)
                os.kill(os.getpid(), signal.SIGKILL)
            elif fault == "preempt":  # notice, as the kubelet gives it: the node's own handler decides
                if agent is not None:
                    os.killpg(agent, signal.SIGTERM)
                else:
                    os.kill(os.getpid(), signal.SIGTERM)
            elif fault == "hang":
                if agent is not None:
                    os.killpg(agent, signal.SIGSTOP)
                os.kill(os.getpid(), signal.SIGSTOP)
            elif fault == "oom":
                raise MemoryError(f"drill: out of memory at step {step} on {self.node}")
            elif fault == "exception":
                raise RuntimeError(f"drill: exception in user code at step {step} on {self.node}")

    def loss(self, step: int, loss: float) -> float:
        """The loss a ``nan`` drill turns into NaN at its step (on every rank alike)."""
        for drill in self.items:
            if drill.fault == "nan" and step == drill.step:
                self._fired(drill, step)
                return float("nan")
        return loss

    def after_checkpoint(self, path: Path) -> None:
        """Flip one byte of the first checkpoint at or after the drill's step (rank 0, after its manifest)."""
        step = step_of(path) or 0
        for drill in self.items:
            if drill.fault == "corrupt_checkpoint" and self.rank == 0 and step >= drill.step and not self.corrupted:
                self.corrupted = True
                self._fired(drill, step)
                victim = max(path.glob("*.distcp"), key=lambda p: p.stat().st_size)
                data = bytearray(victim.read_bytes())
                data[len(data) // 2] ^= 0xFF
                victim.write_bytes(bytes(data))
