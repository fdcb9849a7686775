"""The supervisor's side of one attempt's coordination store (``trainyard.protocol.coordstore``: keys, values,
the worker's side, and why every value is sealed): it holds every node's key, publishes each generation sealed
once per node, and reads the nodes' faults, readiness, leave notices and spare announcements, one node at a
time, refusing what does not open with the key it should.

Importing this module imports no torch; the store a ``Coordinator`` is given does.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from trainyard.protocol.coordstore import (
    POLL_S,
    FaultRecord,
    Generation,
    current_key,
    fault_key,
    faulted_key,
    gen_key,
    leave_key,
    parse_count,
    peek,
    ready_key,
    spare_key,
)
from trainyard.protocol.sealing import Forged, seal, unseal

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger(__name__)
T = TypeVar("T")
FAULT_CHECK_S = 0.05  # the supervisor alone checks this often: one key, one round trip to its own store


class Coordinator:
    """The supervisor's side of one attempt's store: publish generations, read faults, readiness and spares.

    ``keys`` maps every node that may take part in the attempt (its plan and its spares) to its key: the
    values of those nodes are the ones read, one by one, which bounds every loop. ``on_refused(key, why)``
    hears of the first refused value of each key (a warning is logged too); ``refused`` keeps them."""

    def __init__(
        self, store: Store, keys: Mapping[str, str], on_refused: Callable[[str, str], None] | None = None
    ) -> None:
        self.store, self.keys, self.on_refused = store, dict(keys), on_refused
        self.generation: Generation | None = None
        """The last generation published: the supervisor's own memory, never read back from the store."""
        self.refused: dict[str, str] = {}
        self._looked: dict[int, bytes] = {}  # generation -> the fault count last looked at (``_faulted``)
        self._faulted_gens: set[int] = set()
        self._leavers: dict[int, list[str]] = {}  # generation -> its leavers, as read at the last look

    def publish(self, gen: Generation) -> None:
        """Make ``gen`` current, sealed for every node (each copy of ``gen`` first: a node told of it by rank 0
        finds its own). Its members' spare announcements go (one started again must announce itself anew)."""
        if stray := [n for n in gen.members if n not in self.keys]:
            raise ValueError(f"generation {gen.number} lists {stray}, which hold no key of this attempt's store")
        text = gen.to_json()
        for node, key in self.keys.items():
            self.store.set(gen_key(gen.number, node), seal(key, gen_key(gen.number, node), text))
        for node, key in self.keys.items():
            self.store.set(current_key(node), seal(key, current_key(node), text))
        self.generation = gen
        self.forget(gen.members)

    def forget(self, nodes: list[str]) -> None:
        """Drop these nodes' spare announcements (they were listed, or their process is being replaced)."""
        for node in nodes:
            self.store.delete_key(spare_key(node))  # False when there was none

    def current(self) -> Generation | None:
        return self.generation

    def _refuse(self, name: str, why: str) -> None:
        if name in self.refused:
            return  # once per key: a value rewritten at every poll must not flood the log and the ledger
        self.refused[name] = why
        log.warning("coordination store: refused the value of %s (%s); acting as if it were not there", name, why)
        if self.on_refused is not None:
            self.on_refused(name, why)

    def _read(self, name: str, node: str, parse: Callable[[str], T]) -> T | None:
        """What ``node`` sealed under ``name``, parsed; None when there is nothing, or nothing authentic."""
        raw = peek(self.store, name) if node in self.keys else None
        if raw is None:
            return None
        try:
            return parse(unseal(self.keys[node], name, raw))
        except Forged as exc:
            self._refuse(name, f"{exc}: forged")
        except ValueError as exc:
            self._refuse(name, f"malformed: {exc}")
        return None

    def fault_records(self) -> dict[str, FaultRecord]:
        """Node -> its fault record, every node of the attempt that reported one (authentically)."""
        records = {node: self._read(fault_key(node), node, FaultRecord.from_json) for node in self.keys}
        return {node: record for node, record in records.items() if record is not None}

    def faults(self, generation: int | None = None) -> dict[str, str]:
        """Node -> the reason it reported (one line); only faults seen in ``generation`` when given."""
        return {
            node: f"generation {r.generation}: {r.error} (suspect: {r.suspect})"
            for node, r in self.fault_records().items()
            if generation is None or r.generation == generation
        }

    def spare_ready(self, node: str) -> bool:
        """Whether ``node`` is up as a warm spare (connected, model built, waiting to be listed)."""
        return self._read(spare_key(node), node, parse_count) is not None

    def spares_ready(self, nodes: list[str]) -> list[str]:
        """Those of ``nodes`` up as warm spares, in the order given."""
        return [node for node in nodes if self.spare_ready(node)]

    def _step(self, g: int, node: str) -> int | None:
        return self._read(ready_key(g, node), node, parse_count)

    def ready(self, g: int) -> list[str]:
        """The nodes that formed generation ``g``."""
        return [node for node in self.keys if self._step(g, node) is not None]

    def formed(self, g: int) -> bool:
        """Whether the current generation is ``g`` or a later one (a newer one may supersede ``g`` before
        its members formed it) and every member of it formed it."""
        current = self.generation
        return (
            current is not None
            and current.number >= g
            and all(self._step(current.number, n) is not None for n in current.members)
        )

    def ready_steps(self, g: int) -> dict[str, int]:
        """Node -> the committed step it continues from, for the nodes that formed generation ``g``."""
        steps = {node: self._step(g, node) for node in self.keys}
        return {node: step for node, step in steps.items() if step is not None}

    def _faulted(self, g: int) -> bool:
        """Whether a node reported an authentic fault of generation ``g``, or that it leaves it."""
        if g not in self._faulted_gens:
            self._look(g)
        return g in self._faulted_gens

    def leaving(self, g: int) -> list[str]:
        """The nodes that reported (authentically) that they leave generation ``g`` on notice: a report of ``g``,
        or of ``g - 1`` by a member of ``g``, who was given notice while ``g`` was being published (it left
        ``g - 1`` and will never form ``g``; a node that left ``g - 1`` before is not listed in ``g``)."""
        self._look(g)
        return list(self._leavers.get(g, []))

    def _look(self, g: int) -> None:
        """Read ``g``'s fault and leave reports if ``faulted/<g>`` or ``faulted/<g - 1>`` (a leave reported while
        ``g`` was published) moved since the last look: asked at every poll of the supervisor, it costs two
        round trips, and a count anyone adds to costs a read, never a loop."""
        count = b"/".join(peek(self.store, faulted_key(h)) or b"" for h in (g, g - 1) if h >= 1)
        if count.strip(b"/") == b"" or self._looked.get(g) == count:
            return
        self._looked[g] = count
        members = self.generation.members if self.generation is not None and self.generation.number == g else []
        reports = {node: self._read(leave_key(node), node, parse_count) for node in self.keys}
        self._leavers[g] = [n for n, r in reports.items() if r == g or (r == g - 1 and n in members)]
        if self._leavers[g] or any(record.generation == g for record in self.fault_records().values()):
            self._faulted_gens.add(g)

    def wait_fault(self, g: int, timeout_s: float) -> bool:
        """Whether a member of generation ``g`` reported a fault, waiting up to ``timeout_s`` for one.

        Checked every ``FAULT_CHECK_S``, not with the store's ``wait``: each of its timeouts logs a warning."""
        deadline = time.monotonic() + timeout_s
        while not self._faulted(g):
            if (left := deadline - time.monotonic()) <= 0:
                return False
            time.sleep(min(left, FAULT_CHECK_S))
        return True

    def wait_ready(self, g: int, members: list[str], timeout_s: float) -> bool:
        """Whether every one of ``members`` formed generation ``g`` within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self._step(g, node) is not None for node in members):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
