"""The coordinator pod of an in-place Kubernetes attempt: ``python -m trainyard.runtime.storeserve``.

A deferred train task has no process that stays (every wake is a new one), so the coordination store an
attempt's ranks regroup on (``trainyard.protocol.coordstore``) is served by a pod of its own, from the trainer
image, which no training pod's loss takes down. It is a bare TCPStore master: it holds no secret and
decides nothing. Every value in it is sealed by the orchestrator's per-node keys, so a value forged by
anyone who reaches it is refused by the reader; the pod only keeps them.

It listens on the pod's own IP only (``TRAINYARD_STORE_BIND``, the downward API's ``status.podIP``): the
pod network, through the attempt's ClusterIP Service, never a host port. torch's TCPStore master binds
every interface whatever host it is given, so the socket is bound here and its listening descriptor handed
to the store (as ``trainyard.recovery.storehost.serve`` does in a task process).

It runs until its pod is deleted with the attempt (SIGTERM: it exits 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from datetime import timedelta

from trainyard.protocol.env import STORE_BIND_VARIABLE as BIND_VARIABLE


def serve(host: str, port: int) -> object:
    """The store master listening on ``host:port`` only; kept alive by the caller."""
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=128)
    try:
        store = TCPStore(
            host,
            listener.getsockname()[1],
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=30),
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now
    return store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainyard.runtime.storeserve", description=__doc__)
    parser.add_argument("--port", type=int, required=True, help="the port to listen on (the Service's target)")
    args = parser.parse_args(argv)
    host = os.environ.get(BIND_VARIABLE, "").strip()
    if not host:
        print(f"{BIND_VARIABLE} is not set: the pod's IP (downward API status.podIP)", file=sys.stderr)
        return 2
    store = serve(host, args.port)
    print(f"coordination store on {host}:{args.port}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    while not done.wait(1.0):  # a bounded wait: the signal handler runs between them
        pass
    del store
    return 0


if __name__ == "__main__":
    sys.exit(main())
