"""The coordination store hosted by the train task: the server the ranks of an in-place attempt regroup on.

The keys and values are the wire's (``trainyard.protocol.coordstore``); this is the orchestrator's side
that owns the server, so the store outlives any node.
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

from trainyard.protocol.coordstore import attempt_prefix

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore


def serve(host: str = "127.0.0.1", port: int = 0) -> tuple[TCPStore, int]:
    """Host the store in the calling process (the supervisor's); the store and the port it listens on.

    It must outlive every node, so never call this in a training process.
    """
    from torch.distributed import TCPStore

    store = TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    return store, store.port


def attempt_store(store: Store, attempt: int) -> Store:
    """The keys of one training attempt (``attempt_prefix``), as the ranks see them."""
    from torch.distributed import PrefixStore

    return PrefixStore(attempt_prefix(attempt), store)
