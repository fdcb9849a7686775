"""Bring your own training script: the smallest script trainyard can run, resume and supervise.

It fits y = 3x + 1 with DDP over gloo. Everything trainyard needs from a
script is here: read the run context, resume, heartbeat every step, save
checkpoints collectively, finish. Point a spec at it with
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
    dist.init_process_group("gloo")
    train(runtime.context())
    # After train() returned, so DDP's reducer is gone: a process group destroyed from the reducer's
    # destructor (holding the GIL) can deadlock with gloo's worker thread, which needs the GIL to free
    # the tensors of its last collective. Seen as a rank that hung after "finished".
    dist.destroy_process_group()


def train(ctx: runtime.RunContext) -> None:
    torch.manual_seed(ctx.seed)
    model = DDP(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}
    start = runtime.load_latest(state)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    checkpoints = runtime.Checkpointer(ctx)
    loss = torch.tensor(0.0)
    for step in range(start + 1, ctx.max_steps + 1):
        gen = torch.Generator().manual_seed(ctx.seed * 1_000_003 + step * 101 + dist.get_rank())
        x = torch.randn(32, 1, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), 3 * x + 1)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        runtime.heartbeat(step, {"loss": loss.item()})
        if ctx.should_checkpoint(step):
            checkpoints.save(
                step, {"model": model.module.state_dict(), "optimizer": optimizer.state_dict()}, {"loss": loss.item()}
            )
    checkpoints.close()
    runtime.finish(ctx.max_steps, {"loss": loss.item()})


if __name__ == "__main__":
    main()
