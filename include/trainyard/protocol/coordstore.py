"""The coordination store of in-place recovery: hosted by the supervisor, never by a node.

A training node can die at any moment, so the store that survivors regroup on
lives in the supervisor's process (``serve``); workers reach it through
``TRAINYARD_STORE=host:port`` (``trainyard.runtime.elastic``). The supervisor
talks to it through ``Coordinator``. Keys (all values are text):

    gen                  the current ``Generation`` as JSON (supervisor); workers poll it (<= 10 Hz)
    gen/<g>              generation g as JSON, kept (supervisor)
    fault/<node>         JSON ``{"generation", "suspect", "error"}``: a survivor's collective failed in that
                         generation; ``suspect`` is the peer it blames, or "unknown" (worker)
    faults, faults/#<i>  a counter and the nodes that reported a fault, the i-th under ``#<i>`` (worker): the
                         store cannot list keys, so this index is how ``Coordinator.faults`` finds them
    ready/<g>/<node>     the node formed generation g and holds the state of step ``value`` (worker)
    ready/<g>, ready/<g>/#<i>  a counter and the nodes that formed generation g, as ``faults`` (worker)
    spare/<node>         a warm spare is waiting to be listed; the value: the generation it saw (worker)

A generation lists its members in rank order (a member's rank is its index);
``joiners`` are members without the training state, which the others send them
by broadcast. ``from_step`` is the last committed step the supervisor expects
them to continue from (None: the workers agree on it among themselves).

Importing this module imports no torch (the supervisor's decisions don't need
it); ``serve`` and ``Coordinator``'s store do.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch.distributed import Store

GEN = "gen"
FAULTS = "faults"
POLL_S = 0.1  # store polling stays <= 10 Hz: 2 cores are shared by every rank and the supervisor
FAULT_CHECK_S = 0.05  # the supervisor alone checks this often: one key, one round trip to its own store


def gen_key(g: int) -> str:
    return f"gen/{g}"


def fault_key(node: str) -> str:
    return f"fault/{node}"


def ready_key(g: int, node: str | None = None) -> str:
    return f"ready/{g}" if node is None else f"ready/{g}/{node}"


def spare_key(node: str) -> str:
    return f"spare/{node}"


def faulted_key(g: int) -> str:
    """Exists once a member of generation ``g`` reported a fault: the supervisor waits on it between polls."""
    return f"faulted/{g}"


@dataclass(frozen=True)
class Generation:
    """One membership of the training world: who trains, with what micro-batch, who needs the state."""

    number: int
    members: list[str]
    """Node names in rank order."""
    micro_batch: int
    joiners: list[str] = field(default_factory=list)
    from_step: int | None = None

    def __post_init__(self) -> None:
        if self.number < 1:
            raise ValueError(f"Generation.number={self.number} must be >= 1")
        if not self.members or len(set(self.members)) != len(self.members):
            raise ValueError(f"Generation.members={self.members} must be distinct node names, at least one")
        if stray := [n for n in self.joiners if n not in self.members]:
            raise ValueError(f"Generation.joiners {stray} are not members {self.members}; list them in members too")
        if self.micro_batch < 1:
            raise ValueError(f"Generation.micro_batch={self.micro_batch} must be >= 1")

    @property
    def world(self) -> int:
        return len(self.members)

    def rank_of(self, node: str) -> int | None:
        return self.members.index(node) if node in self.members else None

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> Generation:
        """Parse a generation record; ``ValueError`` names the field that is missing or malformed."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"generation record is not JSON ({exc}); publish it with Generation.to_json") from None
        if not isinstance(raw, dict):
            raise ValueError(f"generation record must be a JSON object, not {type(raw).__name__}")
        try:
            return cls(
                number=int(raw["number"]),
                members=[str(n) for n in raw["members"]],
                micro_batch=int(raw["micro_batch"]),
                joiners=[str(n) for n in raw.get("joiners", [])],
                from_step=None if raw.get("from_step") is None else int(raw["from_step"]),
            )
        except KeyError as exc:
            raise ValueError(f"generation record lacks the field {exc}; publish it with Generation.to_json") from None


def attempt_prefix(attempt: int) -> str:
    """The key prefix of one training attempt: each attempt numbers its generations from 1 again, and a
    process group's keys must never meet a dead attempt's (both sides wrap the served store in it)."""
    return f"attempt-{attempt}"


def _append(store: Store, key: str, item: str) -> None:
    """Add ``item`` to the list ``key``: a counter, then ``key/<i>`` (the store cannot list its keys)."""
    store.set(f"{key}/#{store.add(key, 1)}", item)


def _items(store: Store, key: str) -> list[str]:
    """The distinct items of the list ``key``, in the order they were added."""
    seen: list[str] = []
    for i in range(1, store.add(key, 0) + 1):
        if store.check([f"{key}/#{i}"]) and (item := store.get(f"{key}/#{i}").decode()) not in seen:
            seen.append(item)
    return seen


def report_fault(store: Store, node: str, generation: int, error: str, suspect: str | None = None) -> None:
    """A worker's report that its collective failed (the worker side, here beside the key schema)."""
    record = {"generation": generation, "suspect": suspect or "unknown", "error": error[:500]}
    store.set(fault_key(node), json.dumps(record))
    _append(store, FAULTS, node)
    store.add(faulted_key(generation), 1)


def report_ready(store: Store, g: int, node: str, step: int) -> None:
    store.set(ready_key(g, node), str(step))
    _append(store, ready_key(g), node)


class Coordinator:
    """The supervisor's side of the store: publish generations, read faults and readiness."""

    def __init__(self, store: Store):
        self.store = store

    def publish(self, gen: Generation) -> None:
        """Make ``gen`` the current generation (its own key first, so a reader of ``gen`` finds it).

        Its members are no longer spares: their announcements go (a member that dies and is started again
        must announce itself anew before it counts as ready)."""
        text = gen.to_json()
        self.store.set(gen_key(gen.number), text)
        self.store.set(GEN, text)
        self.forget(gen.members)

    def forget(self, nodes: list[str]) -> None:
        """Drop these nodes' spare announcements (they were listed, or their process is being replaced)."""
        for node in nodes:
            if self.store.check([spare_key(node)]):
                self.store.delete_key(spare_key(node))

    def current(self) -> Generation | None:
        return Generation.from_json(self.store.get(GEN)) if self.store.check([GEN]) else None

    def fault_records(self) -> dict[str, dict[str, Any]]:
        """Node -> its fault record (``generation``, ``suspect``, ``error``), every node that reported one."""
        return {node: json.loads(self.store.get(fault_key(node))) for node in _items(self.store, FAULTS)}

    def faults(self, generation: int | None = None) -> dict[str, str]:
        """Node -> the reason it reported (one line); only faults seen in ``generation`` when given."""
        return {
            node: f"generation {r['generation']}: {r['error']} (suspect: {r['suspect']})"
            for node, r in self.fault_records().items()
            if generation is None or r["generation"] == generation
        }

    def spare_ready(self, node: str) -> bool:
        """Whether ``node`` is up as a warm spare (connected, model built, waiting to be listed)."""
        return self.store.check([spare_key(node)])

    def spares_ready(self, nodes: list[str]) -> list[str]:
        """Those of ``nodes`` up as warm spares, in the order given."""
        return [node for node in nodes if self.spare_ready(node)]

    def ready(self, g: int) -> list[str]:
        """The nodes that formed generation ``g``."""
        return _items(self.store, ready_key(g))

    def formed(self, g: int) -> bool:
        """Whether the current generation is ``g`` or a later one (a newer one may supersede ``g`` before
        its members formed it) and every member of it formed it."""
        current = self.current()
        return current is not None and current.number >= g and set(current.members) <= set(self.ready(current.number))

    def ready_steps(self, g: int) -> dict[str, int]:
        """Node -> the committed step it continues from, for the nodes that formed generation ``g``."""
        return {node: int(self.store.get(ready_key(g, node))) for node in self.ready(g)}

    def wait_fault(self, g: int, timeout_s: float) -> bool:
        """Whether a member of generation ``g`` reported a fault, waiting up to ``timeout_s`` for one.

        Checked every ``FAULT_CHECK_S``, not with the store's ``wait``: each of its timeouts logs a warning."""
        deadline = time.monotonic() + timeout_s
        while not self.store.check([faulted_key(g)]):
            if (left := deadline - time.monotonic()) <= 0:
                return False
            time.sleep(min(left, FAULT_CHECK_S))
        return True

    def wait_ready(self, g: int, members: list[str], timeout_s: float) -> bool:
        """Whether every one of ``members`` formed generation ``g`` within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if set(members) <= set(self.ready(g)):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(POLL_S)
