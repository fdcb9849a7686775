"""The training part of the one fold (``trainyard.events.fold``): ``TrainRun``, the train stage's events folded.

The resume point, every attempt with EVERY failure and EVERY decision taken
about it, in order, its regroups and growth with their joiners and generations,
the world size over time, the spares, the drills fired and acted, the steps.
``TrainRun.fold(events)`` folds later events onto a train state, so a driver
that keeps one folds only what was appended since its last look.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from trainyard.events.records import (
    AttemptRun,
    Decision,
    DecisionTaken,
    Drill,
    DrillWaited,
    FailureSeen,
    Fault,
    Formed,
    Growth,
    ResumeSource,
)
from trainyard.kinds import ACTIONS, KINDS, FailureKind
from trainyard.text import printable

TRAIN = "train"
Event = Mapping[str, Any]
_ENVELOPE = ("ts", "stage", "event")
"""What every event carries: not one of the recovery figures."""


def _int(value: Any) -> int | None:
    return None if value in (None, "") else int(value)


def _names(value: Any) -> tuple[str, ...]:
    return tuple(str(n) for n in value or ())


W = TypeVar("W")
_KINDS: dict[str, FailureKind] = {k: k for k in KINDS}
_DECISIONS: dict[str, Decision] = {**{a: a for a in ACTIONS}, "regroup": "regroup"}
_SOURCES: dict[str, ResumeSource] = {"snapshot": "snapshot", "checkpoint": "checkpoint"}


def _word(words: dict[str, W], value: Any, what: str) -> W:
    """A word of one of the spec's vocabularies, as the orchestrator wrote it (another: a ledger of another
    version, said as such rather than decided on)."""
    try:
        return words[str(value)]
    except KeyError:
        raise ValueError(
            f"the ledger names an unknown {what} {value!r} (written by another trainyard version?)"
        ) from None


def _kind(value: Any) -> FailureKind:
    return _word(_KINDS, value, "failure kind")


@dataclass(frozen=True)
class TrainRun:
    """The run's training. ``TrainRun().fold(events)``; fold later events onto it (other stages are skipped)."""

    resume_from: str | None = None
    """The run's starting checkpoint (``resume_point``): decided once per run; None: not yet."""
    start_step: int | None = None
    attempts: tuple[AttemptRun, ...] = ()
    decisions: tuple[DecisionTaken, ...] = ()
    """Every decision of the run, in order (the policy's history)."""
    used: frozenset[str] = frozenset()
    """Nodes any attempt ran on or a decision took (a spare used once is no longer spare)."""
    stage_start: float | None = None
    """When the latest train task process began (the last ``stage_start``)."""
    worlds: tuple[tuple[float, int], ...] = ()
    """``(ts, world size)`` of each attempt's start and each group formed in place (``regrouped``)."""
    formed: tuple[Formed, ...] = ()
    """Every group formed in place, in order."""
    waiting: tuple[str, ...] = ()
    """Nodes waiting outside the group now (warm spares, nodes started again), in order."""
    joined: tuple[str, ...] = ()
    """Nodes that joined a group in place, in order."""
    in_place: bool | None = None
    why_not: str | None = None
    batch_followed: bool = False
    """The script applies the batch settings (a ``batch_followed`` of any attempt: the same script runs them all)."""
    drills_refused: tuple[tuple[str, str], ...] = ()
    """``(fault, why)`` of every drill the supervisor could not act out (``drill_refused``), in order."""
    drills_waiting: tuple[DrillWaited, ...] = ()
    """Every drill armed for an attempt whose node was not in its group (``drill_waiting``), in order
    (``still_waiting``: those that have not struck since)."""
    hang_detection_off: str | None = None
    """Why hang detection is off (the script writes no heartbeats: ``hang_detection_off``); None: on."""
    fired: tuple[Drill, ...] = ()
    """Every drill fired (``drill_fired``), in order, whether or not an attempt was folded before it."""
    drills_acted: frozenset[int] = frozenset()
    """Attempts whose script said it acts out its drills itself (``drills_acted``)."""
    steps: tuple[Event, ...] = ()
    """Every ``step`` event, in order: ``trainyard.protocol.steps`` reads them (loss points, kept stretches)."""
    resumed_steps: tuple[int | None, ...] = ()
    """The step of every ``resumed`` (a training process restored a checkpoint), in order."""
    figures: Mapping[str, Any] | None = None
    """The last ``recovery_figures`` the train stage wrote (its fields); None: none written."""
    resume_decided_at: float | None = None
    """When the last ``resume_point`` was written (framework saves older than that are not this run's)."""
    finished: bool = False
    """A training process said it reached its last step (``finished``)."""
    grouped: bool = False
    """Some attempt's ranks formed a group on the coordination store (``group_formed``)."""

    @classmethod
    def of(cls, events: Iterable[Event]) -> TrainRun:
        return cls().fold(events)

    def fold(self, events: Iterable[Event]) -> TrainRun:
        state, steps = self, list[Event]()
        for event in events:
            if event.get("stage") != TRAIN:
                continue
            if event.get("event") == "step":  # the most frequent by far: gathered, not copied one by one
                steps.append(event)
            elif (apply := _TRAIN.get(str(event.get("event")))) is not None:
                state = apply(state, event)
        return replace(state, steps=(*state.steps, *steps)) if steps else state

    @property
    def last(self) -> AttemptRun | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def still_waiting(self) -> list[DrillWaited]:
        """The waiting drills that have not struck (no ``drill_fired`` of their fault on their node since)."""
        fired = {(d.fault, d.node) for d in self.fired}
        return [w for w in self.drills_waiting if (w.fault, w.node) not in fired]

    @property
    def world_path(self) -> str | None:
        return " -> ".join(str(w) for _, w in self.worlds) or None

    def _with_last(self, attempt: int | None, **changes: Any) -> TrainRun:
        """The state with the last attempt changed, when ``attempt`` is it (None: a worker's event, no number)."""
        last = self.last
        if last is None or (attempt is not None and last.number != attempt):
            return self
        return replace(self, attempts=(*self.attempts[:-1], replace(last, **changes)))


def _resume_point(s: TrainRun, e: Event) -> TrainRun:
    s = replace(s, resume_decided_at=float(e["ts"]))
    if s.start_step is not None:  # decided once per run: the first one holds
        return s
    return replace(s, resume_from=str(e["resume_from"]), start_step=int(e["start_step"]))


def _attempt_start(s: TrainRun, e: Event) -> TrainRun:
    nodes, micro = _names(e.get("nodes")), _int(e.get("micro_batch")) or 0
    world = int(e.get("world_size") or 0)
    attempt = AttemptRun(int(e["attempt"]), float(e["ts"]), nodes, world, micro,
                         str(e.get("resume_from") or "latest"), nodes, micro,
                         resume_step=_int(e.get("resume_step")))  # fmt: skip
    worlds = (*s.worlds, (float(e["ts"]), world)) if "world_size" in e else s.worlds
    return replace(s, attempts=(*s.attempts, attempt), used=s.used | set(nodes), worlds=worlds)


def _attempt_end(s: TrainRun, e: Event) -> TrainRun:
    seconds, last = e.get("seconds"), s.last
    if last is None or last.number != e.get("attempt"):
        return s
    return s._with_last(
        last.number,
        state="succeeded" if e.get("state") == "succeeded" else "failed",
        ended=float(e["ts"]),
        seconds=None if seconds is None else float(seconds),
        last_step=_int(e.get("last_step")),
        trigger=e.get("trigger"),
        reason=e.get("reason"),
    )


def _classified(s: TrainRun, e: Event) -> TrainRun:
    if s.last is None or s.last.number != e.get("attempt"):
        return s
    seen = FailureSeen(int(e["attempt"]), _kind(e["kind"]), float(e["ts"]), str(e.get("evidence", "")),
                       _names(e.get("culprits")), _int(e.get("step")), e.get("detected_at"))  # fmt: skip
    return s._with_last(s.last.number, faults=(*s.last.faults, Fault(seen)))


def _decision(s: TrainRun, e: Event) -> TrainRun:
    new_nodes = e.get("new_nodes")
    decision = DecisionTaken(
        attempt=int(e["attempt"]), kind=_kind(e["kind"]), action=_word(_DECISIONS, e["action"], "action"), at=float(e["ts"]),
        nodes=_names(e.get("nodes")), reason=str(e.get("reason", "")), delay_s=float(e.get("delay_s") or 0.0),
        micro_batch=_int(e.get("micro_batch")), to_step=_int(e.get("to_step")),
        new_nodes=None if new_nodes is None else _names(new_nodes), path=e.get("path"),
        left_out=_names(e.get("left_out")), joiners=_names(e.get("joiners")), generation=_int(e.get("generation")),
    )  # fmt: skip
    joiners = decision.joiners
    s = replace(s, decisions=(*s.decisions, decision), used=s.used | set(new_nodes or []),
                waiting=tuple(n for n in s.waiting if n not in joiners), joined=(*s.joined, *joiners))  # fmt: skip
    last = s.last
    if last is None or last.number != decision.attempt:
        return s
    faults = last.faults
    if faults and faults[-1].decision is None:
        faults = (*faults[:-1], replace(faults[-1], decision=decision))
    else:
        faults = (*faults, Fault(None, decision))
    if decision.action != "regroup":
        return s._with_last(last.number, faults=faults)
    # Carried out in place: the attempt runs on with the new group.
    return s._with_last(last.number, faults=faults, nodes=decision.new_nodes or last.nodes,
                        micro_batch=decision.micro_batch or last.micro_batch, regrouped_at=decision.at)  # fmt: skip


def _grown(s: TrainRun, e: Event) -> TrainRun:
    last = s.last
    if last is None or last.number != e.get("attempt"):
        return s
    growth = Growth(last.number, float(e["ts"]), _int(e.get("generation")), _names(e.get("nodes")) or last.nodes,
                    _names(e.get("joiners")), _int(e.get("micro_batch")) or last.micro_batch,
                    _int(e.get("world_size")))  # fmt: skip
    s = replace(s, used=s.used | set(growth.nodes), waiting=tuple(n for n in s.waiting if n not in growth.joiners),
                joined=(*s.joined, *growth.joiners))  # fmt: skip
    return s._with_last(last.number, nodes=growth.nodes, micro_batch=growth.micro_batch,
                        growths=(*last.growths, growth), regrouped_at=growth.at)  # fmt: skip


def _rolled_back(s: TrainRun, e: Event) -> TrainRun:
    last = s.last
    decided = last.decided if last else None
    if last is None or decided is None or decided.action != "rollback" or last.faults[-1].decision is not decided:
        return s
    done = replace(decided, rolled_back_to=str(e.get("path") or "none"))
    return s._with_last(last.number, faults=(*last.faults[:-1], replace(last.faults[-1], decision=done)))


def _waiting(s: TrainRun, e: Event) -> TrainRun:  # spares_warm, rejoining
    nodes = _names(e.get("nodes"))
    return replace(s, waiting=(*(n for n in s.waiting if n not in nodes), *nodes))


def _regrouped(s: TrainRun, e: Event) -> TrainRun:  # a training process: its group formed in place
    world = _int(e.get("world_size"))
    formed = Formed(float(e["ts"]), _int(e.get("generation")), world, _int(e.get("from_step")))
    worlds = s.worlds if world is None else (*s.worlds, (formed.at, world))
    return replace(s, formed=(*s.formed, formed), worlds=worlds)


def _resumed(s: TrainRun, e: Event) -> TrainRun:
    s = replace(s, resumed_steps=(*s.resumed_steps, _int(e.get("step"))))
    if s.last is None or s.last.resumed_step is not None:
        return s
    seconds = e.get("seconds")
    restore = float(seconds) if isinstance(seconds, (int, float)) and not isinstance(seconds, bool) else None
    return s._with_last(_int(e.get("attempt")), resumed_step=_int(e.get("step")), resumed_at=float(e["ts"]),
                        restore_s=restore if restore is not None and restore >= 0 else None,
                        resumed_source=_SOURCES.get(str(e.get("source"))),
                        resumed_why=printable(why) if isinstance(why := e.get("why"), str) and why else None,
                        copied_to_ranks=_ranks(e.get("copied_to_ranks")))  # fmt: skip


def _ranks(value: Any) -> tuple[int, ...]:
    """A worker's list of ranks; anything else (it is worker-written) is none."""
    if not isinstance(value, list):
        return ()
    return tuple(r for r in value if isinstance(r, int) and not isinstance(r, bool))


def _waited(e: Event) -> DrillWaited:
    return DrillWaited(_int(e.get("attempt")), e.get("fault"), e.get("node"), _int(e.get("step")),
                       str(e.get("reason") or ""))  # fmt: skip


def _drill(s: TrainRun, e: Event) -> TrainRun:  # written by the workload, which may not know the attempt number
    drill = Drill(float(e["ts"]), e.get("fault"), e.get("node"), _int(e.get("step")))
    s = replace(s, fired=(*s.fired, drill))
    if s.last is None:
        return s
    return s._with_last(None, drills=(*s.last.drills, drill))


_TRAIN = {
    "resume_point": _resume_point,
    "attempt_start": _attempt_start,
    "attempt_end": _attempt_end,
    "failure_classified": _classified,
    "decision": _decision,
    "grown": _grown,
    "rolled_back": _rolled_back,
    "stage_start": lambda s, e: replace(s, stage_start=float(e["ts"])),
    "spares_warm": _waiting,
    "rejoining": _waiting,
    "regrouped": _regrouped,
    "resumed": _resumed,
    "drill_fired": _drill,
    "recovery_path": lambda s, e: replace(s, in_place=e.get("in_place"), why_not=e.get("why_not")),
    "group_formed": lambda s, e: replace(s, grouped=True),
    "batch_followed": lambda s, e: replace(s, batch_followed=True),
    "finished": lambda s, e: replace(s, finished=True),
    "drill_refused": lambda s, e: replace(
        s, drills_refused=(*s.drills_refused, (str(e.get("fault")), str(e.get("reason") or "")))
    ),
    "drill_waiting": lambda s, e: replace(s, drills_waiting=(*s.drills_waiting, _waited(e))),
    "hang_detection_off": lambda s, e: replace(s, hang_detection_off=str(e.get("reason") or "no heartbeats")),
    "drills_acted": lambda s, e: (
        s if (n := _int(e.get("attempt"))) is None else replace(s, drills_acted=s.drills_acted | {n})
    ),
    "recovery_figures": lambda s, e: replace(s, figures={k: v for k, v in e.items() if k not in _ENVELOPE}),
}
