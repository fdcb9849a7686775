"""Where a rank of the reference workload computes: its device, its collective backend, its autocast.

``choose`` is pure (CUDA's presence and device count in, a ``Placement``
out), so the GPU path is decided the same way, and tested, on a machine
without one. With CUDA, rank ``LOCAL_RANK`` of a node takes ``cuda:LOCAL_RANK``
of the devices the launcher left visible (``CUDA_VISIBLE_DEVICES``: the local
backend gives each simulated node its own GPUs, Kubernetes gives each pod its
``nvidia.com/gpu``), talks NCCL, and runs forward passes under bf16 autocast;
without CUDA it is the CPU and gloo. Parameters, gradients and optimizer
state stay fp32 either way, so a checkpoint does not depend on the device.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

import torch

# cuBLAS is deterministic only with a fixed workspace; it reads this when CUDA first creates a handle.
CUBLAS_WORKSPACE = ":4096:8"


class CudaInfo(Protocol):
    """The part of ``torch.cuda`` a placement reads (a test passes a fake)."""

    def is_available(self) -> bool: ...

    def device_count(self) -> int: ...


@dataclass(frozen=True)
class Placement:
    device: str
    """``cpu`` or ``cuda:N``."""
    backend: str
    """Process-group backend: ``gloo`` on CPU, ``nccl`` on CUDA."""
    autocast_dtype: torch.dtype | None = None
    """Forward-pass compute dtype (bf16 on CUDA); None: full precision."""

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def index(self) -> int | None:
        """The CUDA device index, for ``set_device`` and DDP's ``device_ids``; None on CPU."""
        return int(self.device.split(":")[1]) if self.cuda else None

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """The forward pass's precision context (a no-op without ``autocast_dtype``)."""
        if self.autocast_dtype is None:
            yield
            return
        with torch.autocast(device_type=self.device.split(":")[0], dtype=self.autocast_dtype):
            yield


CPU = Placement("cpu", "gloo")


def choose(cuda_available: bool, device_count: int, local_rank: int) -> Placement:
    """The placement of local rank ``local_rank``; ``ValueError`` when it has no GPU of its own."""
    if not cuda_available or device_count < 1:
        return CPU
    if not 0 <= local_rank < device_count:
        raise ValueError(
            f"LOCAL_RANK {local_rank} has no GPU of its own: {device_count} visible to this node; run one rank"
            f" per GPU: nodes.procs_per_node equal to the GPUs per node (nodes.gpus_per_node, or"
            f" nodes.kubernetes.gpus on Kubernetes)"
        )
    return Placement(f"cuda:{local_rank}", "nccl", torch.bfloat16)


def local_ranks(env: Mapping[str, str]) -> tuple[int, int]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` as the launcher set them ((0, 1) where it set neither: one rank per
    node); ``ValueError`` names the variable that is malformed."""
    raw_rank, raw_world = env.get("LOCAL_RANK", "0"), env.get("LOCAL_WORLD_SIZE", "1")
    if not (raw_rank.isdigit() and raw_world.isdigit()) or not 0 <= int(raw_rank) < int(raw_world):
        raise ValueError(
            f"LOCAL_RANK={raw_rank!r}, LOCAL_WORLD_SIZE={raw_world!r}: need 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE"
            " (the launcher sets both)"
        )
    return int(raw_rank), int(raw_world)


def current(env: Mapping[str, str] | None = None, cuda: CudaInfo = torch.cuda) -> Placement:
    """This process's placement: torchrun's ``LOCAL_RANK`` (0 when run directly) and the visible GPUs."""
    local_rank, _ = local_ranks(os.environ if env is None else env)
    available = cuda.is_available()
    return choose(available, cuda.device_count() if available else 0, local_rank)


def prepare(placement: Placement) -> None:
    """Bind this process to its GPU before any CUDA work (NCCL and object collectives use the current device)."""
    if placement.cuda:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.cuda.set_device(placement.index)
