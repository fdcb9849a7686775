"""The measurements a candidate node makes of itself, each bounded in time.

Pure measuring functions: no processes, no stores. ``throttle`` lets a drill
make a node slow on purpose (it sleeps a share of every timed operation), so
rehearsals exercise the same code path as a real straggler.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch


class Throttle:
    """Lose ``factor`` of throughput: each operation of t seconds owes t * f / (1 - f) of sleep.

    The debt is paid in sleeps of at least a millisecond: sleeping after every
    microsecond-long operation would overshoot by the timer's slack. Each
    measurement settles its own debt (``start``, ``settle``): a sleep that
    overran on a busy host left a credit that let the next probe's whole
    30 ms window run unthrottled, and a 20% drill measured 0.95 in that turn.
    """

    def __init__(self, factor: float = 0.0):
        self.factor = factor
        self.debt = 0.0

    def start(self) -> None:
        """A new measurement: what an earlier one owed, or was owed, is not this one's."""
        self.debt = 0.0

    def settle(self) -> None:
        """Pay what is still owed before the measurement's clock stops."""
        if self.factor > 0 and self.debt > 0:
            time.sleep(self.debt)
        self.debt = 0.0

    def after(self, seconds: float) -> None:
        if self.factor <= 0:
            return
        self.debt += seconds * self.factor / (1 - self.factor)
        if self.debt >= 1e-3:
            began = time.perf_counter()
            time.sleep(self.debt)
            self.debt -= time.perf_counter() - began


NO_THROTTLE = Throttle()


def timed_loop(
    op: Callable[[], object], budget_s: float, throttle: Throttle = NO_THROTTLE, windows: int = 5
) -> tuple[int, float]:
    """Run ``op`` for ``budget_s`` in ``windows`` equal windows; the median window's (iterations, seconds).

    The median window, neither the mean nor the best: on a shared machine a
    burst of someone else's work slows a window, and on a virtual machine a
    burst of borrowed speed (a sibling idle, a clock boost) speeds one up by a
    third; both are one window's luck. A slow node is slow in all of them, and
    a throttled one loses its share in each.
    """
    op()  # warm-up: first call pays for allocation and kernel choice
    runs = [_window(op, budget_s / max(1, windows), throttle) for _ in range(max(1, windows))]
    ranked = sorted(runs, key=lambda run: run[0] / run[1])  # stable: of equal rates, the earlier window
    return ranked[(len(ranked) - 1) // 2]


def _window(op: Callable[[], object], seconds: float, throttle: Throttle) -> tuple[int, float]:
    """Run ``op`` until ``seconds`` have passed: (iterations, seconds taken)."""
    iters, start = 0, time.perf_counter()
    throttle.start()
    while True:
        began = time.perf_counter()
        op()
        throttle.after(time.perf_counter() - began)
        iters += 1
        if time.perf_counter() - start >= seconds:
            throttle.settle()
            return iters, time.perf_counter() - start


def matmul_gflops(
    size: int,
    budget_s: float,
    throttle: Throttle = NO_THROTTLE,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    windows: int = 5,
) -> float:
    """Sustained matmul throughput (fp32 on CPU; bf16 on GPU)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def op() -> None:
        torch.mm(a, b)
        sync()

    iters, seconds = timed_loop(op, budget_s, throttle, windows)
    return 2.0 * size**3 * iters / seconds / 1e9


def memory_gbps(megabytes: int, budget_s: float, throttle: Throttle = NO_THROTTLE, windows: int = 5) -> float:
    """Copy bandwidth of host memory: each copy reads and writes the buffer once."""
    src = torch.empty(megabytes << 18, dtype=torch.float32).fill_(1.0)  # megabytes << 18 floats = megabytes MiB
    dst = torch.empty_like(src)
    iters, seconds = timed_loop(lambda: dst.copy_(src), budget_s, throttle, windows)
    return 2 * src.numel() * 4 * iters / seconds / 1e9


def disk_mbps(
    directory: Path, megabytes: int, budget_s: float, throttle: Throttle = NO_THROTTLE
) -> tuple[float, float]:
    """Write (fsync'd) then read back a scratch file in ``directory``; (write MB/s, read MB/s).

    The read drops the file from the page cache first, so it measures the
    device rather than memory. The scratch file never outlives the probe.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f".burnin-{uuid.uuid4().hex[:8]}"
    block = os.urandom(1 << 20)
    written, start = 0, time.perf_counter()
    throttle.start()
    try:
        with path.open("wb") as fh:
            while written < megabytes << 20 and time.perf_counter() - start < budget_s / 2:
                began = time.perf_counter()
                fh.write(block)
                throttle.after(time.perf_counter() - began)
                written += len(block)
            fh.flush()
            os.fsync(fh.fileno())
            throttle.settle()
        write_s = time.perf_counter() - start
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            start, read = time.perf_counter(), 0
            while chunk := os.read(fd, 1 << 20):
                began = time.perf_counter()
                read += len(chunk)
                throttle.after(time.perf_counter() - began)
            throttle.settle()
            read_s = time.perf_counter() - start
        finally:
            os.close(fd)
    finally:
        path.unlink(missing_ok=True)
    return written / write_s / 1e6, read / max(read_s, 1e-9) / 1e6


def busbw_gbps(nbytes: int, budget_s: float, throttle: Throttle = NO_THROTTLE) -> float:
    """All-reduce bus bandwidth over the current process group (the nccl-tests convention).

    Every rank must run the same number of collectives, so rank 0 turns the
    time budget into an iteration count and broadcasts it.
    """
    import torch.distributed as dist

    world = dist.get_world_size()
    tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    dist.all_reduce(tensor)  # warm-up: connections and buffers
    began = time.perf_counter()
    dist.all_reduce(tensor)
    count = torch.tensor([max(1, int(budget_s / max(time.perf_counter() - began, 1e-6)))])
    dist.broadcast(count, src=0)
    began = time.perf_counter()
    for _ in range(int(count)):
        op_began = time.perf_counter()
        dist.all_reduce(tensor)
        throttle.after(time.perf_counter() - op_began)
    elapsed = torch.tensor([(time.perf_counter() - began) / int(count)])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # one figure for the group: the slowest rank's
    return 2 * (world - 1) / world * tensor.numel() * 4 / float(elapsed) / 1e9 if world > 1 else 0.0


def pair_gbps(
    peer: int, leads: bool, nbytes: int, budget_s: float, throttle: Throttle = NO_THROTTLE, windows: int = 3
) -> float:
    """Bandwidth between this rank and ``peer`` alone: ``nbytes`` each way per round trip, in GB/s.

    A ping-pong over the default group's point-to-point channel: the leading
    side sends first and decides how many round trips fit a window, so both
    sides run the same count. A slow link (or NIC) on either side slows it.
    The best of ``windows`` windows, as ``timed_loop``: a burst of someone
    else's traffic slows one window, a slow link all of them.
    """
    import torch.distributed as dist

    tensor = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    # A drill's sleep must hold the peer up, as a slow link does: it falls
    # between this side's receive and its next send, while the peer waits to
    # receive. Slept after a send, it overlapped the leader's next send (which
    # gloo buffers), and a follower drilled to half speed measured 0.7.
    sent = [time.perf_counter()]

    def round_trip() -> None:
        if leads:
            began = time.perf_counter()
            dist.send(tensor, peer)
            dist.recv(tensor, peer)
            throttle.after(time.perf_counter() - began)
        else:
            dist.recv(tensor, peer)
            throttle.after(time.perf_counter() - sent[0])
            sent[0] = time.perf_counter()
            dist.send(tensor, peer)

    round_trip()  # warm-up: the pair's connection and buffers
    began = time.perf_counter()
    round_trip()
    count = torch.tensor([max(1, int(budget_s / windows / max(time.perf_counter() - began, 1e-6)))])
    if leads:
        dist.send(count, peer)
    else:
        dist.recv(count, peer)
    best = 0.0
    for _ in range(windows):
        began = time.perf_counter()
        for _ in range(int(count)):
            round_trip()
        best = max(best, 2 * tensor.numel() * 4 * int(count) / (time.perf_counter() - began) / 1e9)
    return best
