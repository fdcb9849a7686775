"""The pods of one attempt as a list and the watch after it say: what the trigger reads instead of listing.

Listing an attempt's pods costs the API server, the network and the client (each pod deserialized into a
model, ~1.7 ms of CPU) in proportion to the pods, every poll. The trigger lists once, then watches from the
list's ``resourceVersion`` (``api.watch_pods``) and keeps the pods here, so a poll's cost does not grow with
the attempt. Pure: the async executor (``aio.watch``) feeds it; it calls no API.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class PodCache:
    pods: dict[str, Any] = field(default_factory=dict)
    """Pod name -> the pod (a client model), as last seen."""
    version: str | None = None
    """The ``resourceVersion`` to watch from; None: list first (never listed, or the server forgot it: 410)."""
    failure: BaseException | None = None
    """The last list or watch that failed, until one connects: a poll counts it as it counts its own."""

    def listed(self, pods: list[Any], version: str) -> None:
        self.pods = {p.metadata.name: p for p in pods}
        self.version, self.failure = version, None

    def connected(self) -> None:
        self.failure = None

    def seen(self, kind: str, pod: Any) -> None:
        """An ``ADDED``, ``MODIFIED`` or ``DELETED`` event."""
        if kind == "DELETED":
            self.pods.pop(pod.metadata.name, None)
        else:
            self.pods[pod.metadata.name] = pod
        self.version = pod.metadata.resource_version or self.version

    def bookmark(self, version: str) -> None:
        self.version = version

    def expire(self) -> None:
        """The server no longer has the history after ``version`` (410 Gone): list again; the pods stay
        the last known until then."""
        self.version = None
