"""A torchrun script that makes no trainyard calls: plain DDP over gloo, ``torch.save`` checkpoints in
``$TRAINYARD_CHECKPOINT_DIR/step_NNNNNN/model.pt`` every ``EVERY`` steps, resuming from its newest one.

Its own batch size (it reads no TRAINYARD_GLOBAL_BATCH), no heartbeats, no events: what issue 31 ran.
A short sleep per step makes it last longer than a short heartbeat timeout.
"""

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

EVERY, STEP_S, PER_RANK = 10, 0.05, 8

root = os.environ["TRAINYARD_CHECKPOINT_DIR"]
max_steps = int(os.environ["TRAINYARD_MAX_STEPS"])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
start = 0
names = (
    sorted(n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, "model.pt")))
    if os.path.isdir(root)
    else []
)
if names:
    saved = torch.load(os.path.join(root, names[-1], "model.pt"))
    model.load_state_dict(saved["model"])
    optimizer.load_state_dict(saved["optimizer"])
    start = int(saved["step"])
print(f"rank {rank}: starting at step {start + 1} on {dist.get_world_size()} ranks", flush=True)
ddp = DDP(model)
for step in range(start + 1, max_steps + 1):
    x = torch.randn(PER_RANK, 4)
    loss = (ddp(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(STEP_S)
    if step % EVERY == 0 and rank == 0:
        folder = os.path.join(root, f"step_{step:06d}")
        os.makedirs(folder, exist_ok=True)
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}
        torch.save(state, os.path.join(folder, "model.pt.tmp"))
        os.replace(os.path.join(folder, "model.pt.tmp"), os.path.join(folder, "model.pt"))
dist.destroy_process_group()
