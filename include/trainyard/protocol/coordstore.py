"""The coordination store of in-place recovery: hosted by the supervisor, never by a node.

A training node can die at any moment, so the store that survivors regroup on
lives in the supervisor's process (``trainyard.recovery.storehost``); workers
reach it through ``TRAINYARD_STORE=host:port`` (``trainyard.runtime.elastic``).
The supervisor talks to it through ``Coordinator`` (``trainyard.protocol.coordinator``).

Trust. The store is a TCPStore: no authentication, and training code is
untrusted (any rank, and anyone who reaches the port, can read, write and delete
any key). So every value is sealed (``trainyard.protocol.sealing``): each attempt
has a secret that never leaves the supervisor, and each node gets its own key
derived from it (``node_keys``), in ``TRAINYARD_STORE_KEY``.

- A worker seals what it writes with its node's key, for the key's name: a rank
  speaks only for its own node (its fault, its readiness, its spare
  announcement), never for another.
- The supervisor seals the generation once per node, with that node's key,
  under a key of that node's own (``gen/now/<node>``, ``gen/<g>/<node>``), and
  each worker opens only its own. One shared key would let any rank forge the
  word to every other; per-node copies cost the supervisor one write per node
  and generation (rare), and a worker's poll stays one read and one HMAC. A node
  left out gets its copy too (so it goes); it moves only past its current number.
- A value that does not open with the key it should, or opens but is malformed
  (not JSON, wrong types), is refused: the supervisor logs it, tells
  ``on_refused`` (the train task records it in the ledger as ``store_refused``)
  and acts as if the key were empty; a worker logs it and waits for an
  authentic one. No read raises on what a value holds.
- The supervisor reads the keys of the nodes it holds keys for (the attempt's
  plan and spares), one by one: no list or counter a worker writes says how far
  it reads, so every loop over the store is bounded by that number of nodes. The
  generation it published it keeps in memory, never reads back.

Not guarded: someone who reaches the port can delete keys, put back a value a
key held before, or fill the store's memory (all look like silent nodes or a
host out of memory); the store binds loopback or the address it was given, so
that only the nodes reach it.

Keys, below the attempt's prefix (``attempt_prefix``); values are text, sealed but for ``faulted/<g>``:

    gen/now/<node>       the current ``Generation`` as JSON, for <node> (supervisor); the node polls it (<= 10 Hz)
    gen/<g>/<node>       generation g as JSON, for <node>, kept (supervisor)
    fault/<node>         JSON ``{"generation", "suspect", "error"}``: a survivor's collective failed in that
                         generation; ``suspect`` is the peer it blames, or "unknown" (worker)
    faulted/<g>          a counter a reporter adds to: only a wake-up; the supervisor believes a fault of g
                         once it finds an authentic ``fault/<node>`` of generation g (worker)
    ready/<g>/<node>     the node formed generation g and holds the state of step ``value`` (worker)
    spare/<node>         a warm spare is waiting to be listed; the value: the generation it saw (worker)
    leave/<node>         notice (SIGTERM): the node leaves generation ``value`` at a step boundary (worker)

A generation lists its members in rank order (a member's rank is its index);
``joiners`` are members without the training state, which the others send them
by broadcast. ``from_step`` is the last committed step the supervisor expects
them to continue from (None: the workers agree on it among themselves).

Importing this module imports no torch (the supervisor's decisions don't need
it); the store a ``Coordinator`` is given does. This module holds the key schema, the values and the
worker's side; ``coordinator`` the supervisor's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from trainyard.atomic import loads_untrusted
from trainyard.protocol.sealing import node_key, seal, unseal

if TYPE_CHECKING:
    from torch.distributed import Store


KEY_ENV = "TRAINYARD_STORE_KEY"  # declared by ``TrainEnv.store_key``
PURPOSE = "coordstore"  # what the node keys are derived for (a burn-in key of the same node opens nothing here)
POLL_S = 0.1  # store polling stays <= 10 Hz: 2 cores are shared by every rank and the supervisor
ERROR_CHARS = 500  # what a fault record's error keeps: the reporter's text, cut
_ABSENT = "\0absent"  # what ``peek`` compares with: no sealed value starts with a NUL


def current_key(node: str) -> str:
    """The current generation, as the supervisor sealed it for ``node``."""
    return f"gen/now/{node}"


def gen_key(g: int, node: str) -> str:
    """Generation ``g``, as the supervisor sealed it for ``node``."""
    return f"gen/{g}/{node}"


def fault_key(node: str) -> str:
    return f"fault/{node}"


def ready_key(g: int, node: str) -> str:
    return f"ready/{g}/{node}"


def spare_key(node: str) -> str:
    return f"spare/{node}"


def leave_key(node: str) -> str:
    return f"leave/{node}"


def faulted_key(g: int) -> str:
    """A counter a member of generation ``g`` adds to once it reported a fault: the supervisor's wake-up."""
    return f"faulted/{g}"


def node_keys(secret: bytes, nodes: list[str]) -> dict[str, str]:
    """Each node's key (hex) for one attempt's store, from the attempt's ``secret`` (``sealing.new_secret``)."""
    return {node: node_key(secret, node, PURPOSE) for node in nodes}


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(n, str) for n in value)


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
        """Parse a generation record; ``ValueError`` (never another error) names the field that is malformed."""
        raw = loads_untrusted(text, "generation record")
        if not isinstance(raw, dict):
            raise ValueError(f"generation record must be a JSON object, not {type(raw).__name__}")
        if missing := [f for f in ("number", "members", "micro_batch") if f not in raw]:
            raise ValueError(f"generation record lacks the field '{missing[0]}'; publish it with Generation.to_json")
        joiners, from_step = raw.get("joiners", []), raw.get("from_step")
        if not (_is_int(raw["number"]) and _is_int(raw["micro_batch"])):
            raise ValueError("generation record: number and micro_batch must be integers")
        if not (_names(raw["members"]) and _names(joiners)):
            raise ValueError("generation record: members and joiners must be lists of node names")
        if from_step is not None and not _is_int(from_step):
            raise ValueError(f"generation record: from_step must be an integer or null, not {type(from_step).__name__}")
        return cls(raw["number"], raw["members"], raw["micro_batch"], joiners, from_step)


@dataclass(frozen=True)
class FaultRecord:
    """What a survivor reported when its collective failed (``fault/<node>``)."""

    generation: int
    suspect: str
    error: str

    @classmethod
    def from_json(cls, text: str) -> FaultRecord:
        raw = loads_untrusted(text, "fault record")
        if not (isinstance(raw, dict) and _is_int(raw.get("generation"))):
            raise ValueError("fault record must be a JSON object with an integer generation")
        if not (isinstance(raw.get("suspect"), str) and isinstance(raw.get("error"), str)):
            raise ValueError("fault record: suspect and error must be text")
        return cls(raw["generation"], raw["suspect"][:200], raw["error"][:ERROR_CHARS])


def parse_count(text: str) -> int:
    """A step or generation number a worker wrote (a joiner's step is -1)."""
    value = loads_untrusted(text, "number")
    if not _is_int(value) or value < -1:
        raise ValueError(f"must be an integer >= -1, not {type(value).__name__}")
    return int(value)


def peek(store: Store, name: str) -> bytes | None:
    """``name``'s value or None, in one round trip that never waits (a check then a get may wait out a timeout)."""
    raw = store.compare_set(name, _ABSENT, _ABSENT)  # sets nothing: the key is absent, or holds another value
    return None if raw == _ABSENT.encode() else raw


def attempt_prefix(attempt: int) -> str:
    """One attempt's key prefix (both sides wrap the store in it): no dead attempt's group keys are ever met."""
    return f"attempt-{attempt}"


# ---------------------------------------------------------------- the worker's side (its node's key)


def report_fault(store: Store, node: str, key: str, generation: int, error: str, suspect: str | None = None) -> None:
    """A worker's report that its collective failed (the worker side, here beside the key schema)."""
    record = {"generation": generation, "suspect": suspect or "unknown", "error": error[:ERROR_CHARS]}
    store.set(fault_key(node), seal(key, fault_key(node), json.dumps(record)))
    store.add(faulted_key(generation), 1)


def report_ready(store: Store, g: int, node: str, key: str, step: int) -> None:
    store.set(ready_key(g, node), seal(key, ready_key(g, node), str(step)))


def announce_spare(store: Store, node: str, key: str, seen: int) -> None:
    """A warm spare is up (connected, model built) and saw generation ``seen``, which does not list it."""
    store.set(spare_key(node), seal(key, spare_key(node), str(seen)))


def report_leave(store: Store, node: str, key: str, generation: int) -> None:
    """A node given notice leaves ``generation`` at this step boundary; the supervisor wakes as on a fault."""
    store.set(leave_key(node), seal(key, leave_key(node), str(generation)))
    store.add(faulted_key(generation), 1)


def open_generation(key: str, name: str, raw: bytes) -> Generation:
    """The generation the supervisor sealed under ``name`` for the holder of ``key``; ``ValueError`` (``Forged``
    among them) when it is not authentic or malformed."""
    return Generation.from_json(unseal(key, name, raw))
