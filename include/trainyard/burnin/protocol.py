"""The orchestrator's side of the pressure test, whatever runs the candidates.

Candidates meet at a store this process hosts (see ``trainyard.burnin.node``
for their side and its numbered instructions). Their local probes run in
short turns. Local nodes share this host's cores, so each turn goes from node
to node (together they would measure the scheduler); a cluster's nodes are
machines of their own, so each turn probes them all at once (one node after
another would give each of 512 nodes a 512th of the time, and make the stage
grow with the cluster). Then every node that reported joins one group for
the all-reduce and the pairwise link test. A node below a threshold is only a
suspect: ``recheck`` (the verdict's) names whom to probe again, one at a
time, with the reference node, and which links to test again, and the
verdict is made on both rounds (a suspect the second round left unsure is
probed a third time). A node that does not start or answer within
its deadline is dead and is stopped; nothing outlives the stage. Every value
is signed with the candidate's per-run key (``trainyard.burnin.sealing``): a
value someone else wrote fails the stage, it never decides a node's fate.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, get_args

from trainyard.atomic import loads_untrusted
from trainyard.backends.store import serve
from trainyard.burnin.figures import combine
from trainyard.burnin.sealing import StoreTampered, seal, unseal
from trainyard.burnin.verdict import Recheck
from trainyard.spec import DrillFault, PressureTestSpec

if TYPE_CHECKING:  # torch only where a store is hosted (``serve``): an Airflow task that stages data never pays for it
    import torch.distributed as dist

FAULTS = get_args(DrillFault)
TURNS = 5
"""Turns of the local probes in the first round (see ``Conductor.probe_in_turns``)."""
TURNS_AGAIN = 10
"""Turns of the confirmation round: it decides an eviction, so it measures twice as long. It probes only the
suspects and the reference node, so it costs a healthy batch nothing and a batch with one suspect little."""
STARTUP_S = 30.0
"""How long a local candidate may take to start: importing torch in several fresh processes at once on a small
machine that is busy with something else took over 10 s. A candidate that dies sooner is seen at once (``_wait``)."""
ALIVE_EVERY_S = 0.5
"""How often a wait asks whether its candidate still lives: for a pod that is a read from the API server, and a
wait polls the store every few milliseconds."""


class Candidate(Protocol):
    """One candidate node's process or pod, as the orchestrator sees it."""

    def alive(self) -> bool: ...

    def kill(self) -> None: ...

    def why(self, default: str) -> str:
        """Why it failed (exit and last words), else ``default`` (the deadline it missed)."""
        ...


@dataclass
class BurnInRun:
    """What each candidate reported; ``dead`` says why a node has no figures."""

    local: dict[str, dict[str, Any]] = field(default_factory=dict)
    collective: dict[str, dict[str, float]] = field(default_factory=dict)
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    """Node -> partner -> GB/s of the pairwise link test."""
    dead: dict[str, str] = field(default_factory=dict)
    again: dict[str, dict[str, Any]] = field(default_factory=dict)
    """The confirmation round's local figures (suspects and the reference node): the median of ``again_turns``."""
    again_turns: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    """The same, turn by turn (the verdict pairs a suspect's turns with its reference node's)."""
    links_again: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass(frozen=True)
class Schedule:
    slot_s: float
    collective_s: float
    """The all-reduce's budget."""
    pairs_s: float
    """The pairwise link test's budget, shared by its rounds."""
    grace_s: float

    @classmethod
    def of(cls, cfg: PressureTestSpec, candidates: int, shared: bool = True) -> Schedule:
        """Split ``duration_s``: 60% for the local probes (in turns), 10% for the all-reduce, 30% for the pairs.

        ``slot_s`` is each node's share of the local probes' time: a ``candidates``-th of it when they share
        one host (they take turns), the whole of it when each node is a machine of its own (all probe at once).

        The pairs get the larger share because they are what localizes a slow
        link: measured in turns of a few round trips, a pair's figure swings by
        a third on a shared host, as much as the half-speed link it must find.
        """
        d = cfg.duration_s
        share = max(candidates, 1) if shared else 1
        return cls(0.6 * d / share, 0.1 * d, 0.3 * d, min(cfg.timeout_s, 5.0))

    def budget(self, cfg: PressureTestSpec) -> float:
        """How long a candidate may wait on the store before it gives up on the orchestrator.

        Four times the duration: a confirmation round, twice as long per node,
        can follow the first, and a third as long for the suspects it left unsure.
        """
        return STARTUP_S + 4 * cfg.duration_s + 6 * self.grace_s


MAX_PAIR_ROUNDS = 8
"""Each node meets at most this many partners: enough to tell its link from theirs."""
PAIR_TURNS = 3
"""The link test measures each pair in this many interleaved turns (as the local probes' ``TURNS``)."""
PAIR_TURNS_AGAIN = 5
"""The confirmation round's turns for each suspect pair, in twice the time."""


def pair_rounds(
    members: list[str], most: int = MAX_PAIR_ROUNDS, shared: bool = False, passes: int = 1
) -> list[list[list[str]]]:
    """Rounds of disjoint pairs (the circle method): in ``r`` rounds every node meets ``r`` partners.

    ``shared``: the nodes share one host's cores, so each pair gets a round of
    its own (a pair slowed by a bad link would hand its cores to the pair next
    to it, which would then look fast). ``passes``: the whole schedule again,
    interleaved, so each pair is measured in several short turns (a node's
    figure with a partner is the median of them): a machine whose speed
    drifts then drifts for every pair alike, not for whichever pair had the
    slow seconds.
    """
    ring: list[str | None] = [*members, None] if len(members) % 2 else list(members)
    n = len(ring)
    rounds = []
    for _ in range(min(n - 1, most)):
        rounds.append([[a, b] for a, b in zip(ring[: n // 2], reversed(ring[n // 2 :])) if a and b])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    once = [[pair] for r in rounds for pair in r] if shared else rounds
    return once * max(1, passes)


def host_store(host: str = "127.0.0.1") -> dist.TCPStore:
    """The store candidates meet at, on a free port of ``host`` alone (``backends.store.serve``: torch's own
    master would listen on every interface; 0.0.0.0, which pods need, is the backend's explicit choice)."""
    return serve(host)[0]


def _wait(store: dist.Store, key: str, node: Candidate, deadline: float) -> bool:
    asked = time.monotonic()
    while (now := time.monotonic()) < deadline:
        if store.check([key]):
            return True
        if now - asked >= ALIVE_EVERY_S:
            asked = now
            if not node.alive():
                return store.check([key])
        time.sleep(0.005)  # turns are short: a slow poll would be most of one
    return False


def _read(store: dist.Store, key: str, node_key: str) -> str:
    return unseal(node_key, key, store.get(key))


def _dead(store: dist.Store, name: str, node_key: str, why: str) -> str:
    """``why``, unless the candidate said it exited over a forged instruction: then nobody is to blame but the store."""
    key = f"tampered/{name}"
    if store.check([key]):
        raise StoreTampered(f"candidate {name}: {_read(store, key, node_key)}")
    return why


class Conductor:
    """Numbered, signed instructions to candidates and their answers; a node that misses a deadline is dead."""

    def __init__(
        self,
        store: dist.Store,
        nodes: Mapping[str, Candidate],
        keys: dict[str, str],
        result: BurnInRun,
        shared: bool = True,
    ):
        self.store, self.nodes, self.keys, self.result, self.shared = store, nodes, keys, result, shared
        self.sent = dict.fromkeys(nodes, 0)

    def alive(self, among: list[str] | None = None) -> list[str]:
        return [n for n in (self.nodes if among is None else among) if n not in self.result.dead]

    def order(self, name: str, instruction: dict[str, Any]) -> int:
        i = self.sent[name]
        self.sent[name] += 1
        key = f"do/{name}/{i}"
        self.store.set(key, seal(self.keys[name], key, json.dumps(instruction)))
        return i

    def answer(self, name: str, i: int, deadline: float, late: str) -> Any:
        """The answer to instruction ``i``, or ``None`` and the node dead (stopped) if it missed ``deadline``."""
        key = f"done/{name}/{i}"
        if _wait(self.store, key, self.nodes[name], deadline):
            try:  # signed by the candidate, which is still what is under test: its answer may be anything
                return loads_untrusted(_read(self.store, key, self.keys[name]), f"candidate {name}'s answer")
            except ValueError as exc:
                late = str(exc)  # a node whose answer cannot be read is as dead as one that gave none
        self.result.dead[name] = _dead(self.store, name, self.keys[name], self.nodes[name].why(late))
        self.nodes[name].kill()
        return None

    def probe(self, names: list[str], seconds: float, round_: int, grace_s: float) -> dict[str, dict[str, Any]]:
        """One turn of the local probes of ``names`` at once: each node's report."""
        wait = seconds + grace_s
        return self.together(
            names, {"do": "probe", "seconds": seconds, "round": round_}, wait, f"no report within {wait:.1f} s"
        )

    def probe_in_turns(
        self, names: list[str], plan: Schedule, round_: int, turns: int
    ) -> dict[str, list[dict[str, Any]]]:
        """Each node's local probes in ``turns`` short turns of a slot's share: in each, the nodes one after
        another on a shared host, all at once on a cluster.

        A machine whose speed drifts (a neighbour's load, a clock that boosts
        for a few seconds) then drifts for every node alike, where one long
        slot each would pin the drift on whoever had the slow seconds. A
        node's figure is the median of its turns (``combine``).
        """
        reports: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for _ in range(turns):
            groups = [[name] for name in self.alive(names)] if self.shared else [self.alive(names)]
            for group in groups:
                for name, report in self.probe(group, plan.slot_s / TURNS, round_, plan.grace_s).items():
                    reports[name].append(report)
        return {n: r for n, r in reports.items() if r and n not in self.result.dead}

    def together(
        self,
        members: list[str],
        instruction: dict[str, Any] | Callable[[str], dict[str, Any]],
        budget_s: float,
        late: str,
    ) -> dict[str, Any]:
        """Give every member its group instruction (the same, or ``instruction(member)``); their answers."""
        sent = {name: self.order(name, instruction(name) if callable(instruction) else instruction) for name in members}
        by = time.monotonic() + budget_s
        answers = {name: self.answer(name, i, by, late) for name, i in sent.items()}
        return {name: a for name, a in answers.items() if a is not None}


def run_protocol(
    store: dist.Store,
    nodes: Mapping[str, Candidate],
    cfg: PressureTestSpec,
    startup_s: float,
    keys: dict[str, str],
    recheck: Callable[[BurnInRun], Recheck] | None = None,
    shared: bool = False,
) -> BurnInRun:
    """Drive started candidates through ready, local probes in turns, the group tests and a confirmation round.

    ``keys`` holds each candidate's per-run key: what it signs with, and what
    the orchestrator signs its instructions to it with. ``recheck`` decides,
    from the first round, whom the confirmation round probes again and, asked
    again after it, whom it left unsure: those get a third round as long as the
    second, and are judged on both. ``shared``:
    the candidates share this host's cores (local), so pairs take turns too.
    """
    started = time.monotonic()
    plan = Schedule.of(cfg, len(nodes), shared)
    result = BurnInRun()
    conductor = Conductor(store, nodes, keys, result, shared)
    try:
        ready_by = time.monotonic() + min(cfg.timeout_s, startup_s)
        for name, node in nodes.items():
            if _wait(store, f"ready/{name}", node, ready_by):
                _read(store, f"ready/{name}", keys[name])
            else:
                late = f"did not start within {min(cfg.timeout_s, startup_s):.0f} s"
                result.dead[name] = _dead(store, name, keys[name], late)
        result.local = _medians(conductor.probe_in_turns(conductor.alive(), plan, 1, TURNS))
        members = conductor.alive([n for n in nodes if n in result.local])
        if len(members) > 1:
            group_tests(conductor, members, cfg, plan, shared)
        again = recheck(result) if recheck else Recheck()
        if again.local:
            result.again_turns = conductor.probe_in_turns(conductor.alive(again.local), plan, 2, TURNS_AGAIN)
            unsure = recheck(result).local if recheck and result.again_turns else []
            for name, turns in conductor.probe_in_turns(conductor.alive(unsure), plan, 3, TURNS_AGAIN).items():
                result.again_turns.setdefault(name, []).extend(turns)
            result.again_turns = {n: t for n, t in result.again_turns.items() if n not in result.dead}
            result.again = _medians(result.again_turns)
        if len(again.links) > 2 and len(conductor.alive(members)) == len(members):
            # as the local probes' confirmation: twice the time, in interleaved turns
            rounds = pair_rounds(again.links, shared=shared, passes=PAIR_TURNS_AGAIN)
            seconds = 2 * plan.pairs_s
            result.links_again = conductor.together(
                members, _pairs(rounds, cfg, seconds), seconds + 2 * plan.grace_s + 5, "did not finish the link test"
            )
    finally:
        for name in conductor.alive():
            conductor.order(name, {"do": "exit"})
        for node in nodes.values():
            node.kill()
    result.seconds = round(time.monotonic() - started, 3)
    return result


def _medians(turns: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    return {n: combine(r) for n, r in turns.items()}


def group_tests(conductor: Conductor, members: list[str], cfg: PressureTestSpec, plan: Schedule, shared: bool) -> None:
    """Join one group, then the all-reduce and, with three or more, the pairwise link test (whose link is slow).

    Two nodes share their only pair: the test could not say whose link it is.
    """
    joined = conductor.together(
        members, {"do": "join", "members": members}, 30 + plan.grace_s, "did not join the group"
    )
    if len(joined) < len(members):
        return  # a group short of a member cannot run a collective
    late = "did not complete the all-reduce"
    conductor.result.collective = conductor.together(
        members, {"do": "allreduce"}, plan.collective_s + 2 * plan.grace_s + 5, late
    )
    if len(conductor.result.collective) == len(members) and len(members) > 2:
        conductor.result.links = conductor.together(
            members,
            _pairs(pair_rounds(members, shared=shared, passes=PAIR_TURNS), cfg, plan.pairs_s),
            plan.pairs_s + 2 * plan.grace_s + 5,
            "did not finish the link test",
        )


def _pairs(rounds: list[list[list[str]]], cfg: PressureTestSpec, seconds: float) -> Callable[[str], dict[str, Any]]:
    """Each member's link-test instruction: every round, with only the pairs it is in.

    A node needs its own partners and the number of rounds (it keeps them in
    step with a barrier per round); the whole schedule to each of 512 nodes
    would be ~100 KB each, written, signed and parsed 512 times.
    """
    own: dict[str, list[list[list[str]]]] = {}
    for i, round_ in enumerate(rounds):
        for pair in round_:
            for node in pair:
                own.setdefault(node, [[] for _ in rounds])[i].append(pair)
    nbytes = max(cfg.collective_sizes_kb) << 10
    return lambda node: {
        "do": "pairs",
        "rounds": own.get(node, [[] for _ in rounds]),
        "bytes": nbytes,
        "seconds": seconds,
    }


def drills_from(cfg: PressureTestSpec, environ: dict[str, str] | None = None) -> dict[str, tuple[str, float]]:
    """Drills of the spec plus ``TRAINYARD_BURNIN_DRILLS`` (``node-1=throttle:0.3;node-2=crash``), which wins."""
    drills: dict[str, tuple[str, float]] = {d.node: (d.fault, d.factor) for d in cfg.drills}
    text = (os.environ if environ is None else environ).get("TRAINYARD_BURNIN_DRILLS", "")
    for item in filter(None, (part.strip() for part in text.split(";"))):
        node, _, what = item.partition("=")
        fault, _, factor = what.partition(":")
        if fault not in FAULTS:
            raise ValueError(f"TRAINYARD_BURNIN_DRILLS: {item!r}: fault must be one of {', '.join(FAULTS)}")
        drills[node.strip()] = (fault, float(factor) if factor else 0.3)
    return drills
