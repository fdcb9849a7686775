"""Failure classification as a table of cases built from realistic torchrun / gloo / kubelet output.

The log excerpts are trimmed copies of what torch 2.x's torchrun agent and its
workers write (worker tracebacks carry torch's ``[rankN]: `` prefix; the agent
ends with its ``ChildFailedError`` summary).
"""

from __future__ import annotations

import pytest

from trainyard.recovery.classify import Failure, NodeFailure, classify

VENV = "/opt/venv/lib/python3.11/site-packages"
STEPS = "\n".join(f"step {s} loss {5.54 - s * 0.05:.4f} lr 2.00e-03 ms 15.1 tok/s 25000" for s in range(8, 13))


def agent_summary(rank: int, exitcode: int, when: str = "2026-11-29_22:08:23") -> str:
    """The torchrun agent's last words after a worker of its node failed."""
    signal = {-9: "SIGKILL", -6: "SIGABRT", -15: "SIGTERM"}.get(exitcode)
    return f"""\
E1129 22:08:23.702000 28164 {VENV}/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: {exitcode}) local_rank: 0 (pid: 28218) of binary: /opt/venv/bin/python
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "{VENV}/torch/distributed/run.py", line 1028, in main
    run(args)
  File "{VENV}/torch/distributed/launcher/api.py", line 383, in launch_agent
    raise ChildFailedError(
torch.distributed.elastic.multiprocessing.errors.ChildFailedError: 
============================================================
trainyard.workload FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : {when}
  host      : localhost
  rank      : {rank} (local_rank: 0)
  exitcode  : {exitcode} (pid: 28218){f"  ({signal})" if signal else " "}
  error_file: <N/A>
  traceback : {f"Signal {-exitcode} ({signal}) received by PID 28218" if signal else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"}
============================================================"""


def worker_raised(rank: int, *exception_lines: str, frames: str = "") -> str:
    """A worker's uncaught traceback as torch prints it, every line behind ``[rankN]: ``."""
    body = (
        frames
        or f"""\
Traceback (most recent call last):
  File "{VENV}/trainyard/train/__main__.py", line 4, in <module>
    main()
  File "{VENV}/trainyard/train/loop.py", line 176, in run
    loss = train_step(model, optimizer, batches, lr_at(step, args), args.grad_clip)"""
    )
    lines = [*body.splitlines(), *exception_lines]
    return "\n".join(f"[rank{rank}]: {line}" for line in lines)


def peer_closed(rank: int, port: int = 18648) -> str:
    """What a survivor's worker prints when the other side of a gloo pair vanished."""
    return worker_raised(
        rank,
        f"RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by"
        f" peer [127.0.0.1]:{port}. This is typically caused by a remote worker crashing. Check the logs of the"
        f" remote worker before reporting an error.",
        frames=f"""\
Traceback (most recent call last):
  File "{VENV}/trainyard/train/loop.py", line 120, in train_step
    dist.all_reduce(flat)
  File "{VENV}/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
    work.wait()""",
    )


CANCELLED = f"""\
W1129 22:05:26.445000 26114 {VENV}/torch/distributed/elastic/agent/server/api.py:753] Received 15 death signal, shutting down workers
W1129 22:05:26.446000 26114 {VENV}/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 26120 closing signal SIGTERM
Traceback (most recent call last):
  File "{VENV}/torch/distributed/elastic/agent/server/api.py", line 923, in _invoke_run
    time.sleep(monitor_interval)
  File "{VENV}/torch/distributed/elastic/multiprocessing/api.py", line 86, in _terminate_process_handler
    raise SignalException(f"Process {{os.getpid()}} got signal: {{sigval}}", sigval=sigval)
torch.distributed.elastic.multiprocessing.api.SignalException: Process 26114 got signal: 15"""

# A cancelled agent's teardown finding its worker's process group already gone (torch 2.13, seen in CI):
# the head of the chain (the SignalException) has scrolled out of the tail; the agent's own error is no
# root cause, whatever its type.
AGENT_TEARDOWN = f"""\

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "{VENV}/torch/distributed/elastic/agent/server/api.py", line 754, in run
    self._shutdown(e.sigval, timeout=self._shutdown_timeout)
  File "{VENV}/torch/distributed/elastic/multiprocessing/api.py", line 1033, in _close
    handler.close(death_sig=death_sig)
  File "{VENV}/torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py", line 85, in close
    os.killpg(self.proc.pid, death_sig)
ProcessLookupError: [Errno 3] No such process

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/work/main/include/trainyard/backends/local/zygote.py", line 289, in _child
    _agent(request["argv"][2:], Path(request["log"]))
  File "{VENV}/torch/distributed/run.py", line 1019, in run
    elastic_launch(
  File "{VENV}/torch/distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py", line 85, in close
    os.killpg(self.proc.pid, death_sig)
ProcessLookupError: [Errno 3] No such process"""

NAN = "\n".join(
    [
        STEPS,
        "step 13 loss nan lr 2.00e-03 ms 15.0 tok/s 25100",
        worker_raised(1, "trainyard.errors.TrainingFailed: loss is nan at step 13"),
        agent_summary(1, 1),
    ]
)
INF = "\n".join(
    [STEPS, worker_raised(0, "trainyard.errors.TrainingFailed: loss is inf at step 9"), agent_summary(0, 1)]
)
DATA = "\n".join(
    [
        worker_raised(
            0,
            "trainyard.errors.DataError: shard tokens-0003.bin is truncated: header says"
            " 1048576 tokens, file holds 524288",
        ),
        agent_summary(0, 1),
    ]
)
SPEC = "\n".join(
    [
        worker_raised(2, "trainyard.errors.SpecError: global batch 12 is not divisible by micro-batch 5 x 1 ranks"),
        agent_summary(2, 1),
    ]
)
CUDA_OOM = "\n".join(
    [
        STEPS,
        worker_raised(
            1,
            "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.15 GiB"
            " of which 1.23 GiB is free. Including non-PyTorch memory, this process has 77.90 GiB memory in use. If reserved"
            " but unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid"
            " fragmentation.",
        ),
        agent_summary(1, 1),
    ]
)
CPU_OOM = "\n".join(
    [
        worker_raised(
            0,
            "RuntimeError: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: you"
            " tried to allocate 35184372088832 bytes. Error code 12 (Cannot allocate memory)",
        ),
        agent_summary(0, 1),
    ]
)
PY_MEMORY_ERROR = "\n".join([STEPS, worker_raised(1, "MemoryError")])
VALUE_ERROR = "\n".join(
    [STEPS, worker_raised(1, "ValueError: bad shape for head: expected 64 got 48"), agent_summary(1, 1)]
)
# Raised before the process group formed: no rank prefix, mixed with the agent's own lines.
KEY_ERROR_EARLY = f"""\
Traceback (most recent call last):
  File "{VENV}/trainyard/train/loop.py", line 96, in build
    width = args.model["d_model"]
KeyError: 'd_model'
{agent_summary(0, 1)}"""
ASSERTION = "\n".join([STEPS, worker_raised(0, "AssertionError"), agent_summary(0, 1)])
# A worker that caught a peer's disappearance and raised its own error about it: still the peer's fault.
CHAINED_FROM_PEER = "\n".join(
    [
        peer_closed(0),
        "[rank0]: ",
        "[rank0]: During handling of the above exception, another exception occurred:",
        "[rank0]: ",
        worker_raised(
            0,
            "ValueError: gradient sync failed at step 12",
            frames="Traceback (most recent call last):\n"
            f'  File "{VENV}/trainyard/train/loop.py", line 125, in train_step\n    raise ValueError(...)',
        ),
        agent_summary(0, 1),
    ]
)
RESET = "\n".join(
    [
        STEPS,
        worker_raised(
            0, "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Connection reset by peer"
        ),
        agent_summary(0, 1),
    ]
)
RDZV_TIMEOUT = f"""\
Traceback (most recent call last):
  File "{VENV}/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line 1122, in next_rendezvous
    self._op_executor.run(join_op, deadline, self._get_deadline)
torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: The node '127.0.0.1_4411_0' has timed out waiting for the rendezvous 'nightly-a2'."""
GLOO_TIMEOUT = "\n".join(
    [
        STEPS,
        worker_raised(
            1,
            "RuntimeError: [../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 1800000ms for"
            " recv operation to complete",
        ),
        agent_summary(1, 1),
    ]
)
NCCL_WATCHDOG = f"""\
[rank3]:[E1129 22:41:07.112000 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5021, OpType=ALLREDUCE, NumelIn=2097152, NumelOut=2097152, Timeout(ms)=600000) ran for 600012 milliseconds before timing out.
[rank3]:[E1129 22:41:07.113000 ProcessGroupNCCL.cpp:1664] [PG 0 Rank 3] Exception (either an error or timeout) detected by watchdog at work: 5021, last enqueued NCCL work: 5021, last completed NCCL work: 5020.
{agent_summary(3, -6)}"""
# NCCL and CUDA lines as torch 2.x, NCCL 2.2x and the NVIDIA driver print them (the wording of the
# issues users filed about them: pytorch/pytorch, NVIDIA/nccl, vllm, sglang; numbers changed).
NCCL_WATCHDOG_ABORT = f"""\
[rank5]:[E1129 22:41:07.408271257 ProcessGroupNCCL.cpp:607] [Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9141, OpType=_ALLGATHER_BASE, NumelIn=19008, NumelOut=152064, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.
[rank5]:[E1129 22:41:07.465150152 ProcessGroupNCCL.cpp:1664] [PG 0 Rank 5] Exception (either an error or timeout) detected by watchdog at work: 9141, last enqueued NCCL work: 9143, last completed NCCL work: 9140.
terminate called after throwing an instance of 'c10::DistBackendError'
  what():  [PG 0 Rank 5] Process group watchdog thread terminated with exception: [Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9141, OpType=_ALLGATHER_BASE, NumelIn=19008, NumelOut=152064, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.
Exception raised from checkTimeout at ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:609 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x96 (0x7f3b6d41df86 in {VENV}/torch/lib/libc10.so)
{agent_summary(5, -6)}"""
NCCL_SYSTEM_ERROR = "\n".join(
    [
        worker_raised(
            1,
            "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:2501,"
            " unhandled system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.25.1",
            "ncclSystemError: System call (e.g. socket, malloc) or external library call failed or device error. ",
            "Last error:",
        ),
        agent_summary(1, 1),
    ]
)
NCCL_REMOTE_ERROR = "\n".join(
    [
        STEPS,
        worker_raised(
            0,
            "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:317, remote"
            " process exited or there was a network error, NCCL version 2.21.5",
            "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting prematurely.",
            "Last error:",
            "socketProgressOpt: Call to recv from 10.0.3.7<33759> failed : Connection reset by peer",
        ),
        agent_summary(0, 1),
    ]
)
NCCL_CUDA_OOM = "\n".join(
    [
        "gpu-07:28218:28390 [3] include/alloc.h:178 NCCL WARN Cuda failure 'out of memory'",
        "gpu-07:28218:28390 [3] include/alloc.h:185 NCCL WARN Failed to CUDA calloc 6291456 bytes",
        worker_raised(
            3,
            "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275,"
            " unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.20.5",
            "ncclUnhandledCudaError: Call to CUDA function failed.",
            "Last error:",
            "Cuda failure 'out of memory'",
        ),
        agent_summary(3, 1),
    ]
)
NCCL_CUDA_UNKNOWN = "\n".join(
    [
        worker_raised(
            0,
            "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/NCCLUtils.hpp:275,"
            " unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
            "ncclUnhandledCudaError: Call to CUDA function failed.",
            "Last error:",
            "Cuda failure 999 'unknown error'",
        ),
        agent_summary(0, 1),
    ]
)
CUDA_OOM_OLD = "\n".join(
    [
        worker_raised(
            0,
            "RuntimeError: CUDA out of memory. Tried to allocate 2.87 GiB (GPU 0; 14.76 GiB total capacity; 8.77 GiB"
            " already allocated; 19.75 MiB free; 13.71 GiB reserved in total by PyTorch)",
        ),
        agent_summary(0, 1),
    ]
)
ILLEGAL_ACCESS = "\n".join(
    [
        STEPS,
        worker_raised(
            2,
            "RuntimeError: CUDA error: an illegal memory access was encountered",
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be"
            " incorrect.",
            "For debugging consider passing CUDA_LAUNCH_BLOCKING=1",
            "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        ),
        agent_summary(2, 1),
    ]
)


def xid(code: int, what: str) -> str:
    """A kernel log line of the NVIDIA driver, as a node's log carries it when it collects dmesg."""
    return f"[Tue Dec  1 01:02:03 2026] NVRM: Xid (PCI:0000:3b:00): {code}, pid=28218, name=python, {what}"


XID_79 = "\n".join([STEPS, xid(79, "GPU has fallen off the bus."), agent_summary(0, -6)])
XID_48 = "\n".join(
    [
        STEPS,
        xid(48, "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 6."),
        worker_raised(0, "RuntimeError: CUDA error: an illegal memory access was encountered"),
        agent_summary(0, 1),
    ]
)
XID_74 = "\n".join(
    [xid(74, "NVLink: fatal error detected on link 3(0x0, 0x0, 0x10000, 0x0, 0x0, 0x0, 0x0)"), agent_summary(0, -6)]
)
# Xid 13 is a kernel's own bad access (the program's), whatever else the log says.
XID_13 = "\n".join(
    [
        xid(13, "Graphics SM Warp Exception on (GPC 7, TPC 7, SM 0): Illegal Instruction Parameter"),
        ILLEGAL_ACCESS,
    ]
)
WORKER_SIGKILLED = "\n".join([STEPS, agent_summary(1, -9)])
ECC = "\n".join(
    [
        STEPS,
        worker_raised(
            0,
            "RuntimeError: CUDA error: uncorrectable ECC error encountered",
            "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be"
            " incorrect.",
        ),
        agent_summary(0, 1),
    ]
)
UNEXPLAINED = "\n".join([STEPS, agent_summary(1, 3)])
# Two ranks of one node writing at once: rank 1's chained traceback is cut by rank 0's own exception.
INTERLEAVED = "\n".join(
    [
        peer_closed(1),
        "[rank1]: ",
        "[rank1]: During handling of the above exception, another exception occurred:",
        worker_raised(0, "ValueError: unknown optimizer 'adamw8bit'"),
        "[rank1]: ",
        worker_raised(1, "RuntimeError: gradient sync failed at step 12"),
        agent_summary(0, 1),
    ]
)
# What trainyard's own fault drills (runtime/drills.py) leave behind.
DRILL_OOM = "\n".join(
    [STEPS, worker_raised(1, "MemoryError: drill: out of memory at step 13 on node-1"), agent_summary(1, 1)]
)
DRILL_EXCEPTION = "\n".join(
    [STEPS, worker_raised(1, "RuntimeError: drill: exception in user code at step 13 on node-1"), agent_summary(1, 1)]
)
RDZV_SHUTDOWN_NOISE = (
    f"W1129 22:02:17.522000 25529 {VENV}/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py:1298] The node"
    " '127.0.0.1_25529_0' has failed to shutdown the rendezvous 'nightly-a1' due to an error of type"
    " RendezvousConnectionError."
)


def node(name: str, state: str = "failed", exit_code: int | None = 1, log: str = "", reason: str = "") -> NodeFailure:
    return NodeFailure(name, state, exit_code, reason, log)


def running(name: str, log: str = "") -> NodeFailure:
    return NodeFailure(name, "running", None, "", log)


CASES = [
    # id, failure, kind, culprits, evidence must contain
    # ---- Kubernetes' own verdicts come first
    (
        "k8s-oomkilled",
        Failure(1, "crash", [node("node-0", log=peer_closed(0)), node("node-1", exit_code=137, reason="OOMKilled")]),
        "oom",
        ["node-1"],
        "node-1: pod OOMKilled (exit 137)",
    ),
    (
        "k8s-evicted",
        Failure(
            1, "crash", [running("node-0"), node("node-1", "running"), node("node-2", exit_code=137, reason="Evicted")]
        ),
        "node_lost",
        ["node-2"],
        "pod Evicted",
    ),
    (
        "k8s-nodelost",
        Failure(2, "crash", [node("node-0", exit_code=None, reason="NodeLost"), running("node-1")]),
        "node_lost",
        ["node-0"],
        "node-0: pod NodeLost",
    ),
    (
        "k8s-preempted",
        Failure(1, "crash", [node("node-1", exit_code=143, reason="PreemptionByScheduler")]),
        "preempted",
        [],
        "PreemptionByScheduler",
    ),
    (
        "k8s-image-pull",
        Failure(
            1,
            "crash",
            [
                node("node-0", exit_code=None, reason="ImagePullBackOff"),
                node("node-1", exit_code=None, reason="ImagePullBackOff"),
            ],
        ),
        "user_error",
        [],
        "pod ImagePullBackOff",
    ),
    (
        "k8s-config",
        Failure(1, "crash", [node("node-0", exit_code=None, reason="CreateContainerConfigError")]),
        "user_error",
        [],
        "CreateContainerConfigError",
    ),
    # an OOM kill beats an eviction seen on another pod: the table's order decides
    (
        "k8s-oom-over-evicted",
        Failure(
            1,
            "crash",
            [node("node-0", exit_code=137, reason="Evicted"), node("node-1", exit_code=137, reason="OOMKilled")],
        ),
        "oom",
        ["node-1"],
        "OOMKilled",
    ),
    # ---- root causes in a node's own log beat what its peers saw
    (
        "nan-loss",
        Failure(1, "crash", [node("node-0", log=peer_closed(0)), node("node-1", log=NAN)]),
        "diverged",
        [],
        "node-1: [rank1]: trainyard.errors.TrainingFailed: loss is nan at step 13",
    ),
    (
        "inf-loss-beats-a-sigkill",
        Failure(1, "crash", [node("node-0", log=INF), node("node-1", exit_code=-9)]),
        "diverged",
        [],
        "loss is inf at step 9",
    ),
    (
        "data-error",
        Failure(1, "crash", [node("node-0", log=DATA), running("node-1", peer_closed(1))]),
        "data_error",
        [],
        "DataError: shard tokens-0003.bin is truncated",
    ),
    ("spec-error", Failure(1, "crash", [node("node-2", log=SPEC)]), "user_error", [], "SpecError: global batch 12"),
    (
        "cuda-oom",
        Failure(3, "crash", [node("node-0", log=peer_closed(0)), node("node-1", log=CUDA_OOM)]),
        "oom",
        ["node-1"],
        "node-1: [rank1]: torch.OutOfMemoryError: CUDA out of memory",
    ),
    ("cpu-alloc", Failure(1, "crash", [node("node-0", log=CPU_OOM)]), "oom", ["node-0"], "Cannot allocate memory"),
    (
        "137-with-oom-evidence",
        Failure(1, "crash", [node("node-1", exit_code=137, log=PY_MEMORY_ERROR)]),
        "oom",
        ["node-1"],
        "MemoryError",
    ),
    (
        "ecc",
        Failure(1, "crash", [node("node-0", log=ECC), node("node-1", log=peer_closed(1))]),
        "node_lost",
        ["node-0"],
        "uncorrectable ECC error",
    ),
    (
        "user-exception",
        Failure(1, "crash", [node("node-0", log=peer_closed(0)), node("node-1", log=VALUE_ERROR)]),
        "user_error",
        [],
        "node-1: [rank1]: ValueError: bad shape for head",
    ),
    (
        "user-exception-before-init",
        Failure(1, "crash", [node("node-0", log=KEY_ERROR_EARLY)]),
        "user_error",
        [],
        "node-0: KeyError: 'd_model'",
    ),
    (
        "bare-assertion",
        Failure(1, "crash", [node("node-0", log=ASSERTION)]),
        "user_error",
        [],
        "[rank0]: AssertionError",
    ),
    (
        "ranks-interleaved",
        Failure(1, "crash", [node("node-0", log=INTERLEAVED)]),
        "user_error",
        [],
        "[rank0]: ValueError: unknown optimizer 'adamw8bit'",
    ),
    (
        "drill-oom",
        Failure(1, "crash", [node("node-0", log=peer_closed(0)), node("node-1", log=DRILL_OOM)]),
        "oom",
        ["node-1"],
        "MemoryError: drill: out of memory at step 13",
    ),
    (
        "drill-exception",
        Failure(1, "crash", [node("node-0", log=peer_closed(0)), node("node-1", log=DRILL_EXCEPTION)]),
        "user_error",
        [],
        "RuntimeError: drill: exception in user code",
    ),
    # ---- symptoms: peers vanishing
    (
        "exception-chained-from-peer",
        Failure(1, "crash", [node("node-0", log=CHAINED_FROM_PEER)]),
        "transient",
        [],
        "Connection closed by peer",
    ),
    (
        "sigkilled-node-peer-reset",
        Failure(1, "crash", [node("node-0", log=peer_closed(0)), node("node-1", exit_code=-9, log=STEPS)]),
        "node_lost",
        ["node-1"],
        "node-1 exit -9",
    ),
    (
        "worker-sigkilled",
        Failure(1, "crash", [node("node-0", log=peer_closed(0)), node("node-1", log=WORKER_SIGKILLED)]),
        "node_lost",
        ["node-1"],
        "worker SIGKILLed (failed (exitcode: -9)",
    ),
    (
        "connection-reset",
        Failure(1, "crash", [node("node-0", log=RESET), node("node-1", log=peer_closed(1))]),
        "transient",
        [],
        "Connection reset by peer",
    ),
    (
        "rendezvous-timeout",
        Failure(2, "crash", [node("node-1", log=RDZV_TIMEOUT)]),
        "transient",
        [],
        "RendezvousTimeoutError",
    ),
    (
        "gloo-timeout",
        Failure(1, "crash", [node("node-1", log=GLOO_TIMEOUT)]),
        "transient",
        [],
        "Timed out waiting 1800000ms",
    ),
    # ---- NCCL and the GPUs
    # a collective NCCL's watchdog gave up on: a hang, but which rank never joined is not in the logs
    (
        "nccl-watchdog",
        Failure(1, "crash", [node("node-3", exit_code=1, log=NCCL_WATCHDOG)]),
        "hang",
        [],
        "Watchdog caught collective operation timeout",
    ),
    (
        "nccl-watchdog-abort",
        Failure(1, "crash", [node("node-0", exit_code=1, log=NCCL_WATCHDOG_ABORT), node("node-1", log=NCCL_WATCHDOG)]),
        "hang",
        [],
        "node-0: [rank5]:[E1129",
    ),
    (
        "nccl-watchdog-after-a-sigkill",
        Failure(1, "crash", [node("node-0", log=NCCL_WATCHDOG_ABORT), node("node-1", exit_code=-9, log=STEPS)]),
        "node_lost",
        ["node-1"],
        "node-1 exit -9; peers lost it",
    ),
    (
        "nccl-system-error",
        Failure(1, "crash", [node("node-1", log=NCCL_SYSTEM_ERROR)]),
        "transient",
        [],
        "unhandled system error",
    ),
    (
        "nccl-remote-error",
        Failure(1, "crash", [node("node-0", log=NCCL_REMOTE_ERROR), running("node-1")]),
        "transient",
        [],
        "remote process exited or there was a network error",
    ),
    (
        "nccl-remote-error-sigkilled-peer",
        Failure(1, "crash", [node("node-0", log=NCCL_REMOTE_ERROR), node("node-1", exit_code=137)]),
        "node_lost",
        ["node-1"],
        "node-1 exit 137",
    ),
    (
        "nccl-cuda-oom",
        Failure(2, "crash", [node("node-0", log=NCCL_REMOTE_ERROR), node("node-1", log=NCCL_CUDA_OOM)]),
        "oom",
        ["node-1"],
        "node-1: ",
    ),
    (
        "nccl-cuda-unknown",
        Failure(1, "crash", [node("node-0", log=NCCL_CUDA_UNKNOWN)]),
        "transient",
        [],
        "unhandled cuda error",
    ),
    (
        "cuda-oom-torch-1",
        Failure(1, "crash", [node("node-0", log=CUDA_OOM_OLD)]),
        "oom",
        ["node-0"],
        "Tried to allocate",
    ),
    (
        "xid-79",
        Failure(1, "crash", [node("node-0", exit_code=-6, log=XID_79), node("node-1", log=NCCL_WATCHDOG)]),
        "node_lost",
        ["node-0"],
        "node-0: [Tue Dec 1 01:02:03 2026] NVRM: Xid (PCI:0000:3b:00): 79",
    ),
    (
        "xid-48-beats-the-illegal-access-it-caused",
        Failure(1, "crash", [node("node-0", log=XID_48), node("node-1", log=peer_closed(1))]),
        "node_lost",
        ["node-0"],
        "48, pid=28218, name=python, An uncorrectable double bit error",
    ),
    (
        "xid-74-nvlink",
        Failure(1, "crash", [node("node-2", exit_code=-6, log=XID_74)]),
        "node_lost",
        ["node-2"],
        "NVLink",
    ),
    (
        "illegal-memory-access-is-the-programs",
        Failure(1, "crash", [node("node-1", log=ILLEGAL_ACCESS)]),
        "user_error",
        [],
        "[rank2]: RuntimeError: CUDA error: an illegal memory access was encountered",
    ),
    (
        "xid-13-is-the-programs",
        Failure(1, "crash", [node("node-1", log=XID_13)]),
        "user_error",
        [],
        "an illegal memory access",
    ),
    # A node that had failed by SIGTERM before the supervisor looked was given notice: preempted, nobody blamed
    (
        "sigterm-blames-nobody",
        Failure(1, "crash", [node("node-0", exit_code=-15, log=CANCELLED), node("node-1", log=peer_closed(1))]),
        "preempted",
        [],
        "node-0 exit -15",
    ),
    # ---- exit codes alone
    (
        "sigkill-no-log",
        Failure(1, "crash", [node("node-2", exit_code=-9), running("node-0")]),
        "node_lost",
        ["node-2"],
        "node-2 exit -9",
    ),
    (
        "137-no-log",
        Failure(1, "crash", [node("node-1", exit_code=137, reason="Error")]),
        "node_lost",
        ["node-1"],
        "exit 137",
    ),
    # ---- hangs: the supervisor ended them, so the cancel's noise must not decide
    (
        "hang",
        Failure(2, "hang", [running("node-0", CANCELLED), running("node-1", CANCELLED)], ["node-1"], 40),
        "hang",
        ["node-1"],
        "no heartbeat from node-1 after step 40",
    ),
    (
        "hang-with-teardown-noise",
        Failure(1, "hang", [running("node-0", peer_closed(0)), running("node-1", WORKER_SIGKILLED)], ["node-1"]),
        "hang",
        ["node-1"],
        "no heartbeat from node-1",
    ),
    (
        "hang-unknown-node",
        Failure(1, "hang", [running("node-0"), running("node-1")], []),
        "hang",
        [],
        "no silent node was identified",
    ),
    # ---- nothing explains it
    (
        "unexplained-exit",
        Failure(1, "crash", [node("node-0", log=CANCELLED), node("node-1", exit_code=1, log=UNEXPLAINED)]),
        "transient",
        [],
        "unclassified: ",
    ),
    (
        "agent-teardown-is-not-a-user-error",
        Failure(2, "crash", [node("node-0", exit_code=-9, log=STEPS), running("node-2", AGENT_TEARDOWN)]),
        "node_lost",
        ["node-0"],
        "node-0 exit -9",
    ),
    (
        "sigterm-is-not-a-user-error",
        Failure(1, "crash", [node("node-0", log=CANCELLED)]),
        "preempted",
        [],
        "got signal: 15",
    ),
    # a node that finished holds no root cause; its shutdown warnings are noise
    (
        "succeeded-node-noise",
        Failure(
            1,
            "crash",
            [node("node-0", "succeeded", 0, RDZV_SHUTDOWN_NOISE), node("node-1", exit_code=3, log=agent_summary(1, 3))],
        ),
        "transient",
        [],
        "unclassified: node-1 exited 3, last line: failed (exitcode: 3)",
    ),
]


@pytest.mark.parametrize("failure,kind,culprits,evidence", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_classify(failure: Failure, kind: str, culprits: list[str], evidence: str) -> None:
    found = classify(failure)
    assert (found.kind, found.culprits) == (kind, culprits), found.evidence
    assert evidence in found.evidence
    assert "\n" not in found.evidence and len(found.evidence) <= 400


def test_diverged_carries_the_step_it_was_seen_at() -> None:
    found = classify(Failure(1, "crash", [node("node-1", log=NAN)], last_step=12))
    assert (found.kind, found.step) == ("diverged", 13)
    # without a step in the message, the last heartbeat's step stands in
    other = Failure(1, "crash", [node("node-1", log=worker_raised(1, "RuntimeError: non-finite loss"))], last_step=7)
    assert (classify(other).kind, classify(other).step) == ("diverged", 7)


def test_the_first_failed_node_is_quoted_and_others_are_named() -> None:
    found = classify(Failure(1, "crash", [running("node-0", CUDA_OOM), node("node-1", log=CUDA_OOM)]))
    assert found.evidence.startswith("node-1: ") and found.evidence.endswith("(also on node-0)")
    assert found.culprits == ["node-0", "node-1"]


def test_a_long_line_is_clipped_to_one_line() -> None:
    found = classify(Failure(1, "crash", [node("node-0", log=worker_raised(0, "ValueError: " + "x" * 2000))]))
    assert found.kind == "user_error" and found.evidence.endswith("...") and len(found.evidence) <= 300


# Notice (issue 30, preemption): which nodes leave, and that none is blamed; (id, failure, kind, leaving, evidence).
PREEMPTION = [
    (
        "left-on-the-store",
        Failure(
            1, "preempted", [running("node-0"), running("node-1"), running("node-2")], leaving=["node-1"], last_step=12
        ),
        "preempted",
        ["node-1"],
        "node-1 given notice (SIGTERM): left at a step boundary after step 12",
    ),
    (
        "k8s-pod-preempted",
        Failure(1, "crash", [running("node-0"), node("node-1", exit_code=143, reason="PreemptionByScheduler")]),
        "preempted",
        ["node-1"],
        "node-1: pod PreemptionByScheduler (exit 143)",
    ),
    (
        "k8s-node-shutdown",  # a spot interruption drains the node: the kubelet's graceful shutdown
        Failure(1, "crash", [node("node-2", exit_code=143, reason="TerminationByKubelet"), running("node-0")]),
        "preempted",
        ["node-2"],
        "TerminationByKubelet",
    ),
    (
        "sigterm-exit-peers-lost-it",
        Failure(1, "crash", [node("node-1", exit_code=-15), node("node-0", log=peer_closed(0)), running("node-2")]),
        "preempted",
        ["node-1"],
        "node-1 exit -15: terminated by SIGTERM",
    ),
    (
        "torchrun-agent-got-sigterm",
        Failure(1, "crash", [node("node-1", exit_code=1, log=CANCELLED), node("node-2", log=peer_closed(2))]),
        "preempted",
        ["node-1"],
        "got signal: 15",
    ),
    (
        "teardown-noise-on-running-nodes",  # the supervisor's own cancel, read after it: still the SIGKILL
        Failure(1, "crash", [node("node-1", exit_code=-9), running("node-0", CANCELLED), running("node-2", CANCELLED)]),
        "node_lost",
        [],
        "node-1 exit -9",
    ),
    (
        "teardown-beside-a-root-cause",  # a failed Job's other pods get SIGTERM too: the OOM decides
        Failure(1, "crash", [node("node-0", exit_code=143, log=CANCELLED), node("node-1", log=CUDA_OOM)]),
        "oom",
        [],
        "out of memory",
    ),
    (
        "teardown-beside-an-unexplained-exit",
        Failure(1, "crash", [node("node-0", exit_code=143), node("node-1", exit_code=3, log=UNEXPLAINED)]),
        "transient",
        [],
        "unclassified",
    ),
    (
        "evicted-is-still-the-hosts",
        Failure(1, "crash", [node("node-2", exit_code=137, reason="Evicted"), running("node-0")]),
        "node_lost",
        [],
        "pod Evicted",
    ),
]


@pytest.mark.parametrize("failure,kind,leaving,evidence", [c[1:] for c in PREEMPTION], ids=[c[0] for c in PREEMPTION])
def test_notice_is_preempted_and_blames_no_host(failure: Failure, kind: str, leaving: list[str], evidence: str) -> None:
    found = classify(failure)
    assert (found.kind, found.leaving) == (kind, leaving), found.evidence
    assert evidence in found.evidence
    if kind == "preempted":
        assert found.culprits == []  # no exclusion, no cool-down, no burn-in blame
