"""Bring your own training script: the smallest script trainyard can run, resume and supervise.

It fits y = 3x + 1 with DDP over gloo. Everything trainyard needs from a
script is here: read the run context, resume, heartbeat every step, save
checkpoints collectively, finish. It trains through the runtime's elastic group
(``trainyard.runtime.group``), as the reference workload does: under torchrun
that is torchrun's world and does nothing of its own; with ``TRAINYARD_STORE``
the same loop regroups in place when a peer is lost (``recovery.in_place``, the
default, on the local backend). Point a spec at it with
``training.entrypoint: /abs/path/examples/byo_train.py``, or run it by hand::

    TRAINYARD_DATA_DIR=/tmp/unused TRAINYARD_CHECKPOINT_DIR=/tmp/byo/ckpt TRAINYARD_MAX_STEPS=50 \\
    TRAINYARD_CHECKPOINT_EVERY=25 TRAINYARD_RESUME_FROM=latest GLOO_SOCKET_IFNAME=lo \\
    torchrun --standalone --nproc-per-node=2 examples/byo_train.py
"""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainyard import runtime


def main() -> None:
    ctx = runtime.context()
    if ctx.store is None:  # in place, each generation forms a group of its own
        dist.init_process_group("gloo")
    train(ctx)
    # After train() returned, so DDP's reducer is gone: a process group destroyed from the reducer's
    # destructor (holding the GIL) can deadlock with gloo's worker thread, which needs the GIL to free
    # the tensors of its last collective. Seen as a rank that hung after "finished".
    if dist.is_initialized():
        dist.destroy_process_group()


def train(ctx: runtime.RunContext) -> None:
    torch.manual_seed(ctx.seed)
    module = torch.nn.Linear(1, 1)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.05)
    # What a resume loads and a joiner receives. The runtime saves the optimizer's state by parameter name
    # (get_state_dict/set_state_dict), so AdamW resumes with its moments; runtime.TrainState(module, optimizer)
    # is the same, explicit.
    state = {"model": module, "optimizer": optimizer}
    group = runtime.elastic_group(ctx, state, wrap=lambda: DDP(module))
    checkpoints = runtime.Checkpointer(ctx)
    loss = 0.0
    while group.form():  # torchrun's world: once
        with group.guard(checkpoints):  # closes the checkpointer: the last save commits before "finished"
            for step in group.steps():
                loss = train_step(group, optimizer, ctx.seed, step)
                runtime.heartbeat(step, {"loss": loss})
                if ctx.should_checkpoint(step):
                    checkpoints.save(step, state, {"loss": loss})
    if not group.left_out:
        runtime.finish(ctx.max_steps, {"loss": loss})


def train_step(group: runtime.ElasticGroup, optimizer: torch.optim.Optimizer, seed: int, step: int) -> float:
    """One step on this rank's batch; its tensors go with its frame (only ``group.model`` holds the wrapper)."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + group.rank)
    x = torch.randn(32, 1, generator=gen)
    loss = torch.nn.functional.mse_loss(group.model(x), 3 * x + 1)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    group.commit(step)  # the gradient all-reduce (in backward) was the step's last collective
    return loss.item()


if __name__ == "__main__":
    main()
