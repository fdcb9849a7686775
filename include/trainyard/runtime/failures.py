"""A rank's failure record: what kind of failure it saw, left in the heartbeat folder before it dies.

The supervisor's classifier trusts a record before any log line
(``trainyard.protocol.records`` is its format). ``record_uncaught`` makes an
exception that ends the process leave one; a script that catches its
exceptions itself calls ``record_failure``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from types import TracebackType

import torch.distributed as dist

from trainyard.protocol import records
from trainyard.protocol.env import TrainEnv

log = logging.getLogger("trainyard.workload")

_recorded = False
_hooked = False


def record_failure(exc: BaseException, ctx: TrainEnv | None = None) -> Path | None:
    """Leave this rank's failure record for ``exc`` in the heartbeat folder; its path, or None if none was written.

    Only the first failure of a process is recorded. Never raises: the rank
    is dying already, and the supervisor falls back to its log.
    """
    global _recorded
    try:
        ctx = ctx or TrainEnv.from_env(os.environ)
        if ctx.heartbeat_dir is None or _recorded:
            return None
        me = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        here = socket.gethostname()  # an unset node or host is this machine, as ``runtime.context`` fills them
        record = records.failure_record(exc, me, ctx.node or here, ctx.host or here)
        path = records.write_record(ctx.heartbeat_dir, record)
        _recorded = True
        return path
    except Exception as problem:  # a failure to record must not hide the failure itself
        log.warning("could not write the failure record: %s", problem)
        return None


def record_uncaught(ctx: TrainEnv) -> None:
    """Make an exception that ends the process leave a failure record first (once per process)."""
    global _hooked
    if _hooked or ctx.heartbeat_dir is None:
        return
    _hooked = True
    previous = sys.excepthook

    def hook(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if not isinstance(exc, KeyboardInterrupt):
            record_failure(exc, ctx)
        previous(kind, exc, tb)

    sys.excepthook = hook
