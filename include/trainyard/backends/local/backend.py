"""The local backend: nodes are slices of this host (``node-0`` ...), run as processes.

There is nothing to mark: an evicted local node's mark is its fleet history,
which also says when its cool-down ends.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping, Sequence
from pathlib import Path

from trainyard.backends.backend import History, Pool
from trainyard.backends.local.launcher import LocalLauncher
from trainyard.backends.local.probes import LocalProbes
from trainyard.spec import NodesSpec

SHM = Path("/dev/shm")


def local_kind() -> str:
    """Local candidates are slices of this host: their history is this host's."""
    return f"local:{socket.gethostname()}"


class LocalBackend:
    name = "local"
    defers = False
    wake_every_s: float | None = None
    trigger: str | None = None
    marks: str | None = None

    def __init__(self, nodes: NodesSpec) -> None:
        self.nodes = nodes
        # Shared memory (RAM, not the disk): a local node's processes end at a relaunch, this host's memory stays.
        self.snapshot_root: Path | None = SHM / "trainyard" if SHM.is_dir() else None

    def candidates(self) -> list[str]:
        return [f"node-{i}" for i in range(self.nodes.count + self.nodes.spare)]

    def pool(self, history: History, now: float, cooldown_s: float) -> Pool:
        everyone = self.candidates()
        sitting_out = history.cooling(everyone, now, cooldown_s)
        names = [n for n in everyone if n not in sitting_out]
        return Pool(names, history.due(names, now, cooldown_s), sitting_out)

    def kinds(self, nodes: Sequence[str]) -> dict[str, str]:
        return dict.fromkeys(nodes, local_kind())

    def probe_site(self) -> LocalProbes:
        return LocalProbes(self.nodes.gpus_per_node)

    def launcher(self) -> LocalLauncher:
        return LocalLauncher(self.nodes.gpus_per_node)

    def exclude(self, nodes: Sequence[str], reasons: Mapping[str, str] | None = None) -> list[str]:
        return []

    def readmit(self, nodes: Sequence[str]) -> list[str]:
        return []
