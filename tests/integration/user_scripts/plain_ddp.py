"""A plain torchrun script as teams have them: no trainyard import at all.

DDP over gloo, a ``torch.save`` checkpoint into ``$TRAINYARD_CHECKPOINT_DIR`` every ``$TRAINYARD_CHECKPOINT_EVERY``
steps (written to a temporary name, then renamed), and on start the newest of its own files resumed. It reads the
step count and the folder from trainyard's environment and nothing else, and prints its loss on every step.
"""

import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def newest(folder: Path) -> Path | None:
    saved = [(int(m.group(1)), p) for p in folder.glob("ckpt_*.pt") if (m := re.fullmatch(r"ckpt_(\d+)\.pt", p.name))]
    return max(saved)[1] if saved else None


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    folder = Path(os.environ["TRAINYARD_CHECKPOINT_DIR"])
    max_steps = int(os.environ["TRAINYARD_MAX_STEPS"])
    every = int(os.environ.get("TRAINYARD_CHECKPOINT_EVERY", "10"))
    torch.manual_seed(0)
    module = torch.nn.Linear(8, 1)
    optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
    start = 0
    latest = newest(folder)
    if latest is not None:
        saved = torch.load(latest, weights_only=True)
        module.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
        print(f"resumed from {latest.name} at step {start}", flush=True)
    model = DDP(module)
    target = torch.arange(8.0)
    for step in range(start + 1, max_steps + 1):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 7 + rank))
        loss = torch.nn.functional.mse_loss(model(x).squeeze(-1), x @ target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(0.2)  # a step of real work
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
            if step % every == 0 or step == max_steps:
                tmp = folder / f".ckpt_{step:06d}.pt.tmp"
                torch.save({"model": module.state_dict(), "optimizer": optimizer.state_dict(), "step": step}, tmp)
                tmp.rename(folder / f"ckpt_{step:06d}.pt")
        dist.barrier()
    del model
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
