"""``python -m trainyard.train``: the reference workload's entry point (see ``trainyard.train.loop``).

Owns process setup and teardown only: logging, the process group, and turning
trainyard errors into one line and a non-zero exit instead of a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

from trainyard.errors import TrainyardError
from trainyard.train import loop, runtime


def main(argv: list[str] | None = None) -> int:
    args = loop.parse_args(argv)
    rank = os.environ.get("RANK", "0")  # torchrun interleaves ranks' output; say whose line it is
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(name)s %(levelname)s %(message)s")
    try:
        ctx = runtime.context()
    except ValueError as exc:
        print(f"trainyard.train: {exc}", file=sys.stderr)
        return 2
    loop.init_process_group()
    try:
        loop.train(args, ctx)
    except TrainyardError as exc:
        print(f"trainyard.train: rank {dist.get_rank()}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
