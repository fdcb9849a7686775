"""The orchestrator's side of an in-place Kubernetes attempt's coordination store (``PodStore``).

The store itself is served by a pod per attempt (``regroup.coordinator_pod``); what makes its values
believable stays with the orchestrator: the attempt's secret, from which every node's key is derived
(``coordstore.node_keys``). A deferred train task is a new process at every wake, so the secret is kept in a
file of the run's own folder (``secrets_dir``: ``<run>/store``), which no pod mounts
(``paths.attempt_paths`` mounts only the heartbeat, checkpoint, events and dataset folders): 0700 folder,
0600 file, written whole (temporary name, rename). The pods get only their own node's key, through the
attempt's Secret.

The ``Coordinator`` of an attempt remembers the generation it published in memory only; a new process
starts it knowing none, and the deferred driver recalls the ledger's (``Deferred``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Protocol

from trainyard.atomic import read_capped, write_bytes_atomic
from trainyard.backends.base import LaunchPlan
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import attempt_prefix, node_keys
from trainyard.protocol.sealing import new_secret

SECRET_BYTES = 32
CONNECT_S = 600.0  # the coordinator pod may wait for its image and a node: the first publish waits this long


class StoreServing(Protocol):
    """What a ``PodStore`` needs of the launcher (``KubernetesLauncher``)."""

    def store_endpoint(self, plan: LaunchPlan) -> str: ...

    def serve_store(self, plan: LaunchPlan) -> str: ...


class PodStore:
    """Keys and coordinators of the attempts of one run whose stores are pods; ``plan_for(attempt)`` is any
    plan of that attempt (its names and keys; not its nodes)."""

    def __init__(
        self,
        launcher: StoreServing,
        secrets_dir: Path,
        nodes: list[str],
        plan_for: Callable[[int], LaunchPlan],
        on_refused: Callable[[int, str, str], None] | None = None,
    ) -> None:
        self.launcher, self.secrets_dir, self.nodes = launcher, secrets_dir, list(nodes)
        self.plan_for, self.on_refused = plan_for, on_refused
        self._coordinators: dict[int, Coordinator] = {}
        self._reach: dict[int, str] = {}

    def _secret(self, attempt: int) -> bytes:
        """The attempt's secret: drawn once, then read back by every later process of the task."""
        path = self.secrets_dir / f"attempt-{attempt}.secret"
        if path.exists() or path.is_symlink():
            data = read_capped(path, SECRET_BYTES)  # a link or another kind of file is refused (UnsafePath)
            if len(data) != SECRET_BYTES:  # never drawn again: the attempt's pods hold keys from this one
                raise ValueError(f"{path}: {len(data)} bytes, not a secret of {SECRET_BYTES}; its attempt cannot go on")
            return data
        self.secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.secrets_dir, 0o700)
        secret = new_secret()
        write_bytes_atomic(path, secret, mode=0o600)
        return secret

    def keys(self, attempt: int) -> dict[str, str]:
        """Each node's key to ``attempt``'s store (a fresh secret per attempt)."""
        return node_keys(self._secret(attempt), self.nodes)

    def address_for(self, attempt: int) -> str:
        """Where the ranks of ``attempt`` dial its store (pure: the plan's names)."""
        return self.launcher.store_endpoint(self.plan_for(attempt))

    def reach(self, attempt: int) -> str:
        """``host:port`` where the orchestrator (task or trigger) dials ``attempt``'s store, served first if it
        is not yet (the Service's cluster IP: stable while the Service lives)."""
        if attempt not in self._reach:
            self._reach[attempt] = self.launcher.serve_store(self.plan_for(attempt))
        return self._reach[attempt]

    def coordinator(self, attempt: int) -> Coordinator:
        """The orchestrator's side of ``attempt``'s store, its store served first if it is not yet."""
        if attempt not in self._coordinators:
            from torch.distributed import PrefixStore, TCPStore

            host, _, port = self.reach(attempt).rpartition(":")
            client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=CONNECT_S))
            client.set_timeout(timedelta(seconds=30))  # connected: each call answers at once
            report = self.on_refused
            self._coordinators[attempt] = Coordinator(
                PrefixStore(attempt_prefix(attempt), client),
                self.keys(attempt),
                (lambda key, why: report(attempt, key, why)) if report is not None else None,
            )
        return self._coordinators[attempt]
