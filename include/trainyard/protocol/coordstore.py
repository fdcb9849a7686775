"""The coordination store of in-place recovery: hosted by the supervisor, never by a node.

A training node can die at any moment, so the store that survivors regroup on
lives in the supervisor's process (``trainyard.recovery.storehost``); workers
reach it through ``TRAINYARD_STORE=host:port`` (``trainyard.runtime.elastic``).
The supervisor talks to it through ``Coordinator``.

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
it); the store a ``Coordinator`` is given does.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from trainyard.atomic import loads_untrusted
from trainyard.protocol.sealing import Forged, node_key, seal, unseal

if TYPE_CHECKING:
    from torch.distributed import Store

log = logging.getLogger(__name__)
T = TypeVar("T")

KEY_ENV = "TRAINYARD_STORE_KEY"  # declared by ``TrainEnv.store_key``
PURPOSE = "coordstore"  # what the node keys are derived for (a burn-in key of the same node opens nothing here)
POLL_S = 0.1  # store polling stays <= 10 Hz: 2 cores are shared by every rank and the supervisor
FAULT_CHECK_S = 0.05  # the supervisor alone checks this often: one key, one round trip to its own store
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


def _count(text: str) -> int:
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


# ---------------------------------------------------------------- the supervisor's side (every node's key)


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
        return self._read(spare_key(node), node, _count) is not None

    def spares_ready(self, nodes: list[str]) -> list[str]:
        """Those of ``nodes`` up as warm spares, in the order given."""
        return [node for node in nodes if self.spare_ready(node)]

    def _step(self, g: int, node: str) -> int | None:
        return self._read(ready_key(g, node), node, _count)

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
        reports = {node: self._read(leave_key(node), node, _count) for node in self.keys}
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
