"""The bench's workload under NVIDIA's nvidia-resiliency-ext 0.4.1 in-process restart (``inprocess.Wrapper``).

    MASTER_ADDR=127.0.0.1 MASTER_PORT=P RANK=1 WORLD_SIZE=3 TRAINYARD_NODE=node-1 ... \\
        python bench/peers/nvrx_peer.py --seq-len 128 ...

Started by ``bench/recovery.py``, one plain process per node (NVRx does not run under torchrun's agent).
The bench hosts NVRx's TCPStore on ``MASTER_PORT`` before the nodes start: its rank 0, which would host
it, finds the port taken and joins as a client, and the store's subclass below names no critical rank,
so no node's death takes the store down.

The wrapped function is NVRx's contract: re-callable, it forms its own process group (gloo, from the
hosted store, under a prefix per restart iteration, with a 5 s timeout), and keeps the model and
optimizer outside itself (in memory across restarts: NVRx recommends reloading a checkpoint, which would
cost a read per restart). Every collective of a step happens before ``optimizer.step()`` (the gradient
all-reduce, then the loss's), so a fault leaves the last committed step's state and the step in flight
is run again; the optimizer step and the committed step's update are one ``atomic`` section (NVRx raises
its restart into the main thread asynchronously). On a restart the survivors' ranks are shifted
(``ShiftRanks``), DDP is rebuilt over the same model (its constructor broadcasts rank 0's parameters)
and the committed steps are compared (rank 0's optimizer state is sent where they differ).

What NVRx does on a fault, and why it works on gloo here: the killed rank's monitor process sees it
gone and records the interruption in the store; the survivors' gloo all-reduce fails at once (its
socket closed), the exception is recorded too, every rank's monitor thread calls ``abort`` (here:
destroy the process group; NVRx's own ``AbortTorchDistributed`` aborts NCCL backends only, gloo's
in-flight collectives cannot be aborted), waits at the store's iteration barrier and calls the function
again. A *hung* peer (SIGSTOP) would not be unblocked that way on gloo: only the 5 s collective timeout
or NVRx's soft/hard timeouts end it.
"""

import os
import sys
import time
from contextlib import nullcontext
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from common import Workload, workload
from torch.nn.parallel import DistributedDataParallel as DDP

from trainyard.workload.loop import lr_at


class Holder:
    """What survives a restart besides the model and optimizer: the last committed step, the fault noted."""

    committed = 0
    faulted = False


def wrapped(w: Workload):  # the wrapped function's type is NVRx's
    from nvidia_resiliency_ext import inprocess

    class HostedStore(inprocess.store.TCPStore):
        """NVRx's TCPStore, hosted by the bench: no rank is critical to it (NVRx's names rank 0)."""

        @property
        def critical_ranks(self) -> tuple[int, ...]:
            return ()

    class DestroyGloo(inprocess.abort.Abort):
        """Destroy the process group (NVRx's abort shuts NCCL backends down, then does the same)."""

        def __call__(self, state: "inprocess.FrozenState") -> "inprocess.FrozenState":
            if dist.is_initialized():
                dist.destroy_process_group()
            return state

    holder = Holder()
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    pids = Path(os.environ["TRAINYARD_PEERS_PIDS"])

    @inprocess.Wrapper(
        store_factory=HostedStore,
        store_kwargs={"host_name": host, "port": port, "timeout": timedelta(seconds=60), "wait_for_workers": False},
        abort=DestroyGloo(),
        monitor_thread_interval=timedelta(seconds=0.1),
        monitor_process_interval=timedelta(seconds=0.1),
        heartbeat_interval=timedelta(seconds=0.2),
        progress_watchdog_interval=timedelta(seconds=0.1),
        last_call_wait=timedelta(seconds=0.2),
        soft_timeout=timedelta(seconds=15),
        hard_timeout=timedelta(seconds=20),
        heartbeat_timeout=timedelta(seconds=5),
        barrier_timeout=timedelta(seconds=60),
        completion_timeout=timedelta(seconds=60),
        termination_grace_time=timedelta(seconds=0),
    )
    def train(call_wrapper: inprocess.CallWrapper | None = None) -> None:
        assert call_wrapper is not None  # NVRx passes it by its annotation
        iteration = call_wrapper.iteration
        if iteration == 0:  # NVRx's monitor detaches itself: the bench kills it by this id at the end
            pids.mkdir(parents=True, exist_ok=True)
            (pids / w.ctx.node).write_text(str(call_wrapper.monitor_process.process_monitor_proc.pid))
        else:
            w.event("attempt_start", attempt=iteration + 1, world_size=int(os.environ["WORLD_SIZE"]))
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        client = dist.TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=60))
        store = dist.PrefixStore(f"trainyard-pg/{iteration}", client)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=5))
        model = DDP(w.model)  # broadcasts rank 0's parameters
        steps = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        dist.all_gather(steps, torch.tensor([holder.committed]))
        if len({int(s) for s in steps}) > 1:
            # A rank interrupted between its last collective and its commit is a step behind: rank 0's
            # optimizer state goes with rank 0's parameters (the usual case, all equal, costs nothing).
            box = [w.optimizer.state_dict() if rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            if rank != 0:
                w.optimizer.load_state_dict(box[0])
        start = steps[0]
        if iteration > 0:
            w.event("resumed", step=int(start), world_size=world, iteration=iteration)
        plan = w.plan(world, rank)
        try:
            for step in range(int(start) + 1, w.ctx.max_steps + 1):
                w.drill(step)
                began = time.perf_counter()
                for group in w.optimizer.param_groups:
                    group["lr"] = lr_at(step, w.args)
                w.optimizer.zero_grad(set_to_none=True)
                batches = w.batches(plan, step)
                total = torch.zeros(())
                for i, (inputs, targets) in enumerate(batches):
                    with nullcontext() if i == len(batches) - 1 else model.no_sync():
                        _, loss = model(inputs, targets)
                        (loss / len(batches)).backward()
                    total += loss.detach()
                dist.all_reduce(total)  # the step's last collective, before any state changes: the commit point
                torch.nn.utils.clip_grad_norm_(model.parameters(), w.args.grad_clip)
                with call_wrapper.atomic():  # NVRx's restart is not raised into this thread in between
                    w.optimizer.step()
                    holder.committed = step
                seconds = time.perf_counter() - began
                w.event("step", step=step, loss=total.item() / (len(batches) * world), lr=lr_at(step, w.args),
                        step_ms=seconds * 1e3, world_size=world)  # fmt: skip
                call_wrapper.ping()
        except BaseException:  # also NVRx's RankShouldRestart, raised into this thread when another rank saw it first
            if not holder.faulted:
                holder.faulted = True
                w.event("failure_classified", attempt=1, kind="node_lost", detected_at=time.time())
            raise
        w.event("finished", step=holder.committed)
        dist.destroy_process_group()

    return train


def main(argv: list[str]) -> None:
    w = workload(argv)
    try:
        train = wrapped(w)
    except ImportError as exc:  # the bench checks first; this names the package for a hand-run
        sys.exit(f"nvidia-resiliency-ext is not installed ({exc}): pip install -r requirements-bench.txt")
    train()


if __name__ == "__main__":
    main(sys.argv[1:])
