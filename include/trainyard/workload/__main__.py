"""``python -m trainyard.workload``: the reference workload's entry point (see ``trainyard.workload.loop``).

Owns process setup and teardown only: logging, the process group, and turning
trainyard errors into one line and a non-zero exit instead of a traceback. A
rank that fails leaves its failure record first (``runtime.record_failure``).

A failed rank exits at once (``os._exit``) rather than through interpreter
shutdown: a background checkpoint save may be blocked in a collective with a
peer that died, and neither it nor the process group's teardown should delay
the exit the supervisor is waiting for. An elastic rank exits the same way when it
finishes, for the same reason.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback
from typing import NoReturn

import torch.distributed as dist

from trainyard import runtime
from trainyard.errors import TrainyardError
from trainyard.workload import loop


def main(argv: list[str] | None = None) -> int:
    args = loop.parse_args(argv)
    rank = os.environ.get("RANK", "0")  # torchrun interleaves ranks' output; say whose line it is
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    try:
        ctx = runtime.context()
        placement = loop.init_process_group()  # a rank without a GPU of its own is refused here, in one line
    except ValueError as exc:
        print(f"trainyard.workload: {exc}", file=sys.stderr)
        return 2
    try:
        loop.train(args, ctx, placement)
    except TrainyardError as exc:
        runtime.record_failure(exc, ctx)
        print(f"trainyard.workload: rank {runtime.rank()}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        _exit_now(1)
    except Exception as exc:
        runtime.record_failure(exc, ctx)
        traceback.print_exc()
        _exit_now(1)
    if dist.is_initialized():  # an elastic node left out of a generation holds no group any more
        dist.destroy_process_group()
    if ctx.store is not None:
        # An elastic rank may hold a buried group (``trainyard.runtime.elastic``) with a thread still blocked
        # on the dead peer: the interpreter's shutdown would abort on it (SIGABRT after a finished run).
        _exit_now(0)
    return 0


def _exit_now(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
