"""A torchrun script as teams have them, making no trainyard calls: plain DDP over gloo, its own batch size (it
reads no TRAINYARD_GLOBAL_BATCH), no heartbeats, no events.

Every ``TRAINYARD_CHECKPOINT_EVERY`` steps (and at the last) rank 0 writes a ``torch.save`` file
``ckpt_NNNNNN.pt`` into ``$TRAINYARD_CHECKPOINT_DIR`` (a temporary name first, then a rename), and on start it
resumes from the newest of its own files. A short sleep per step makes it last longer than a short heartbeat
timeout. With ``--print-steps`` rank 0 prints nanoGPT's line per step (``iter N: loss X, time T``): its only word
on its progress, which trainyard reads from its log. With ``--stall-at N`` a run that started fresh stops at
step N for good (a deadlock's stand-in: its processes live on, silent); one that resumed does not.
"""

import os
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

STEP_S, PER_RANK = 0.05, 8
PRINT_STEPS = "--print-steps" in sys.argv[1:]
STALL_AT = int(sys.argv[sys.argv.index("--stall-at") + 1]) if "--stall-at" in sys.argv else None


def newest(folder: Path) -> Path | None:
    saved = [(int(m.group(1)), p) for p in folder.glob("ckpt_*.pt") if (m := re.fullmatch(r"ckpt_(\d+)\.pt", p.name))]
    return max(saved)[1] if saved else None


def main() -> None:
    folder = Path(os.environ["TRAINYARD_CHECKPOINT_DIR"])
    max_steps = int(os.environ["TRAINYARD_MAX_STEPS"])
    every = int(os.environ.get("TRAINYARD_CHECKPOINT_EVERY", "10"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    start = 0
    latest = newest(folder)
    if latest is not None:
        saved = torch.load(latest, weights_only=True)
        module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = int(saved["step"])
    print(f"rank {rank}: starting at step {start + 1} on {dist.get_world_size()} ranks", flush=True)
    model = DDP(module)
    for step in range(start + 1, max_steps + 1):
        x = torch.randn(PER_RANK, 4)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(STEP_S)
        if step == STALL_AT and start == 0:
            time.sleep(3600)
        if rank == 0 and PRINT_STEPS:
            print(f"iter {step}: loss {loss.item():.4f}, time {1000 * STEP_S:.1f}ms", flush=True)
        if rank == 0 and (step % every == 0 or step == max_steps):
            tmp = folder / f".ckpt_{step:06d}.pt.tmp"
            torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
            tmp.rename(folder / f"ckpt_{step:06d}.pt")
        dist.barrier()  # rank 0's save is whole before any rank goes on (a kill may come at any step)
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
