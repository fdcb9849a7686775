"""The reference training loop: DDP over the staged token shards, on GPUs (NCCL, bf16) or CPUs (gloo).

Run it with torchrun; every setting except the model shape comes from the
TRAINYARD_* environment (see ``trainyard.runtime``). One node, two
processes::

    export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
    export TRAINYARD_DATA_DIR=/tmp/ty/data TRAINYARD_CHECKPOINT_DIR=/tmp/ty/ckpt \\
           TRAINYARD_HEARTBEAT_DIR=/tmp/ty/hb TRAINYARD_EVENTS_DIR=/tmp/ty/events.d \\
           TRAINYARD_MAX_STEPS=60 TRAINYARD_GLOBAL_BATCH=32 TRAINYARD_CHECKPOINT_EVERY=20 \\
           TRAINYARD_RESUME_FROM=latest
    python -c "from trainyard.protocol.shards import write_synthetic_corpus as w; w('/tmp/ty/data')"
    torchrun --standalone --nproc-per-node=2 -m trainyard.workload --lr 1e-2

Two local "nodes" (one torchrun agent each, as the local launcher runs them);
start both, in any order, with the same endpoint and id::

    TRAINYARD_NODE=node-0 torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo --rdzv-conf=is_host=1 \\
        --local-addr=127.0.0.1 -m trainyard.workload &
    TRAINYARD_NODE=node-1 torchrun --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=demo --rdzv-conf=is_host=0 \\
        --local-addr=127.0.0.1 -m trainyard.workload

``python -m trainyard.workload`` without torchrun trains in one process.

Where CUDA is present, rank ``LOCAL_RANK`` trains on ``cuda:LOCAL_RANK`` over
NCCL with bf16 autocast; otherwise on the CPU over gloo (``trainyard.runtime.device``).
Either way the weights and optimizer state are fp32 and checkpoints are the same.

There is one training loop, and it trains through the runtime's elastic group
(``trainyard.runtime.group``) exactly as a user's script would. Without
``TRAINYARD_STORE`` the group is torchrun's world and does nothing of its own;
with it (the supervisor's coordination store, ``trainyard.protocol.coordstore``)
the process forms no group from torchrun: it trains as a member of the
generations the supervisor publishes and, when a peer is lost, regroups in
place with the survivors and redoes the failed step.

The loop is deterministic: the model is seeded, batches are a pure function of
(seed, step) (``trainyard.workload.data``) and the learning rate is a function of
the step alone, so a resumed run reproduces the uninterrupted one and a run can
resume on a different world size with the same global batch.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainyard import runtime
from trainyard.errors import DataError, SpecError, TrainingFailed
from trainyard.reference import FLAGS
from trainyard.runtime import device
from trainyard.runtime.batch import BatchPlan, batch_plan
from trainyard.runtime.drills import Drills
from trainyard.workload import data
from trainyard.workload.model import GPT, GPTConfig

log = logging.getLogger("trainyard.workload")
STORE_ENV = "TRAINYARD_STORE"  # declared by ``TrainEnv.store``


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Model and optimizer flags; run settings (steps, batch, paths) come from the environment."""
    p = argparse.ArgumentParser(prog="python -m trainyard.workload", description=__doc__.split("\n\n")[0])
    for name, flag in FLAGS.items():  # one declaration, also what ``trainyard check`` checks training.args by
        p.add_argument(
            f"--{name}", type=flag.kind, default=flag.default, help=flag.help or None, choices=flag.choices or None
        )
    return p.parse_args(argv)


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
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """One optimizer step over this rank's micro-batches; returns the loss averaged over the global batch.

    ``reduce`` sums the loss over the ranks (default ``dist.all_reduce``): the elastic group's
    ``all_reduce``, whose one collective also carries the group's word that a newer generation is published."""
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
    # The commit point: every collective of the step comes before the optimizer changes any state, so a
    # failed collective leaves this rank at the previous step, whole (in-place recovery redoes the step).
    if reduce is None:
        dist.all_reduce(total)
    else:
        total = reduce(total)
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return total.item() / (len(batches) * dist.get_world_size())


def _check_vocab(stream: data.TokenStream, cfg: GPTConfig) -> None:
    if stream.vocab_size is None:  # token arrays declare no vocabulary: each step's ids are checked instead
        stream.id_limit = cfg.vocab_size
    elif stream.vocab_size > cfg.vocab_size:
        raise DataError(f"shards use vocab_size {stream.vocab_size} but the model has --vocab-size {cfg.vocab_size}")


def _step_line(step: int, metrics: dict[str, float]) -> str:
    return (
        f"step {step} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
        f"ms {metrics['step_ms']:.1f} tok/s {metrics['tokens_per_s']:.0f}"
    )


def _model_config(args: argparse.Namespace) -> GPTConfig:
    """The model's shape, or a one-line ``SpecError``: it comes from the pipeline spec."""
    try:
        return GPTConfig(args.vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads)
    except ValueError as exc:
        raise SpecError([str(exc)]) from exc


def _plan(ctx: runtime.RunContext, micro_batch: int | None) -> BatchPlan:
    """The batch split over the current group, or a one-line ``SpecError``.

    ``micro_batch`` is the generation's (None: the context's); the global batch is kept.
    """
    try:
        runtime.follow_batch(ctx, micro_batch=micro_batch)  # the supervisor may say the global batch is kept
        return batch_plan(ctx, micro_batch)
    except ValueError as exc:
        raise SpecError([str(exc)]) from exc


def wrap(model: torch.nn.Module, placement: device.Placement) -> DDP:
    """The model on its device, in DDP (one GPU per process: ``device_ids`` is this rank's)."""
    if placement.cuda:
        return DDP(model.to(placement.device), device_ids=[placement.index], output_device=placement.index)
    return DDP(model)


def train(
    args: argparse.Namespace, ctx: runtime.RunContext, placement: device.Placement | None = None
) -> dict[str, float]:
    """Train from the resume point to ``ctx.max_steps``; return the last step's metrics.

    One loop for every run, through the elastic group (``trainyard.runtime.group``): one generation in
    torchrun's world; with ``TRAINYARD_STORE`` one per regroup (a node a generation leaves out returns
    without finishing). Thanks to the commit point in ``train_step`` the model and optimizer always hold
    the last step this rank completed, so a regroup redoes at most the failed step.
    """
    placement = placement or device.current()
    cfg = _model_config(args)
    torch.manual_seed(ctx.seed)  # seeds CUDA too; the weights are drawn on the CPU, so both paths start equal
    # Some CUDA kernels (NLLLoss's) have no deterministic variant: warn there rather than fail the run.
    torch.use_deterministic_algorithms(True, warn_only=placement.cuda)
    stream = data.TokenStream.open(ctx.data_dir, args.data_dtype)
    _check_vocab(stream, cfg)
    # Built before the first generation: a spare is ready to train the moment one lists it.
    module = GPT(cfg).to(placement.device)
    optimizer = build_optimizer(module, args)
    state: dict[str, Any] = {"train": runtime.TrainState(module, optimizer)}
    group = runtime.elastic_group(ctx, state, wrap=lambda: wrap(module, placement))
    drills = Drills(ctx)  # one for the process: what it already did stays done across generations
    checkpoints = runtime.Checkpointer(ctx, on_commit=drills.after_checkpoint)
    metrics: dict[str, float] = {}
    while group.form():
        plan = _plan(ctx, group.micro_batch)
        drills.at_rank(plan.rank)
        if plan.rank == 0:
            log.info(
                "model %d params, world %d, global batch %d = %d micro x %d accum x %d ranks, from step %d, on %s (%s%s)",
                module.num_params(), plan.world_size, plan.global_batch, plan.micro_batch, plan.accumulation,
                plan.world_size, group.step, placement.device, placement.backend,
                ", bf16 autocast" if placement.autocast_dtype else "",
            )  # fmt: skip
        seconds = 0.0
        with group.guard(checkpoints):
            for step in group.steps():
                drills.before_step(step, seconds)
                began = time.perf_counter()
                batches = data.micro_batches(stream, plan, step, ctx.seed, cfg.seq_len, placement.device)
                loss = train_step(group.model, optimizer, batches, lr_at(step, args), args.grad_clip, placement,
                                  reduce=group.all_reduce)  # fmt: skip
                loss = drills.loss(step, loss)
                group.commit(step)
                seconds = time.perf_counter() - began
                metrics = _after_step(step, loss, seconds, args, ctx, cfg, plan, checkpoints, state)
    if not group.left_out:  # the group closed the checkpointer: the last save commits before "finished"
        runtime.finish(max(group.step, ctx.max_steps), metrics, ctx=ctx)
    return metrics


def _after_step(
    step: int,
    loss: float,
    seconds: float,
    args: argparse.Namespace,
    ctx: runtime.RunContext,
    cfg: GPTConfig,
    plan: BatchPlan,
    checkpoints: runtime.Checkpointer,
    state: dict[str, Any],
) -> dict[str, float]:
    """A trained step's metrics, heartbeat and log line (rank 0), then its checkpoint where one is due."""
    metrics = {
        "loss": loss, "lr": lr_at(step, args), "step_ms": seconds * 1e3,
        "tokens_per_s": plan.global_batch * cfg.seq_len / seconds,
    }  # fmt: skip
    runtime.heartbeat(step, metrics, ctx=ctx)
    if plan.rank == 0:
        print(_step_line(step, metrics), flush=True)
    if not math.isfinite(loss):
        # Never checkpoint a diverged model; the supervisor rolls back to the last valid one.
        raise TrainingFailed(f"loss is {loss} at step {step}", kind="diverged")
    if ctx.should_checkpoint(step):
        checkpoints.save(step, state, metrics, micro_batch=plan.micro_batch)
    return metrics


def init_process_group() -> device.Placement:
    """Join torchrun's process group (env://), or form a one-process group when run directly.

    Binds the process to its GPU first, where it has one, and returns where it computes.
    With ``TRAINYARD_STORE`` set no group is formed here: each generation forms its own (gloo on the
    CPU, NCCL on a GPU: ``trainyard.runtime.collectives``).
    """
    placement = device.current()
    device.prepare(placement)
    if os.environ.get(STORE_ENV, "").strip():
        return placement
    bound = torch.device(placement.device) if placement.cuda else None  # NCCL connects at once, on this GPU
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(placement.backend, device_id=bound)
    else:
        dist.init_process_group(placement.backend, store=dist.HashStore(), rank=0, world_size=1, device_id=bound)
    return placement
