"""The collectives of an in-place generation, decided on a CPU machine: backend and options per placement,
which errors are a failed collective, which abort a backend gets, and the hang watch's one abort."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from waiting import wait_for

from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import Generation, node_keys
from trainyard.protocol.sealing import new_secret
from trainyard.runtime import collectives, device
from trainyard.runtime.collectives import GroupPlan, HangWatch, is_collective_error, peers_lost
from trainyard.runtime.elastic import Membership
from trainyard.runtime.elastic import is_collective_error as elastic_is_collective_error

GPU0 = device.choose(True, 2, 0)
GPU1 = device.choose(True, 2, 1)


@pytest.mark.parametrize(
    ("placement", "backend", "device_index"),
    [
        (device.CPU, "gloo", None),
        (device.choose(False, 0, 0), "gloo", None),
        (device.choose(True, 0, 0), "gloo", None),  # CUDA built in, no device visible: the CPU
        (GPU0, "nccl", 0),
        (GPU1, "nccl", 1),
    ],
)
def test_the_backend_follows_the_placement(placement: device.Placement, backend: str, device_index: int | None) -> None:
    group_plan = collectives.plan(placement, 12.0)
    assert (group_plan.backend, group_plan.device_index, group_plan.timeout_s) == (backend, device_index, 12.0)
    assert group_plan.nccl == (backend == "nccl")


def test_gloo_sets_no_environment_and_takes_only_the_timeout() -> None:
    group_plan = collectives.plan(device.CPU, 7.0)
    assert group_plan.env == {}
    assert group_plan.init_kwargs() == {"backend": "gloo", "timeout": timedelta(seconds=7.0)}


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),  # clean up, never tear the survivor down (torchrun sets 1)
        ("TORCH_NCCL_BLOCKING_WAIT", "0"),
        ("TORCH_NCCL_USE_COMM_NONBLOCKING", "1"),
        ("TORCH_NCCL_NONBLOCKING_TIMEOUT", "12"),
        ("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0"),
    ],
)
def test_an_nccl_generation_sets_its_error_handling(name: str, value: str) -> None:
    assert collectives.plan(GPU1, 12.0).env[name] == value


def test_nccl_overrides_what_the_launcher_set() -> None:
    environ = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "OTHER": "x"}  # torchrun's agent sets 1: tear down
    collectives.apply(collectives.plan(GPU0, 5.0), environ)
    assert environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"
    assert environ["OTHER"] == "x"


def test_the_nonblocking_timeout_is_whole_seconds_and_never_zero() -> None:
    assert collectives.nccl_env(0.2)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "1"
    assert collectives.nccl_env(29.6)["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "30"


def test_an_nccl_group_is_formed_eagerly_on_its_device() -> None:
    kwargs = collectives.plan(GPU1, 9.0).init_kwargs()
    assert kwargs["backend"] == "cpu:gloo,cuda:nccl"  # the committed steps and a joiner's state are CPU tensors
    assert kwargs["device_id"] == torch.device("cuda", 1)
    assert kwargs["timeout"] == timedelta(seconds=9.0)
    if dist.is_nccl_available():  # a CUDA build: non-blocking communicators in the options too
        assert kwargs["pg_options"].config.blocking is False
    else:
        assert "pg_options" not in kwargs and collectives.nccl_options() is None


NCCL_REMOTE = (
    "NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote process exited or there was a "
    "network error, NCCL version 2.21.5\nncclRemoteError: A call failed possibly due to a network error or a "
    "remote process exiting prematurely."
)
WATCHDOG = (
    "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=64, OpType=ALLREDUCE, NumelIn=2, "
    "NumelOut=2, Timeout(ms)=10000) ran for 10081 milliseconds before timing out."
)


@pytest.mark.parametrize(
    ("exc", "collective"),
    [
        # NCCL
        (dist.DistBackendError("NCCL communicator was aborted on rank 1. Original reason for failure was: x"), True),
        (RuntimeError("NCCL communicator was aborted on rank 0."), True),  # older torch: a plain RuntimeError
        (RuntimeError(NCCL_REMOTE), True),
        (RuntimeError(WATCHDOG), True),
        (RuntimeError("Some NCCL operations have failed or timed out. Due to the asynchronous nature ..."), True),
        (RuntimeError("NCCL error in: NCCLUtils.hpp:77, unhandled system error\nncclSystemError: ..."), True),
        # gloo
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
        (RuntimeError("[gloo/transport/tcp/pair.cc:598] Connection reset by peer"), True),
        (dist.DistNetworkError("Broken pipe"), True),
        (dist.DistError("anything the backend raises"), True),
        # the script's own: never regrouped
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x8)"), False),
        (ValueError("NCCL communicator was aborted"), False),  # not an error a collective raises
        (KeyboardInterrupt(), False),
    ],
)
def test_what_a_failed_collective_is(exc: BaseException, collective: bool) -> None:
    assert is_collective_error(exc) is collective


def test_elastic_keeps_its_name_for_the_same_test() -> None:
    assert elastic_is_collective_error is is_collective_error


def _gen(number: int, members: list[str], joiners: list[str] | None = None) -> Generation:
    return Generation(number, members, micro_batch=2, joiners=joiners or [])


NOW = _gen(3, ["node-0", "node-1", "node-2"])


@pytest.mark.parametrize(
    ("newer", "lost"),
    [
        (None, []),  # nothing readable
        (NOW, []),  # the same generation
        (_gen(2, ["node-0"]), []),  # an older one
        (_gen(4, ["node-0", "node-2"]), ["node-1"]),  # scaled down without node-1
        (_gen(4, ["node-0", "node-1", "node-2"], joiners=["node-1"]), ["node-1"]),  # node-1 started anew
        (_gen(4, ["node-0", "node-2", "spare-0"], joiners=["spare-0"]), ["node-1"]),  # a spare took its place
        (_gen(4, ["node-0", "node-1", "node-2", "node-3"], joiners=["node-3"]), []),  # the world grows
        (_gen(5, ["node-2"]), ["node-0", "node-1"]),
    ],
)
def test_which_peers_a_newer_generation_says_are_gone(newer: Generation | None, lost: list[str]) -> None:
    assert peers_lost(NOW, newer) == lost


def test_every_backend_has_an_abort() -> None:
    assert collectives.ABORTS == {"nccl": collectives.abort_nccl, "gloo": collectives.destroy_gloo}
    with pytest.raises(ValueError, match="no abort for backend 'mpi'"):
        collectives.abort("mpi")


def test_the_nccl_abort_this_torch_offers_is_there() -> None:
    """``abort_nccl`` leans on a private API: a torch upgrade that drops it must fail here, not on a GPU node."""
    assert callable(dist.distributed_c10d._abort_process_group)
    assert callable(dist.ProcessGroup.abort)


@pytest.fixture
def world() -> Iterator[GroupPlan]:
    """A real one-rank gloo world, formed as a generation is."""
    group_plan = collectives.form(dist.HashStore(), 0, 1, 5.0, device.CPU)
    yield group_plan
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_an_abort_with_no_group_left_is_safe(backend: str) -> None:
    assert not dist.is_initialized()
    assert collectives.abort(backend) == "gone"


def test_a_gloo_generation_is_destroyed_once(world: GroupPlan) -> None:
    assert world.backend == "gloo" and dist.get_backend() == "gloo"
    assert collectives.watch(world, NOW, lambda: None, 0.01) is None  # gloo's sockets close: nothing to watch
    assert collectives.abort("gloo") == "destroyed"
    assert not dist.is_initialized()
    assert collectives.abort("gloo") == "gone"


def test_communicators_are_aborted_in_place_and_nothing_is_not(world: GroupPlan) -> None:
    assert collectives.abort_communicators(dist.group.WORLD) is True
    assert dist.is_initialized()  # still registered: the blocked call returns, the next one raises
    assert collectives.abort_communicators(None) is False


def test_the_hang_watch_aborts_once_when_a_peer_is_gone() -> None:
    reads = iter([[], [], ["node-1"]])
    aborted = threading.Event()
    calls: list[int] = []

    def abort() -> None:
        calls.append(1)
        aborted.set()

    watch = HangWatch(lambda: next(reads, ["node-1"]), abort, poll_s=0.01).start()
    assert aborted.wait(timeout=30)
    watch.stop()
    assert calls == [1] and watch.fired == ["node-1"]
    with pytest.raises(dist.DistBackendError) as raised:
        watch.raise_if_fired()
    assert is_collective_error(raised.value)  # so the group's regroup path takes it


def test_a_quiet_hang_watch_aborts_nothing_and_stops() -> None:
    calls: list[int] = []
    watch = HangWatch(lambda: [], lambda: calls.append(1), poll_s=0.01).start()
    watch.stop()
    assert calls == [] and watch.fired == []
    watch.raise_if_fired()  # nothing to raise


def test_a_hang_watch_that_loses_the_store_stops_without_aborting() -> None:
    calls: list[int] = []
    done = threading.Event()

    def lost() -> list[str]:
        done.set()
        raise RuntimeError("Connection reset by peer")

    watch = HangWatch(lost, lambda: calls.append(1), poll_s=0.01).start()
    assert done.wait(timeout=30)
    watch.stop()
    assert calls == [] and watch.fired == []


class _Backend:
    def __init__(self, error: object) -> None:
        self.error = error

    def get_error(self) -> object:
        return self.error


class _Group:
    """A group whose CUDA backend reports ``error`` (this torch has no NCCL to build a real one)."""

    def __init__(self, error: object) -> None:
        self.error = error

    def _get_backend(self, device: torch.device) -> _Backend:
        assert device.type == "cuda"
        return _Backend(self.error)


ErrorType = torch._C._distributed_c10d.ErrorType


@pytest.mark.parametrize(
    ("error", "reported"),
    [
        (ErrorType.SUCCESS, None),
        (ErrorType.TIMEOUT, "TIMEOUT"),
        (ErrorType.COMM_ERROR, "COMM_ERROR"),
        (ErrorType.REMOTE_ERROR, "REMOTE_ERROR"),
    ],
)
def test_what_the_nccl_backend_reports(error: object, reported: str | None) -> None:
    assert collectives.backend_error(_Group(error)) == reported


def test_a_gloo_group_reports_no_backend_error(world: GroupPlan) -> None:
    assert collectives.backend_error(dist.group.WORLD) is None  # no CUDA backend: nothing to ask
    assert collectives.backend_error(None) is None


def test_a_backend_error_voids_the_step_even_when_no_peer_is_known_gone() -> None:
    watch = HangWatch(lambda: [], lambda: None, poll_s=0.01, error=lambda: "REMOTE_ERROR")
    with pytest.raises(dist.DistBackendError, match="REMOTE_ERROR") as raised:
        watch.raise_if_fired()
    assert is_collective_error(raised.value)


def test_a_membership_forms_gloo_on_the_cpu_and_tears_it_down_safely_twice() -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0"])
    Coordinator(store, keys).publish(_gen(1, ["node-0"]))
    member = Membership(store, "node-0", keys["node-0"], regroup_timeout_s=0.3)
    gen = member.next_generation()
    assert gen is not None and member.form(gen) == 0
    assert (member.backend, member.watch, dist.get_backend()) == ("gloo", None, "gloo")
    member.raise_if_aborted()  # gloo: nothing watched, nothing to raise
    member.on_fault(RuntimeError("Connection reset by peer"))
    assert not dist.is_initialized()
    member.on_fault(RuntimeError("Connection reset by peer"))  # nothing left: safe


def test_the_hang_watch_reads_the_supervisors_sealed_generations(world: GroupPlan) -> None:
    """The NCCL watch as ``Membership.form`` wires it, on a real store with sealed generations (the abort it
    calls is the group's own; gloo's does nothing, which is all a CPU can show)."""
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1", "node-2", "node-3"])
    coord = Coordinator(store, keys)
    coord.publish(NOW)
    member = Membership(store, "node-0", keys["node-0"], regroup_timeout_s=0.3)
    watch = collectives.watch(GroupPlan("nccl", 5.0, 0), NOW, member._newest, 0.01)
    assert watch is not None
    try:
        coord.publish(_gen(4, ["node-0", "node-1", "node-2", "node-3"], joiners=["node-3"]))  # grows: no abort
        coord.publish(_gen(5, ["node-0", "node-2"]))  # node-1 is gone
        assert wait_for(lambda: watch.fired, 30, "the watch to fire", every_s=0.01) == ["node-1"]  # polls every 10 ms
        with pytest.raises(dist.DistBackendError, match="node-1"):
            watch.raise_if_fired()
    finally:
        watch.stop()
