"""The bench's workload under torchft 0.2.0: one replica group per node, a per-step quorum, a dropped step on a fault.

    TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT MASTER_PORT=P TRAINYARD_NODE=node-1 ... \\
        python bench/peers/torchft_peer.py --seq-len 128 ...

Started by ``bench/recovery.py`` (which hosts the Lighthouse), one plain process per node, each its own
replica group of world 1 with its own TCPStore on ``MASTER_PORT`` (torchft's DDP reduces across replica
groups only). As torchft's ``train_ddp.py``: ``ProcessGroupGloo`` with a short timeout (a dead peer's
allreduce fails at once; this bounds a silent one), ``torchft.DistributedDataParallel`` and
``torchft.Optimizer`` (``zero_grad`` starts the step's quorum, ``step`` commits only if every participant
says so). The step is ``manager.current_step() + 1``: a step whose allreduce failed is not committed and
is run again. The global batch is kept: the batch plan follows the quorum's participants every step.
State is never reloaded: survivors keep theirs, and with ``init_sync=False`` (same seed everywhere) no
replica heals at start.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from common import wait_for_peers, workload

from trainyard.workload.loop import lr_at


def main(argv: list[str]) -> None:
    w = workload(argv)
    ctx = w.ctx
    try:
        from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    except ImportError as exc:  # the bench checks first; this names the package for a hand-run
        sys.exit(f"torchft is not installed ({exc}): pip install -r requirements-bench.txt")

    port = int(os.environ["MASTER_PORT"])
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # noqa: F841 (kept alive)
    state = {"model": w.model, "optim": w.optimizer}
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        load_state_dict=lambda sd: (w.model.load_state_dict(sd["model"]), w.optimizer.load_state_dict(sd["optim"])),
        state_dict=lambda: {k: v.state_dict() for k, v in state.items()},
        min_replica_size=2,
        replica_id=ctx.node,
        timeout=timedelta(seconds=10),
        quorum_timeout=timedelta(seconds=60),
        connect_timeout=timedelta(seconds=30),
        rank=0,
        world_size=1,
        store_addr="127.0.0.1",
        store_port=port,
        init_sync=False,
    )
    model = DistributedDataParallel(manager, w.model)
    optimizer = Optimizer(manager, w.optimizer)
    # Every node's manager is up before any asks for a quorum: with a 1 s join window, a node still
    # starting would miss the first quorum and join (and heal) a step later: start-up skew, not recovery.
    wait_for_peers(Path(os.environ["TRAINYARD_PEERS_READY"]), ctx.node, int(os.environ["TRAINYARD_PEERS"]))
    quorum_seen, world_seen = -1, 0
    faulted = resumed = False
    while manager.current_step() < ctx.max_steps:
        step = manager.current_step() + 1
        w.drill(step)
        began = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, w.args)
        try:
            optimizer.zero_grad(set_to_none=True)  # starts this step's quorum
            world, rank = manager.num_participants(), manager.participating_rank()  # waits for it
            quorum = manager._quorum_id  # no public accessor: the id changes when the group re-forms
            if quorum != quorum_seen and world < world_seen and not resumed:
                # The survivors' smaller group: the in-place counterpart of a relaunch's attempt 2.
                if not faulted:  # the quorum dropped the dead node before any allreduce failed
                    w.event("failure_classified", attempt=1, kind="node_lost", detected_at=time.time())
                    faulted = True
                w.event("attempt_start", attempt=2, world_size=world)
                w.event("resumed", step=step - 1, world_size=world, quorum_id=quorum)
                resumed = True
            quorum_seen, world_seen = quorum, world
            plan = w.plan(world, rank if rank is not None else 0)  # None: healing, its gradients are zeroed
            batches = w.batches(plan, step)
            total = 0.0
            for i, (inputs, targets) in enumerate(batches):
                with nullcontext() if i == len(batches) - 1 else model.no_sync():
                    _, loss = model(inputs, targets)
                    (loss / len(batches)).backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(model.parameters(), w.args.grad_clip)
            optimizer.step()  # should_commit: False after a failed allreduce, and the step is dropped
        except Exception as exc:  # a quorum or commit RPC that failed: the step is not committed either
            print(f"{ctx.node}: step {step} failed: {exc}", file=sys.stderr, flush=True)
        if manager.current_step() == step:
            seconds = time.perf_counter() - began
            # The loss of node-0's own micro-batches: no extra collective per step (as torchft's train_ddp.py).
            w.event("step", step=step, loss=total / len(batches), lr=lr_at(step, w.args), step_ms=seconds * 1e3,
                    world_size=world)  # fmt: skip
        elif not faulted:
            w.event("failure_classified", attempt=1, kind="node_lost", detected_at=time.time())
            faulted = True
    w.event("finished", step=manager.current_step())
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main(sys.argv[1:])
