"""What both peer scripts share: trainyard's model, data, batch plan, drill and ledger events.

A peer trains the bench's workload (``trainyard.workload``'s GPT, the synthetic corpus, the global batch
kept by ``BatchPlan``) under another library's recovery, and writes the ledger events that
``trainyard.recovery.figures.recovery_figures`` reads, so its resume delay, lost steps and ETTR come
out of the same definition as trainyard's:

- ``step`` (one per committed step, from node-0, which the bench's drill never kills);
- ``drill_fired`` (the killed node, just before it kills itself: the fault's time);
- ``failure_classified`` (attempt 1, when a survivor first sees the fault: ``detected_at``);
- ``attempt_start`` (attempt 2) and ``resumed`` (the last committed step) once the survivors have
  formed their new group: the in-place counterpart of trainyard's relaunch (the first two go to the
  run's own ``events.jsonl``: the ledger takes only a worker's events from ``events.d``);
- ``finished``.

Settings come from the same TRAINYARD_* environment as ``python -m trainyard.workload`` (data dir,
max steps, batch, drills, node, events dir); the model flags are trainyard's.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainyard import runtime
from trainyard.events.ledger import EventWriter, Ledger
from trainyard.events.schema import WORKER_EVENTS
from trainyard.protocol.env import TrainEnv
from trainyard.workload import data
from trainyard.workload.loop import build_optimizer, parse_args
from trainyard.workload.model import GPT, GPTConfig

WRITER = "node-0"
"""The node that writes the run's step and recovery events (the bench's drill kills node-1)."""


@dataclass
class Workload:
    args: argparse.Namespace
    ctx: TrainEnv
    cfg: GPTConfig
    stream: data.TokenStream
    model: GPT
    optimizer: torch.optim.Optimizer
    events: EventWriter | None

    orchestrator: Ledger | None
    """The run's own events file, for the events of the peer's recovery (in-process: the peer is its own
    orchestrator). The ledger takes only a worker's events from ``events.d``."""

    def event(self, name: str, **fields: Any) -> None:
        """A ``train`` event from node-0 only: one voice per run, as rank 0's in trainyard."""
        if self.ctx.node != WRITER:
            return
        target = self.events if name in WORKER_EVENTS else self.orchestrator
        if target is not None:
            target.append("train", name, node=self.ctx.node, **fields)

    def plan(self, world: int, rank: int) -> data.BatchPlan:
        return data.BatchPlan.for_world(self.ctx.global_batch, self.ctx.micro_batch, world, rank)

    def batches(self, plan: data.BatchPlan, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return data.micro_batches(self.stream, plan, step, self.ctx.seed, self.cfg.seq_len)

    def drill(self, step: int) -> None:
        """Act out this node's drill due at the start of ``step``: only ``kill`` (the bench's fault).

        Like trainyard's ``Drills.before_step``, but the node is this one process (no torchrun agent whose
        process group to kill: the bench started the peer in a session of its own), so it kills itself.
        """
        for drill in self.ctx.drills:
            if drill.node not in (None, self.ctx.node) or drill.step != step:
                continue
            if drill.fault != "kill":
                sys.exit(f"TRAINYARD_DRILLS: fault {drill.fault!r} is not acted out by the bench peers; use 'kill'")
            if self.events is not None:
                self.events.append("train", "drill_fired", fault="kill", node=self.ctx.node, step=step)
            os.kill(os.getpid(), signal.SIGKILL)


def workload(argv: list[str]) -> Workload:
    """The bench's model (seeded as trainyard's loop seeds it), optimizer, data and event writer."""
    args = parse_args(argv)
    ctx = runtime.context()
    cfg = GPTConfig(args.vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads)
    torch.manual_seed(ctx.seed)
    torch.use_deterministic_algorithms(True)
    model = GPT(cfg)
    events = EventWriter.in_dir(ctx.events_dir, f"peer.{ctx.node}") if ctx.events_dir else None
    orchestrator = Ledger(os.environ["TRAINYARD_PEERS_LEDGER"]) if "TRAINYARD_PEERS_LEDGER" in os.environ else None
    stream = data.TokenStream.open(ctx.data_dir)
    return Workload(args, ctx, cfg, stream, model, build_optimizer(model, args), events, orchestrator)


def wait_for_peers(folder: Path, node: str, count: int, timeout_s: float = 300.0) -> None:
    """A file barrier: start training only once every node has imported torch and built its model.

    Without it a node slowed by its imports (2 cores, 3 processes) would miss the first quorum or
    rendezvous window and join later, which is start-up skew, not recovery.
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / node).touch()
    deadline = time.monotonic() + timeout_s
    while len(list(folder.iterdir())) < count:
        if time.monotonic() > deadline:
            sys.exit(
                f"{node}: only {len(list(folder.iterdir()))} of {count} peers ready in {folder} after {timeout_s} s"
            )
        time.sleep(0.05)
