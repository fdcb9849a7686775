"""A torch TCPStore the orchestrator hosts for its nodes, listening only on the address it is given.

torch's TCPStore master binds every interface whatever host it is given, so a store meant for local nodes
would take connections from the network too. ``serve`` binds the socket itself, on ``host`` alone, and hands
the store the bound, listening descriptor (``master_listen_fd``). The port is the kernel's pick on that socket
(port 0): no other process can take it between the pick and the listen. Both stores the orchestrator hosts
use it: the pressure test's (``burnin.protocol``) and in-place recovery's (``recovery.storehost``); each
backend says which address its nodes reach (``ProbeSite.bind``: loopback locally, every interface for pods).

It is also the program of an in-place Kubernetes attempt's coordinator pod, ``python -m
trainyard.backends.store --port N``: a deferred train task keeps no process (every wake is a new one), so the
store the attempt's ranks regroup on is served by a pod of its own, from the trainer image, which no training
pod's loss takes down. It holds no secret and decides nothing (every value is sealed with the orchestrator's
per-node keys, so a forged one is refused by its reader) and listens on the pod's own IP only
(``TRAINYARD_STORE_BIND``, the downward API's ``status.podIP``): the pod network, through the attempt's
ClusterIP Service, never a host port. It runs until its pod is deleted with the attempt (SIGTERM: exit 0).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import threading
from datetime import timedelta
from typing import TYPE_CHECKING

from trainyard.protocol.env import STORE_BIND_VARIABLE

if TYPE_CHECKING:
    from torch.distributed import TCPStore

LOCAL_HOST = "127.0.0.1"


def serve(host: str = LOCAL_HOST, port: int = 0, timeout_s: float = 30.0) -> tuple[TCPStore, int]:
    """A store hosted in the calling process, listening on ``host`` only; the store and its port.

    It must outlive every node that uses it, so never call this in a training process.
    """
    from torch.distributed import TCPStore

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.create_server((host, port), family=family, backlog=128)
    bound = listener.getsockname()[1]
    try:
        store = TCPStore(
            host,
            bound,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=timeout_s),
            master_listen_fd=listener.fileno(),
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the descriptor now: closing the Python socket would close its listener
    return store, bound


def main(argv: list[str] | None = None) -> int:
    """The coordinator pod: serve on ``$TRAINYARD_STORE_BIND:--port`` until SIGTERM."""
    parser = argparse.ArgumentParser(prog="python -m trainyard.backends.store", description=__doc__)
    parser.add_argument("--port", type=int, required=True, help="the port to listen on (the Service's target)")
    args = parser.parse_args(argv)
    host = os.environ.get(STORE_BIND_VARIABLE, "").strip()
    if not host:
        print(f"{STORE_BIND_VARIABLE} is not set: the pod's IP (downward API status.podIP)", file=sys.stderr)
        return 2
    store, _ = serve(host, args.port)
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
