"""The reference training loop: DDP over the staged token shards, on GPUs (NCCL, bf16) or CPUs (gloo).

Run it with torchrun; every setting except the model shape comes from the
TRAINYARD_* environment (see ``trainyard.train.runtime``). One node, two
processes::

    export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
    export TRAINYARD_DATA_DIR=/tmp/ty/data TRAINYARD_CHECKPOINT_DIR=/tmp/ty/ckpt \\
           TRAINYARD_HEARTBEAT_DIR=/tmp/ty/hb TRAINYARD_EVENTS_DIR=/tmp/ty/events.d \\
           TRAINYARD_MAX_STEPS=60 TRAINYARD_GLOBAL_BATCH=32 TRAINYARD_CHECKPOINT_EVERY=20 \\
           TRAINYARD_RESUME_FROM=latest
    python -c "from trainyard.shards import write_synthetic_corpus as w; w('/tmp/ty/data')"
    torchrun --standalone --nproc-per-node=2 -m trainyard.train --lr 1e-2

Two local "nodes" (one torchrun agent each, as the local launcher runs them);
start both, in any order, with the same endpoint and id::

    TRAINYARD_NODE=node-0 torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo --rdzv-conf=is_host=1 \\
        --local-addr=127.0.0.1 -m trainyard.train &
    TRAINYARD_NODE=node-1 torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo --rdzv-conf=is_host=0 \\
        --local-addr=127.0.0.1 -m trainyard.train

``python -m trainyard.train`` without torchrun trains in one process.

Where CUDA is present, rank ``LOCAL_RANK`` trains on ``cuda:LOCAL_RANK`` over
NCCL with bf16 autocast; otherwise on the CPU over gloo (``trainyard.train.device``).
Either way the weights and optimizer state are fp32 and checkpoints are the same.

The loop is deterministic: the model is seeded, batches are a pure function of
(seed, step) (``trainyard.train.data``) and the learning rate is a function of
the step alone, so a resumed run reproduces the uninterrupted one and a run can
resume on a different world size with the same global batch.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.nn.parallel import DistributedDataParallel as DDP

from trainyard.errors import DataError, SpecError, TrainingFailed
from trainyard.train import data, device, runtime
from trainyard.train.drills import Drills
from trainyard.train.model import GPT, GPTConfig

log = logging.getLogger("trainyard.train")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Model and optimizer flags; run settings (steps, batch, paths) come from the environment."""
    p = argparse.ArgumentParser(prog="python -m trainyard.train", description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--n-layers", type=int, default=2)
    p.add_argument("--n-heads", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-2, help="peak learning rate (AdamW)")
    p.add_argument("--warmup-steps", type=int, default=5, help="linear warmup; constant afterwards")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm (0: off)")
    return p.parse_args(argv)


class TrainState(Stateful):
    """Model + optimizer as one DCP ``Stateful``.

    ``get_state_dict`` keys the optimizer state by parameter name (not by
    position) and strips DDP's ``module.`` prefix, so a checkpoint is
    independent of the wrapper and the world size. DCP calls ``state_dict()``
    only when it saves or loads, so a fresh run never materialises (and thereby
    perturbs) optimizer state before its first step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizer = optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"]
        )


def build_optimizer(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (decaying norms and biases only hurts)."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warmup then constant: depends on the step only, so resuming needs no scheduler state."""
    return args.lr * min(1.0, step / max(1, args.warmup_steps))


def train_step(
    model: DDP,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    lr: float,
    clip: float,
    placement: device.Placement = device.CPU,
) -> float:
    """One optimizer step over this rank's micro-batches; returns the loss averaged over the global batch."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
    total = torch.zeros((), device=placement.device)  # NCCL reduces device tensors only
    for i, (inputs, targets) in enumerate(batches):
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        sync = nullcontext() if i == len(batches) - 1 else model.no_sync()
        with sync:
            with placement.autocast():  # the forward pass only: backward runs in the dtypes it chose
                _, loss = model(inputs, targets)
            # Equal-sized micro-batches: scaling by 1/accumulation and DDP's 1/world
            # makes the gradient that of the mean over the whole global batch.
            (loss / len(batches)).backward()
        total += loss.detach()
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    dist.all_reduce(total)
    return total.item() / (len(batches) * dist.get_world_size())


def _check_vocab(stream: data.TokenStream, cfg: GPTConfig) -> None:
    if stream.vocab_size > cfg.vocab_size:
        raise DataError(f"shards use vocab_size {stream.vocab_size} but the model has --vocab-size {cfg.vocab_size}")


def _step_line(step: int, metrics: dict[str, float]) -> str:
    return (
        f"step {step} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
        f"ms {metrics['step_ms']:.1f} tok/s {metrics['tokens_per_s']:.0f}"
    )


def _configure(args: argparse.Namespace, ctx: runtime.RunContext) -> tuple[GPTConfig, data.BatchPlan]:
    """Model shape and batch split, or a one-line ``SpecError``: both come from the pipeline spec."""
    try:
        cfg = GPTConfig(args.vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads)
        plan = data.BatchPlan.for_world(ctx.global_batch, ctx.micro_batch, dist.get_world_size(), dist.get_rank())
    except ValueError as exc:
        raise SpecError([str(exc)]) from exc
    return cfg, plan


def wrap(model: torch.nn.Module, placement: device.Placement) -> DDP:
    """The model on its device, in DDP (one GPU per process: ``device_ids`` is this rank's)."""
    if placement.cuda:
        return DDP(model.to(placement.device), device_ids=[placement.index], output_device=placement.index)
    return DDP(model)


def train(
    args: argparse.Namespace, ctx: runtime.RunContext, placement: device.Placement | None = None
) -> dict[str, float]:
    """Train from the resume point to ``ctx.max_steps``; return the last step's metrics."""
    placement = placement or device.current()
    cfg, plan = _configure(args, ctx)
    torch.manual_seed(ctx.seed)  # seeds CUDA too; the weights are drawn on the CPU, so both paths start equal
    # Some CUDA kernels (NLLLoss's) have no deterministic variant: warn there rather than fail the run.
    torch.use_deterministic_algorithms(True, warn_only=placement.cuda)
    stream = data.TokenStream.open(ctx.data_dir)
    _check_vocab(stream, cfg)
    rank, world = plan.rank, plan.world_size
    model = wrap(GPT(cfg), placement)
    optimizer = build_optimizer(model, args)
    state = {"train": TrainState(model, optimizer)}
    start = runtime.load_latest(state, ctx=ctx)
    if rank == 0:
        log.info(
            "model %d params, world %d, global batch %d = %d micro x %d accum x %d ranks, from step %d, on %s (%s%s)",
            model.module.num_params(), world, plan.global_batch, plan.micro_batch, plan.accumulation, world, start,
            placement.device, placement.backend, ", bf16 autocast" if placement.autocast_dtype else "",
        )  # fmt: skip
    metrics: dict[str, float] = {}
    drills = Drills(ctx, rank)
    checkpoints = runtime.Checkpointer(ctx, on_commit=drills.after_checkpoint)
    seconds = 0.0
    try:
        for step in range(start + 1, ctx.max_steps + 1):
            drills.before_step(step, seconds)
            began = time.perf_counter()
            batches = data.micro_batches(stream, plan, step, ctx.seed, cfg.seq_len, placement.device)
            loss = drills.loss(
                step, train_step(model, optimizer, batches, lr_at(step, args), args.grad_clip, placement)
            )
            seconds = time.perf_counter() - began
            metrics = {
                "loss": loss, "lr": lr_at(step, args), "step_ms": seconds * 1e3,
                "tokens_per_s": plan.global_batch * cfg.seq_len / seconds,
            }  # fmt: skip
            runtime.heartbeat(step, metrics, ctx=ctx)
            if rank == 0:
                print(_step_line(step, metrics), flush=True)
            if not math.isfinite(loss):
                # Never checkpoint a diverged model; the supervisor rolls back to the last valid one.
                raise TrainingFailed(f"loss is {loss} at step {step}", kind="diverged")
            if ctx.should_checkpoint(step):
                checkpoints.save(step, state, metrics, micro_batch=plan.micro_batch)
    except BaseException:
        checkpoints.close(wait=False)  # a save in flight may wait on a dead peer: fail now, not at its timeout
        raise
    checkpoints.close()  # the last save commits before "finished"
    runtime.finish(max(start, ctx.max_steps), metrics, ctx=ctx)
    return metrics


def init_process_group() -> device.Placement:
    """Join torchrun's process group (env://), or form a one-process group when run directly.

    Binds the process to its GPU first, where it has one, and returns where it computes.
    """
    placement = device.current()
    device.prepare(placement)
    bound = torch.device(placement.device) if placement.cuda else None  # NCCL connects at once, on this GPU
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(placement.backend, device_id=bound)
    else:
        dist.init_process_group(placement.backend, store=dist.HashStore(), rank=0, world_size=1, device_id=bound)
    return placement
