"""Every ledger event kind, declared once: its fields and their types, who may write it, the schema version.

One frozen dataclass per kind (``KINDS`` maps the event name to it). Writes go
through ``check``: ``Ledger.append`` / ``EventWriter.append`` refuse an
undeclared kind, a field the kind does not declare (unless the kind is
``open``: a report or a metrics dict carried whole) or a value of the wrong
type, with ``EventSchemaError``, a programming error raised where the event is
written. Fields may be left out (older ledgers, partial test ledgers); a typed
constructor (``AttemptStart(...)``, ``FailureClassified(...)``) is where a
record is built by hand, and its ``fields()`` is what gets appended.

Reads parse through it too: an event of a writer's file (training code,
untrusted; docs/architecture.md, untrusted input) is taken only when it is a
``worker`` kind of the ``train`` stage whose fields conform (``admit``); any
other line stays a skipped line with a warning. The orchestrator's own file is
read as written (a ledger of an older version keeps its kinds).

A change to a kind's fields that old readers would misread bumps ``VERSION``.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

VERSION = 1
"""The schema's version: fields added (optional) keep it; a field renamed or retyped bumps it."""
TRAIN = "train"
ANY_STAGE: frozenset[str] = frozenset()
"""A kind every stage writes (``stage_start``, ``stage_end``, ``stage_failed``)."""
RESERVED = ("ts", "stage", "event")
"""Written by the ledger on every event; no kind declares them."""


class EventSchemaError(TypeError):
    """An event that its kind's declaration does not allow: a bug in the code that writes it."""


@dataclass(frozen=True)
class Event:
    """Base of every kind. ``fields()``: the record as ``append`` takes it (None fields left out)."""

    event: ClassVar[str]
    stages: ClassVar[frozenset[str]] = frozenset({TRAIN})
    worker: ClassVar[bool] = False
    """A training process writes it (to its own file in ``events.d``)."""
    open: ClassVar[bool] = False
    """Carries a dict whole (a report, a step's metrics): fields beyond the declared ones are allowed."""

    def fields(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if getattr(self, f.name) is not None}


# ---------------------------------------------------------------- every stage


@dataclass(frozen=True)
class StageStart(Event):
    event = "stage_start"
    stages = ANY_STAGE
    peer: str | None = None  # bench/peers: which peer system runs the stage


@dataclass(frozen=True)
class StageEnd(Event):
    event = "stage_end"
    stages = ANY_STAGE
    seconds: float | None = None
    result: Any = None


@dataclass(frozen=True)
class StageFailed(Event):
    event = "stage_failed"
    stages = ANY_STAGE
    error: str | None = None
    message: str | None = None
    seconds: float | None = None


# ---------------------------------------------------------------- the run as a whole


@dataclass(frozen=True)
class Params(Event):
    event = "params"
    stages = frozenset({"run"})
    params: dict[str, Any] | None = None
    overrides: Any = None
    spec_file: str | None = None
    snapshot: str | None = None
    ds: str | None = None


@dataclass(frozen=True)
class Notified(Event):
    event = "notified"
    stages = frozenset({"run"})
    kind: str | None = None
    channel: str | None = None
    """email, slack or webhook (absent before there were channels: email)."""
    connection: str | None = None
    to: list[str] | None = None
    subject: str | None = None


@dataclass(frozen=True)
class NotifyFailed(Event):
    event = "notify_failed"
    stages = frozenset({"run"})
    kind: str | None = None
    channel: str | None = None
    connection: str | None = None
    error: str | None = None


# ---------------------------------------------------------------- data


@dataclass(frozen=True)
class Progress(Event):
    event = "progress"
    stages = frozenset({"stage_dataset"})
    objects: int | None = None
    bytes: int | None = None
    total_bytes: int | None = None
    mb_per_s: float | None = None


@dataclass(frozen=True)
class Plan(Event):
    event = "plan"
    stages = frozenset({"stage_dataset"})
    source: str | None = None
    objects: int | None = None
    to_transfer: int | None = None
    bytes: int | None = None


@dataclass(frozen=True)
class Staged(Event):
    event = "staged"
    stages = frozenset({"stage_dataset"})
    open = True


@dataclass(frozen=True)
class EarlierBoot(Event):
    event = "earlier_boot"
    stages = frozenset({"stage_dataset"})
    hot_dir: str | None = None
    objects: int | None = None
    manifest_objects: int | None = None
    keys: list[str] | None = None


@dataclass(frozen=True)
class EarlierBootReverified(Event):
    event = "earlier_boot_reverified"
    stages = frozenset({"stage_dataset", "check_dataset", TRAIN})
    hot_dir: str | None = None
    files: int | None = None
    mismatched: list[Any] | None = None


@dataclass(frozen=True)
class TrustOnFirstFetch(Event):
    event = "trust_on_first_fetch"
    stages = frozenset({"stage_dataset"})
    source: str | None = None
    objects: int | None = None
    keys: list[str] | None = None


@dataclass(frozen=True)
class Evicted(Event):
    event = "evicted"
    stages = frozenset({"stage_dataset"})
    path: str | None = None
    bytes: int | None = None
    last_used: float | None = None


@dataclass(frozen=True)
class DatasetChecked(Event):
    event = "dataset_checked"
    stages = frozenset({"check_dataset"})
    open = True


# ---------------------------------------------------------------- burn-in


@dataclass(frozen=True)
class SittingOut(Event):
    event = "sitting_out"
    stages = frozenset({"burn_in"})
    nodes: dict[str, Any] | None = None


@dataclass(frozen=True)
class NodesMarked(Event):
    """Nodes labelled out (burn-in: evicted; train: a failure's culprits kept off later attempts)."""

    event = "nodes_marked"
    stages = frozenset({"burn_in", TRAIN})
    nodes: list[str] | None = None
    label: str | None = None
    attempt: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class NodesRetested(Event):
    event = "nodes_retested"
    stages = frozenset({"burn_in"})
    readmitted: list[str] | None = None
    evicted: list[str] | None = None


@dataclass(frozen=True)
class NodeVerdict(Event):
    event = "node_verdict"
    stages = frozenset({"burn_in"})
    node: str | None = None
    kind: str | None = None
    figures: Any = None
    again: Any = None
    beside_reference: Any = None
    suspect: str | None = None
    collective: Any = None
    links: Any = None
    verdict: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Thresholds(Event):
    event = "thresholds"
    stages = frozenset({"burn_in"})
    references: Any = None
    reference_values: dict[str, Any] | None = None
    thresholds: dict[str, Any] | None = None
    suspects: dict[str, Any] | None = None
    cleared: Any = None
    seconds: float | None = None
    medians: dict[str, Any] | None = None  # the references' name before the confirmation round (old ledgers)


# ---------------------------------------------------------------- train: the orchestrator


@dataclass(frozen=True)
class ResumePoint(Event):
    event = "resume_point"
    resume_from: str | None = None
    start_step: int | None = None


@dataclass(frozen=True)
class RecoveryPath(Event):
    event = "recovery_path"
    in_place: bool | None = None
    why_not: str | None = None


@dataclass(frozen=True)
class GroupFormed(Event):
    """An attempt's ranks formed their first group on the coordination store: in place is real, not only allowed
    (the summary's ``recovery path``). Once a run, by the blocking driver."""

    event = "group_formed"
    attempt: int | None = None


@dataclass(frozen=True)
class HangDetectionOff(Event):
    """The training script writes no heartbeats: nothing is called hung until its first beat (once a run)."""

    event = "hang_detection_off"
    attempt: int | None = None
    reason: str | None = None
    """What was seen (no beat from any rank so long after the start)."""
    fix: str | None = None
    """How to turn hang detection on (``protocol.heartbeat.HOW_TO_BEAT``)."""


@dataclass(frozen=True)
class DrillRefused(Event):
    """A drill the supervisor could not act out for this script, and why (``recovery.drills``)."""

    event = "drill_refused"
    attempt: int | None = None
    fault: str | None = None
    node: str | None = None
    step: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class DrillWaiting(Event):
    """A drill armed for an attempt whose node is not in its group (a spare the pressure test left out): it
    strikes only once that node joins, and why (``recovery.drills.waiting``)."""

    event = "drill_waiting"
    attempt: int | None = None
    fault: str | None = None
    node: str | None = None
    step: int | None = None
    reason: str | None = None


@dataclass(frozen=True)
class RecoveryFigures(Event):
    event = "recovery_figures"
    open = True


@dataclass(frozen=True)
class AttemptStart(Event):
    event = "attempt_start"
    attempt: int | None = None
    node: str | None = None  # bench/peers: a peer system is its own orchestrator; its node-0 writes this
    nodes: list[str] | None = None
    world_size: int | None = None
    micro_batch: int | None = None
    resume_from: str | None = None
    resume_step: int | None = None
    """The step of the checkpoint the orchestrator chose for the attempt (``resume_from`` resolved when it
    started; 0: from scratch): the resumed step of a script that writes no ``resumed`` of its own."""


@dataclass(frozen=True)
class AttemptEnd(Event):
    event = "attempt_end"
    attempt: int | None = None
    state: str | None = None
    seconds: float | None = None
    last_step: int | None = None
    trigger: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class AttemptEvent(Event):
    """What an attempt's trigger reported to a deferred task (its news, before it is looked at again)."""

    event = "attempt_event"
    attempt: int | None = None
    status: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class FailureClassified(Event):
    event = "failure_classified"
    attempt: int | None = None
    node: str | None = None  # bench/peers, as in attempt_start
    kind: str | None = None
    evidence: str | None = None
    culprits: list[str] | None = None
    step: int | None = None
    detected_at: float | None = None


@dataclass(frozen=True)
class DecisionMade(Event):
    """The policy's decision about a failure; ``path`` ``in_place`` for a regroup, with the new generation."""

    event = "decision"
    attempt: int | None = None
    kind: str | None = None
    action: str | None = None
    nodes: list[str] | None = None
    reason: str | None = None
    delay_s: float | None = None
    micro_batch: int | None = None
    to_step: int | None = None
    new_nodes: list[str] | None = None
    path: str | None = None
    left_out: list[str] | None = None
    joiners: list[str] | None = None
    generation: int | None = None


@dataclass(frozen=True)
class Grown(Event):
    event = "grown"
    attempt: int | None = None
    generation: int | None = None
    nodes: list[str] | None = None
    joiners: list[str] | None = None
    micro_batch: int | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class SparesWarm(Event):
    event = "spares_warm"
    attempt: int | None = None
    nodes: list[str] | None = None


@dataclass(frozen=True)
class StoreRefused(Event):
    """A value of the coordination store the supervisor refused (forged or malformed) and acted without."""

    event = "store_refused"
    attempt: int | None = None
    key: str | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Rejoining(Event):
    event = "rejoining"
    attempt: int | None = None
    nodes: list[str] | None = None
    reason: str | None = None


@dataclass(frozen=True)
class RolledBack(Event):
    event = "rolled_back"
    to_step: int | None = None
    path: str | None = None


@dataclass(frozen=True)
class LineageHeld(Event):
    event = "lineage_held"
    root: str | None = None
    reason: str | None = None
    expires: float | None = None
    previous: dict[str, Any] | None = None


@dataclass(frozen=True)
class LineageReset(Event):
    """A lineage (re)started at ``path`` (None: fresh); ``set_aside``: where the checkpoints beyond it went."""

    event = "lineage_reset"
    path: str | None = None
    set_aside: list[str] | None = None


@dataclass(frozen=True)
class PointerRefused(Event):
    """``LATEST`` disagreed with the ledger when the run's final checkpoint was taken (evidence; the ledger won)."""

    event = "pointer_refused"
    path: str | None = None
    problem: str | None = None
    used: str | None = None


@dataclass(frozen=True)
class CheckpointValidated(Event):
    event = "checkpoint_validated"
    open = True
    path: str | None = None
    step: int | None = None
    valid: bool | None = None
    problems: list[str] | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class CheckpointAdopted(Event):
    """A framework's save (``source``, relative to the lineage root) became the trainyard checkpoint ``path``
    (``checkpoint.foreign``): its files linked in, a manifest written. Validation and promotion follow as
    for any checkpoint; the fold counts it as saved."""

    event = "checkpoint_adopted"
    path: str | None = None
    step: int | None = None
    framework: str | None = None
    source: str | None = None


@dataclass(frozen=True)
class CheckpointPromoted(Event):
    event = "checkpoint_promoted"
    path: str | None = None
    step: int | None = None


@dataclass(frozen=True)
class CheckpointQuarantined(Event):
    event = "checkpoint_quarantined"
    path: str | None = None
    to: str | None = None
    problems: list[str] | None = None


@dataclass(frozen=True)
class CheckpointRetired(Event):
    event = "checkpoint_retired"
    path: str | None = None
    step: int | None = None
    kept: Any = None


@dataclass(frozen=True)
class CheckpointTiered(Event):
    event = "checkpoint_tiered"
    path: str | None = None
    uri: str | None = None
    bytes: int | None = None


@dataclass(frozen=True)
class CheckpointChecked(Event):
    event = "checkpoint_checked"
    stages = frozenset({"check_checkpoint"})
    path: str | None = None
    valid: bool | None = None
    problems: list[str] | None = None
    seconds: float | None = None
    notes: list[str] | None = None  # what the gate could not check, and why (a script that reports no loss)
    manifest_sha256: str | None = None  # the manifest it passed: publish takes only that one (issue 49)
    step: int | None = None  # the step it checked (a script saving every N steps: its last save)
    target_step: int | None = None  # the run's final step (max_steps beyond its start)
    steps_short: int | None = None  # target_step - step: how far the passed save is from max_steps


@dataclass(frozen=True)
class Published(Event):
    event = "published"
    stages = frozenset({"publish"})
    uri: str | None = None
    pointer: str | None = None
    step: int | None = None
    bytes: int | None = None


# ---------------------------------------------------------------- train: what a training process writes


@dataclass(frozen=True)
class WorkerEvent(Event):
    """The fields the runtime adds to every event of rank 0 (a drill's writer adds only ``node``)."""

    worker = True
    run_id: str | None = None
    attempt: int | None = None
    node: str | None = None
    world_size: int | None = None


@dataclass(frozen=True)
class Step(WorkerEvent):
    """A step, or a stretch of steps summed up (``first_step``, ``steps``), with the metrics (open)."""

    event = "step"
    open = True
    step: int | None = None


@dataclass(frozen=True)
class Finished(WorkerEvent):
    event = "finished"
    open = True
    step: int | None = None


@dataclass(frozen=True)
class CheckpointSaved(WorkerEvent):
    event = "checkpoint_saved"
    step: int | None = None
    path: str | None = None
    seconds: float | None = None
    blocked_s: float | None = None


@dataclass(frozen=True)
class CheckpointSkipped(WorkerEvent):
    event = "checkpoint_skipped"
    path: str | None = None
    problems: list[str] | None = None


@dataclass(frozen=True)
class Resumed(WorkerEvent):
    event = "resumed"
    step: int | None = None
    path: str | None = None
    from_world_size: int | None = None
    from_global_batch: int | None = None
    seconds: float | None = None
    iteration: int | None = None  # bench/peers: the peer's own restart count (NVRx) or quorum (torchft)
    quorum_id: Any = None
    source: str | None = None
    """What the state came from: ``checkpoint`` (a saved one) or ``snapshot`` (an in-memory snapshot of this run (``runtime.snapshots``)."""
    why: str | None = None
    """Why that one, in words (e.g. the snapshot of step 61 is newer than the checkpoint of step 60)."""
    copied_to_ranks: list[int] | None = None
    """From a snapshot: the ranks whose node lacked it (a replacement node, a node whose memory was lost),
    which received it from a peer that held it."""


@dataclass(frozen=True)
class Regrouped(WorkerEvent):
    event = "regrouped"
    generation: int | None = None
    micro_batch: int | None = None
    from_step: int | None = None
    joiners: list[str] | None = None


@dataclass(frozen=True)
class BatchFollowed(WorkerEvent):
    """Rank 0 applies the batch settings (``runtime.follow_batch``): the global batch survives a change of world."""

    event = "batch_followed"
    global_batch: int | None = None
    micro_batch: int | None = None
    accumulation: int | None = None


@dataclass(frozen=True)
class DrillsActed(WorkerEvent):
    """A training process acts out its drills itself (``runtime.drills``: the reference loop, the framework
    callbacks), exactly at their step: the supervisor leaves them to it and only checks they fired."""

    event = "drills_acted"
    faults: list[str] | None = None


@dataclass(frozen=True)
class DrillFired(WorkerEvent):
    event = "drill_fired"
    fault: str | None = None
    step: int | None = None


KINDS: dict[str, type[Event]] = {
    kind.event: kind
    for kind in (
        StageStart, StageEnd, StageFailed, Params, Notified, NotifyFailed, Progress, Plan, Staged, EarlierBoot,
        EarlierBootReverified, TrustOnFirstFetch, Evicted, DatasetChecked, SittingOut, NodesMarked, NodesRetested,
        NodeVerdict, Thresholds, ResumePoint, RecoveryPath, GroupFormed, HangDetectionOff, DrillRefused, DrillWaiting, RecoveryFigures, AttemptStart, AttemptEnd, AttemptEvent,
        FailureClassified, DecisionMade, Grown, SparesWarm, Rejoining, RolledBack, LineageHeld, LineageReset,
        CheckpointAdopted, CheckpointValidated, CheckpointPromoted, CheckpointQuarantined, CheckpointRetired, CheckpointTiered,
        CheckpointChecked, Published, Step, Finished, CheckpointSaved, CheckpointSkipped, Resumed, Regrouped,
        DrillsActed, DrillFired, BatchFollowed, PointerRefused, StoreRefused,
    )
}  # fmt: skip
"""Every event kind, by its name."""
WORKER_EVENTS = frozenset(name for name, kind in KINDS.items() if kind.worker)
"""The ``train`` events a training process writes; anything else in ``events.d`` is skipped."""


# ---------------------------------------------------------------- checking


_HINTS: dict[str, dict[str, Any]] = {}


def _hints(kind: type[Event]) -> dict[str, Any]:
    """The declared fields of ``kind`` and their types (resolved once per kind)."""
    if kind.event not in _HINTS:
        _HINTS[kind.event] = {f.name: typing.get_type_hints(kind)[f.name] for f in dataclasses.fields(kind)}
    return _HINTS[kind.event]


def problems(stage: str, event: str, fields: Mapping[str, Any]) -> list[str]:
    """What is wrong with an event against its kind's declaration (empty: it conforms)."""
    kind = KINDS.get(event)
    if kind is None:
        return [f"{event!r} is not a declared event kind (trainyard.events.schema.KINDS)"]
    out = [] if not kind.stages or stage in kind.stages else [f"{event} is not an event of stage {stage!r}"]
    hints = _hints(kind)
    for name, value in fields.items():
        if name in RESERVED:
            continue
        if name not in hints:
            if not kind.open:
                out.append(f"{event} has no field {name!r}")
        elif not conforms(value, hints[name]):
            out.append(f"{event}.{name} must be {_name(hints[name])}, not {type(value).__name__} {value!r:.60}")
    return out


def check(stage: str, event: str, fields: Mapping[str, Any]) -> None:
    """Raise ``EventSchemaError`` unless the event conforms: at write time, where the bug is."""
    if found := problems(stage, event, fields):
        raise EventSchemaError(f"ledger event {stage}/{event}: " + "; ".join(found))


def admit(record: Mapping[str, Any]) -> list[str]:
    """Why an event of a writer's file (untrusted) is not taken (empty: it is a conforming worker event)."""
    event = record.get("event")
    if record.get("stage") != TRAIN or not isinstance(event, str) or event not in WORKER_EVENTS:
        return [f"{str(record.get('stage'))[:40]}/{str(event)[:40]} is not an event a training process writes"]
    return problems(TRAIN, event, record)


def conforms(value: Any, hint: Any) -> bool:
    """Whether a JSON-able value is of the declared type (an int is a float; a bool is neither)."""
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return any(conforms(value, a) for a in args)
    if origin is list:
        return isinstance(value, (list, tuple)) and all(conforms(v, args[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _name(hint: Any) -> str:
    return str(hint).replace("typing.", "") if not isinstance(hint, type) else hint.__name__
