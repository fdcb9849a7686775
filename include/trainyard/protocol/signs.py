"""The words a failure leaves in a log, one table per category: ``classify`` reads logs with it, and the
runtime names the kind of an exception it records with the same words (``records.reading``).

Plain data, no imports: both sides of the wire read it.
"""

from __future__ import annotations

# Xid codes of the NVIDIA driver that mean the GPU (not the program) failed and the node needs a
# reset or repair: 48 double-bit ECC, 61/62 internal micro-controller halt, 64 ECC row remapping
# failed, 74 NVLink, 79 fallen off the bus, 94/95 contained/uncontained ECC, 119/120 GSP. Others
# (13 and 31: a kernel's own bad access, 43: the program stopped) are the program's.
XIDS = ("48", "61", "62", "64", "74", "79", "94", "95", "119", "120")

# Log patterns, one table per category; matched case-insensitively, line by line.
LOG_PATTERNS: dict[str, tuple[str, ...]] = {
    "diverged": (r"loss (?:is|became|was) [-+]?(?:nan|inf)", r"non-?finite loss", r"kind=['\"]?diverged"),
    "data": (r"\bDataError\b",),
    "spec": (r"\bSpecError\b",),
    "oom": (
        r"CUDA out of memory",
        r"OutOfMemoryError",
        r"\bMemoryError\b",
        r"Cannot allocate memory",
        r"can't allocate memory",
        r"oom-kill",
        r"Out of memory: Killed process",
        r"std::bad_alloc",
        r"Cuda failure (?:\d+ )?'out of memory'",  # NCCL's own allocation (ncclUnhandledCudaError)
    ),
    "hardware": (r"\bECC error", r"fallen off the bus", r"GPU is lost", rf"NVRM: Xid \([^)]*\): (?:{'|'.join(XIDS)}),"),
    # NCCL's watchdog gave up on a collective: some rank never joined it (hung, or stuck on its GPU).
    "nccl_timeout": (r"Watchdog caught collective operation timeout", r"WorkNCCL\(.*\) ran for \d+ milliseconds"),
    "comm": (
        r"Connection reset by peer",
        r"Connection closed by peer",
        r"Connection refused",
        r"Broken ?pipe",
        r"Connection was likely closed",
        r"Failed to recv",
        r"rendezvous",
        r"ProcessGroup(?:Gloo|NCCL)",
        r"third_party/gloo",
        r"Socket Timeout",
        r"Timed out waiting",
        r"collective operation timeout",
        r"Dist(?:Network|Backend|Store)Error",
        r"NCCL (?:error|timeout|communicator)",
        r"nccl(?:Remote|System|Internal|UnhandledCuda)Error",
        r"communicator was aborted",
        r"remote process exited",
    ),
    # A torchrun agent reporting that one of its workers was SIGKILLed (the node, or its memory, went away).
    "sigkill": (r"Signals\.SIGKILL", r"exitcode\s*:\s*-9\b", r"Signal 9 \(SIGKILL\)"),
    # A torchrun agent (or its worker) that got SIGTERM: notice, read only on a node that had already failed.
    "sigterm": (r"got signal: 15\b", r"Signal 15 \(SIGTERM\)"),
}
