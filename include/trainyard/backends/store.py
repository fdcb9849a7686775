"""A torch TCPStore the orchestrator hosts for its nodes, listening only on the address it is given.

torch's TCPStore master binds every interface whatever host it is given, so a store meant for local nodes
would take connections from the network too. ``serve`` binds the socket itself, on ``host`` alone, and hands
the store the bound, listening descriptor (``master_listen_fd``). The port is the kernel's pick on that socket
(port 0): no other process can take it between the pick and the listen. Both stores the orchestrator hosts
use it: the pressure test's (``burnin.protocol``) and in-place recovery's (``recovery.storehost``); each
backend says which address its nodes reach (``ProbeSite.bind``: loopback locally, every interface for pods).
"""

from __future__ import annotations

import socket
from datetime import timedelta
from typing import TYPE_CHECKING

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
