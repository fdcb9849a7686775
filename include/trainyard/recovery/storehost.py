"""The coordination store hosted by the train task: the server the ranks of an in-place attempt regroup on.

The keys and values are the wire's (``trainyard.protocol.coordstore``); this is the orchestrator's side
that owns the server, so the store outlives any node, and the secrets that make its values believable:
one per attempt, drawn here and never handed out (``StoreHost``), from which each node's key is derived.

The server listens only where it is told (loopback for local nodes): ``backends.store.serve``, the one way
the orchestrator hosts a store (``serve`` is re-exported here for the tests that host one by hand).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from trainyard.backends.store import LOCAL_HOST, serve
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import attempt_prefix, node_keys
from trainyard.protocol.sealing import new_secret

if TYPE_CHECKING:
    from torch.distributed import Store, TCPStore


def attempt_store(store: Store, attempt: int) -> Store:
    """The keys of one training attempt (``attempt_prefix``), as the ranks see them."""
    from torch.distributed import PrefixStore

    return PrefixStore(attempt_prefix(attempt), store)


class StoreHost:
    """The store of one train task, the nodes that may take part in its attempts (the plan's and the spares),
    and each attempt's secret: ``keys`` go to the nodes (each its own), ``coordinator`` is the supervisor's
    side. ``on_refused(attempt, key, why)`` hears of each value the supervisor refused."""

    def __init__(
        self,
        store: TCPStore,
        host: str,
        port: int,
        nodes: list[str],
        on_refused: Callable[[int, str, str], None] | None = None,
    ) -> None:
        self.store, self.address, self.nodes, self.on_refused = store, f"{host}:{port}", list(nodes), on_refused
        self._secrets: dict[int, bytes] = {}
        self._coordinators: dict[int, Coordinator] = {}

    @classmethod
    def serve(
        cls, nodes: list[str], host: str = LOCAL_HOST, on_refused: Callable[[int, str, str], None] | None = None
    ) -> StoreHost:
        store, port = serve(host)
        return cls(store, host, port, nodes, on_refused)

    def reach(self, attempt: int) -> str | None:
        """Nowhere outside this process: the store lives and dies with it (no trigger waits on it)."""
        return None

    def address_for(self, attempt: int) -> str:
        """Where the ranks of any attempt dial: this task's one store."""
        return self.address

    def keys(self, attempt: int) -> dict[str, str]:
        """Each node's key to ``attempt``'s keys: a fresh secret per attempt, so nothing sealed in one attempt
        is believed in another."""
        if attempt not in self._secrets:
            self._secrets[attempt] = new_secret()
        return node_keys(self._secrets[attempt], self.nodes)

    def coordinator(self, attempt: int) -> Coordinator:
        """The supervisor's side of ``attempt``: one per attempt, which remembers what it published."""
        if attempt not in self._coordinators:
            report = self.on_refused
            self._coordinators[attempt] = Coordinator(
                attempt_store(self.store, attempt),
                self.keys(attempt),
                (lambda key, why: report(attempt, key, why)) if report is not None else None,
            )
        return self._coordinators[attempt]
