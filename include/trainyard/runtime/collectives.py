"""The collectives of one in-place generation: which backend, how it is formed, how a broken one is aborted.

A generation's group is NCCL where the rank computes on a GPU (``device.Placement``)
and gloo on the CPU. The two fail differently when a peer dies:

- gloo: the dead peer's sockets close, a blocked collective fails at once, and
  destroying the group is enough (what ``Membership.on_fault`` always did).
- NCCL: a collective with a dead peer may simply never finish (intra-node
  transports have no socket to close), and by default PyTorch's watchdog then
  waits out the timeout and tears the whole process down (torchrun's agent even
  sets ``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``). A survivor must live and must not
  wait: so the generation's NCCL group is formed eagerly on the rank's device
  (``device_id``) with non-blocking communicators, the watchdog only cleans up
  (mode 2: abort the communicators, keep the process), and a ``HangWatch``
  thread aborts the communicators as soon as the supervisor's next generation
  says a member is gone (NVIDIA's nvidia-resiliency-ext aborts from a monitor
  thread the same way; torchft aborts its ``ProcessGroupNCCL`` on a timeout of
  its own). The aborted collective returns (NCCL ends its kernels); the next
  ``raise_if_aborted`` or collective raises a failed-collective error, and the
  group's regroup path takes it from there, never the NCCL timeout.

Everything here but ``abort``/``HangWatch`` is a pure decision, table-tested on a CPU machine.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from trainyard.protocol.coordstore import Generation
from trainyard.runtime.device import Placement

log = logging.getLogger("trainyard.workload")

# What a failed collective says. gloo's: a RuntimeError without them is the script's own bug, not a lost peer.
GLOO_SIGNS = ("gloo", "connection reset", "connection closed", "timed out", "broken pipe", "socket", "pair.cc")
# NCCL's (ProcessGroupNCCL.cpp, NCCLUtils.hpp): an aborted communicator, a remote peer or network gone, the
# watchdog's timeout, the error it leaves for the next call. Most arrive as DistBackendError already.
NCCL_SIGNS = (
    "nccl communicator was aborted",
    "ncclremoteerror",
    "remote process exited or there was a network error",
    "watchdog caught collective operation timeout",
    "some nccl operations have failed or timed out",
    "ncclsystemerror",
    "nccl error",
    "process group watchdog thread terminated",
)

# The NCCL environment of an in-place generation (read when ProcessGroupNCCL is built; set before it is).
# Abort the communicators on an error or at the timeout, keep the process (1, torchrun's, would kill it). Not 0,
# which ``_abort_process_group``'s note suggests: a second abort is harmless (an aborted NCCLComm returns), and
# the watchdog's still ends a hang that no generation announces, at the collective timeout.
ASYNC_ERROR_CLEANUP_ONLY = "2"


def nccl_env(timeout_s: float) -> dict[str, str]:
    """The ``TORCH_NCCL_*`` settings an in-place NCCL generation needs, whatever the launcher set."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": ASYNC_ERROR_CLEANUP_ONLY,
        "TORCH_NCCL_BLOCKING_WAIT": "0",  # the step waits on the stream; an abort, not a wait(), ends a hang
        "TORCH_NCCL_USE_COMM_NONBLOCKING": "1",  # init and abort never block inside NCCL (ncclCommAbort works)
        "TORCH_NCCL_NONBLOCKING_TIMEOUT": str(max(1, round(timeout_s))),  # else 30 min (torchft sets it too)
        "TORCH_NCCL_RETHROW_CUDA_ERRORS": "0",  # the watchdog must not rethrow into (and kill) a survivor (NVRx)
    }


@dataclass(frozen=True)
class GroupPlan:
    """How one generation's process group is formed."""

    backend: str
    """``nccl`` or ``gloo``."""
    timeout_s: float
    """The collective timeout: the last resort, never what a survivor waits for when the supervisor knows."""
    device_index: int | None = None
    """The CUDA device the NCCL communicator is created on, eagerly (``device_id``); None on CPU."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment set before the group is formed."""

    @property
    def nccl(self) -> bool:
        return self.backend == "nccl"

    @property
    def init_backend(self) -> str:
        """What ``init_process_group`` is given. NCCL takes the GPU's tensors; the CPU's (the committed steps
        and the state a joiner receives, ``elastic.sync_state``) go over gloo in the same group."""
        return "cpu:gloo,cuda:nccl" if self.nccl else self.backend

    def init_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``dist.init_process_group`` beside the store, rank and world size."""
        kwargs: dict[str, Any] = {"backend": self.init_backend, "timeout": timedelta(seconds=self.timeout_s)}
        if self.device_index is not None:
            kwargs["device_id"] = torch.device("cuda", self.device_index)  # eager init: fail at form, not step 1
            if (options := nccl_options()) is not None:
                kwargs["pg_options"] = options
        return kwargs


def plan(placement: Placement, timeout_s: float) -> GroupPlan:
    """The group of a generation for a rank placed at ``placement``: NCCL on its GPU, else gloo."""
    if placement.cuda:
        return GroupPlan("nccl", timeout_s, placement.index, nccl_env(timeout_s))
    return GroupPlan("gloo", timeout_s)


def nccl_options() -> Any | None:
    """``ProcessGroupNCCL.Options`` with non-blocking communicators (torchft's ``config.blocking = False``);
    None where this torch has no NCCL (the environment variable says the same)."""
    if not dist.is_nccl_available():
        return None
    options = dist.ProcessGroupNCCL.Options()
    options.config.blocking = False
    return options


def apply(group_plan: GroupPlan, environ: MutableMapping[str, str]) -> None:
    """Set ``group_plan``'s environment (NCCL reads it when the group is built)."""
    environ.update(group_plan.env)


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a failed collective (a lost or silent peer) rather than an error of the script."""
    if isinstance(exc, torch.OutOfMemoryError):
        return False  # CUDA OOM is its own kind (a smaller micro-batch), never a lost peer
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(s in text for s in GLOO_SIGNS + NCCL_SIGNS)


def peers_lost(current: Generation, newer: Generation | None) -> list[str]:
    """Members of ``current`` whose process the supervisor's ``newer`` generation says is gone: left out, or
    listed again as joiners (started anew). A generation that only adds members (the world grows) loses none:
    it is taken at a step boundary, nothing is aborted."""
    if newer is None or newer.number <= current.number:
        return []
    return [m for m in current.members if m not in newer.members or m in newer.joiners]


def _group_is_live() -> bool:
    return dist.is_available() and dist.is_initialized()


def abort_nccl() -> str:
    """Abort every communicator of the current world and forget its groups, without waiting on them."""
    if not _group_is_live():
        return "gone"
    try:
        dist.distributed_c10d._abort_process_group()  # the world: each group aborted, in one NCCL group call
    except ValueError:  # "Invalid process group specified or has been destroyed": another path got there first
        return "gone"
    return "aborted"


def destroy_gloo() -> str:
    """Destroy the world's groups: a broken gloo group fails its blocked peers when its sockets close."""
    if not _group_is_live():
        return "gone"
    dist.destroy_process_group()
    return "destroyed"


ABORTS: dict[str, Callable[[], str]] = {"nccl": abort_nccl, "gloo": destroy_gloo}


def abort(backend: str) -> str:
    """Tear down the current world's broken group of ``backend``; what was done (``gone``: nothing was left)."""
    try:
        how = ABORTS[backend]
    except KeyError:
        raise ValueError(f"no abort for backend {backend!r}; known: {sorted(ABORTS)}") from None
    return how()


def abort_communicators(group: Any) -> bool:
    """Abort ``group``'s communicators in place (from another thread, while a collective may block on them),
    leaving the group registered, so the blocked call returns and the next one raises
    ``DistBackendError`` ("NCCL communicator was aborted"). False when there was nothing to abort."""
    if group is None or not hasattr(group, "abort"):
        return False
    group.abort()
    return True


def backend_error(group: Any) -> str | None:
    """What ``group``'s NCCL backend says went wrong (``TIMEOUT``, ``COMM_ERROR``, ``REMOTE_ERROR``: its watchdog
    found an error and cleaned up), None when nothing did or the group has no NCCL backend (gloo raises at once)."""
    try:
        error = group._get_backend(torch.device("cuda")).get_error()
    except (AttributeError, NotImplementedError, RuntimeError):  # no CUDA backend, or one without get_error
        return None
    name = str(getattr(error, "name", error))
    return None if name == "SUCCESS" else name


class HangWatch:
    """A thread that aborts a generation's communicators once ``lost()`` names a peer (polled every ``poll_s``).

    ``abort`` runs at most once; ``fired`` tells the loop that the current step's collectives are void, as
    does ``error()`` (the backend's own watchdog found an error: ``backend_error``)."""

    def __init__(
        self,
        lost: Callable[[], list[str]],
        abort: Callable[[], object],
        poll_s: float,
        name: str = "",
        error: Callable[[], str | None] = lambda: None,
    ):
        self._lost, self._abort, self.poll_s, self._error = lost, abort, poll_s, error
        self._stop = threading.Event()
        self.fired: list[str] = []
        self._thread = threading.Thread(target=self._run, name=f"trainyard-hang-watch{name}", daemon=True)

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self.poll_s + 1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                gone = self._lost()
            except Exception as exc:  # the store is gone: the supervisor is, too; the collective timeout ends it
                log.warning("hang watch: cannot read the coordination store (%s); stopping", exc)
                return
            if gone:
                self.fired = gone
                log.warning("peers %s are gone: aborting this generation's communicators", gone)
                self._abort()
                return

    def raise_if_fired(self) -> None:
        """Raise a failed-collective error if the watch aborted the group (the step's results are void)."""
        if self.fired:
            raise dist.DistBackendError(f"NCCL communicator was aborted: peers {self.fired} are gone")
        if error := self._error():  # without blocking wait, a step's sums come back even when NCCL failed them
            raise dist.DistBackendError(f"NCCL communicator was aborted: the backend reports {error}")


def form(store: dist.Store, rank: int, world: int, timeout_s: float, placement: Placement) -> GroupPlan:
    """Form one generation's group as the world of this process (``Membership.form``'s one call here)."""
    group_plan = plan(placement, timeout_s)
    apply(group_plan, os.environ)
    dist.init_process_group(store=store, rank=rank, world_size=world, **group_plan.init_kwargs())
    return group_plan


def watch(
    group_plan: GroupPlan, gen: Generation, newest: Callable[[], Generation | None], poll_s: float
) -> HangWatch | None:
    """For an NCCL generation, a started ``HangWatch`` that aborts the world's communicators once the
    supervisor's newest generation (``newest()``) loses a member of ``gen``; None for gloo (sockets close)."""
    if not group_plan.nccl:
        return None
    world = dist.group.WORLD
    return HangWatch(
        lambda: peers_lost(gen, newest()),
        lambda: abort_communicators(world),
        poll_s,
        f"-g{gen.number}",
        error=lambda: backend_error(world),
    ).start()
