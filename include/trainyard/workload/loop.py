"""The reference training loop: DDP over the staged token shards, on GPUs (NCCL, bf16) or CPUs (gloo).

Run it with torchrun; every setting except the model shape comes from the
TRAINYARD_* environment (see ``trainyard.runtime.core``). One node, two
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

With ``TRAINYARD_STORE=host:port`` (the supervisor's coordination store,
``trainyard.protocol.coordstore``) the process forms no group from torchrun:
it trains as a member of the generations the supervisor publishes and, when a
peer is lost, regroups in place with the survivors and redoes the failed step
(``train_elastic``, ``trainyard.runtime.elastic``).

The loop is deterministic: the model is seeded, batches are a pure function of
(seed, step) (``trainyard.workload.data``) and the learning rate is a function of
the step alone, so a resumed run reproduces the uninterrupted one and a run can
resume on a different world size with the same global batch.
"""

from __future__ import annotations

import argparse
import hashlib
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

from trainyard import runtime
from trainyard.errors import DataError, SpecError, TrainingFailed
from trainyard.runtime import device, elastic
from trainyard.runtime.drills import Drills
from trainyard.workload import data
from trainyard.workload.model import GPT, GPTConfig

log = logging.getLogger("trainyard.workload")
STORE_ENV = "TRAINYARD_STORE"  # declared by ``TrainEnv.store``
SPARE_WAIT_S = 24 * 3600.0  # a node not yet listed is a spare: it waits until used or killed with the attempt


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Model and optimizer flags; run settings (steps, batch, paths) come from the environment."""
    p = argparse.ArgumentParser(prog="python -m trainyard.workload", description=__doc__.split("\n\n")[0])
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
    news: torch.Tensor | None = None,
) -> float:
    """One optimizer step over this rank's micro-batches; returns the loss averaged over the global batch.

    ``news`` (a 1-element tensor) is summed over the ranks in the same all-reduce as the loss, in place: the
    elastic loop's word that a newer generation is published, so every rank learns it at the same step."""
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
    if news is None:
        dist.all_reduce(total)
    else:  # one collective for both: a second would cost a round trip per step
        both = torch.cat([total.reshape(1), news.to(total.device, total.dtype)])
        dist.all_reduce(both)
        total, _ = both[0], news.copy_(both[1:])
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()
    return total.item() / (len(batches) * dist.get_world_size())


def _check_vocab(stream: data.TokenStream, cfg: GPTConfig) -> None:
    if stream.vocab_size > cfg.vocab_size:
        raise DataError(f"shards use vocab_size {stream.vocab_size} but the model has --vocab-size {cfg.vocab_size}")


def _step_line(step: int, metrics: dict[str, float]) -> str:
    return (
        f"step {step} loss {metrics['loss']:.4f} lr {metrics['lr']:.2e} "
        f"ms {metrics['step_ms']:.1f} tok/s {metrics['tokens_per_s']:.0f}"
    )


def _configure(
    args: argparse.Namespace, ctx: runtime.RunContext, micro_batch: int | None = None
) -> tuple[GPTConfig, data.BatchPlan]:
    """Model shape and batch split, or a one-line ``SpecError``: both come from the pipeline spec.

    ``micro_batch`` overrides the context's (an elastic generation's own); the global batch is kept.
    """
    try:
        cfg = GPTConfig(args.vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads)
        micro = micro_batch or ctx.micro_batch
        plan = data.BatchPlan.for_world(ctx.global_batch, micro, dist.get_world_size(), dist.get_rank())
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
    """Train from the resume point to ``ctx.max_steps``; return the last step's metrics.

    With ``TRAINYARD_STORE`` set the run recovers in place (``train_elastic``).
    """
    if ctx.store is not None:
        return train_elastic(args, ctx)
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
            metrics = _after_step(step, loss, seconds, args, ctx, cfg, plan, checkpoints, state)
    except BaseException:
        checkpoints.close(wait=False)  # a save in flight may wait on a dead peer: fail now, not at its timeout
        raise
    checkpoints.close()  # the last save commits before "finished"
    runtime.finish(max(start, ctx.max_steps), metrics, ctx=ctx)
    return metrics


def _after_step(
    step: int,
    loss: float,
    seconds: float,
    args: argparse.Namespace,
    ctx: runtime.RunContext,
    cfg: GPTConfig,
    plan: data.BatchPlan,
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
    With ``TRAINYARD_STORE`` set no group is formed here: each generation forms its own
    (``trainyard.runtime.elastic``).
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


def params_digest(model: torch.nn.Module) -> str:
    """A short hash of the parameters: equal on every rank of a healthy data-parallel run."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _unwrap(model: DDP | None) -> None:
    """Detach a generation's DDP from the parameters before its group goes (the reducer's hooks would use
    the dead group). The caller then drops the DDP: it holds the group alive."""
    if model is not None and hasattr(model, "reducer"):
        model.reducer._remove_autograd_hooks()


def train_elastic(args: argparse.Namespace, ctx: runtime.RunContext) -> dict[str, float]:
    """Train as a member of the generations on ``ctx.store``; regroup in place after a failed collective.

    The model and optimizer live across generations: thanks to the commit point in ``train_step`` they
    always hold the last step this rank completed. A failed step is redone once in the next generation
    (at most one step lost); a second failure of the same step ends the process. A node the next
    generation leaves out returns at once (exit 0). A generation published while this one trains (the
    world grows back: spares or re-admitted nodes join) is taken at the next step boundary by every rank
    at once: rank 0 reads the store and the step's own all-reduce carries the word. CPU and gloo only.
    """
    assert ctx.store is not None
    group = elastic.ElasticGroup.connect(ctx.store, ctx.node, ctx.collective_timeout_s, attempt=ctx.attempt)
    torch.manual_seed(ctx.seed)
    torch.use_deterministic_algorithms(True)
    cfg = GPTConfig(args.vocab_size, args.seq_len, args.d_model, args.n_layers, args.n_heads)
    stream = data.TokenStream.open(ctx.data_dir)
    _check_vocab(stream, cfg)
    module = GPT(cfg)
    optimizer = build_optimizer(module, args)
    # Built before waiting: a spare is ready to train the moment a generation lists it.
    gen = group.next_generation(timeout_s=SPARE_WAIT_S)
    assert gen is not None  # a process that was never a member waits on
    # Its first generation is the attempt's first: start from the checkpoint like every member; a later
    # one means this process joins a running world and receives the state.
    first_gen = gen.number
    committed = -1
    model: DDP | None = None
    metrics: dict[str, float] = {}
    failed_at: int | None = None
    fault_at: float | None = None
    drills: Drills | None = None
    while True:
        assert gen is not None
        group.form(gen)
        model = DDP(module)  # broadcasts rank 0's parameters: rank 0 is a survivor (see sync_state)
        state = {"train": TrainState(model, optimizer)}
        if gen.number == first_gen and first_gen == 1:
            committed = runtime.load_latest(state, ctx=ctx)
        elif ctx.node in gen.joiners:
            committed = -1
        committed = group.sync_state(state, committed)
        _, plan = _configure(args, ctx, gen.micro_batch)
        group.ready(committed)
        if gen.number > first_gen or ctx.node in gen.joiners:
            runtime.regrouped(gen.number, plan.micro_batch, committed, gen.joiners, ctx=ctx)
        rank = plan.rank
        regroup = f", {time.monotonic() - fault_at:.3f}s after the fault" if fault_at is not None else ""
        log.info("%s: generation %d, rank %d of %d, micro batch %d, from step %d, params %s%s", ctx.node,
                 gen.number, rank, plan.world_size, plan.micro_batch, committed, params_digest(module), regroup)  # fmt: skip
        if drills is None:
            drills = Drills(ctx, rank)
        drills.rank = rank  # one Drills for the process: what it already did stays done across generations
        checkpoints = runtime.Checkpointer(ctx, on_commit=drills.after_checkpoint)
        seconds = 0.0
        news = torch.zeros(1)
        grown = 0
        try:
            for step in range(committed + 1, ctx.max_steps + 1):
                drills.before_step(step, seconds)
                began = time.perf_counter()
                batches = data.micro_batches(stream, plan, step, ctx.seed, cfg.seq_len, "cpu")
                news.fill_(group.newer() if rank == 0 else 0)
                loss = train_step(model, optimizer, batches, lr_at(step, args), args.grad_clip, news=news)
                loss = drills.loss(step, loss)
                committed = step
                seconds = time.perf_counter() - began
                metrics = _after_step(step, loss, seconds, args, ctx, cfg, plan, checkpoints, state)
                if grown := int(news.item()):  # the world grows: every rank switches after this same step
                    break
            checkpoints.close()
        except Exception as exc:
            checkpoints.close(wait=False)
            if not elastic.is_collective_error(exc):
                raise
            failing = committed + 1
            if failed_at == failing:  # the redo failed too: more than one step would be lost
                raise TrainingFailed(
                    f"step {failing} failed again after regrouping ({exc}); giving up in-place recovery",
                    kind="transient",
                ) from exc
            failed_at = failing
            log.warning("%s: collective failed in step %d (%s); regrouping", ctx.node, failing, exc)
            runtime.heartbeat(committed, metrics, status="regrouping", ctx=ctx)
            runtime.flush_progress(ctx)  # the steps before the fault, while this rank's number still holds
            fault_at = time.monotonic()
            # Nothing may hold the broken group once it is destroyed: DDP (its reducer) does, and while
            # anything does its sockets stay open and a peer blocked on this rank waits out the collective
            # timeout instead of failing at once (measured: 20 s instead of 0.02 s).
            _unwrap(model)
            model = None
            del state
            group.on_fault(exc, keep=[checkpoints.group])
            gen = group.next_generation()
            if gen is None:
                log.info("%s: left out of the next generation; exiting", ctx.node)
                return metrics
            continue
        if grown and committed < ctx.max_steps:
            _unwrap(model)
            model = None  # the group's sockets close with its last reference (see the fault path)
            del state
            group.leave()
            gen = group.published(grown)
            if gen is None:
                log.info("%s: left out of generation %d; exiting", ctx.node, grown)
                return metrics
            log.info("%s: the world grows to generation %d at step %d", ctx.node, grown, committed)
            fault_at = None
            continue
        break
    log.info("%s: finished at step %d in generation %d, params %s",
             ctx.node, committed, gen.number, params_digest(module))  # fmt: skip
    runtime.finish(max(committed, ctx.max_steps), metrics, ctx=ctx)
    return metrics
