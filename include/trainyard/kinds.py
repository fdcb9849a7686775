"""The failure kinds: each declared once, with every trait the house reads from it.

A failure kind is a word of the spec (``recovery.actions`` keys), of the ranks' failure records and
of ``classify``'s answer; what to do about it is spread over the policy (heal in place?), the
controller (may the node rejoin?) and classify (is a node to blame?). Those traits used to be
separate sets in those modules, so a new kind left out of one was silently never healed in place
or never blamed. Here a kind is one ``Kind`` record whose every field is required, and the import
fails when the table and the ``FailureKind`` vocabulary disagree: forgetting a trait is an error,
not a quiet default. Everything else (``spec.DEFAULT_ACTIONS``, ``protocol.records.KINDS``,
``policy.IN_PLACE_KINDS``, ``controller.REJOIN_KINDS``) is derived from ``TABLE``.

This module sits in the bottom layer (it imports nothing of trainyard): the spec, the wire that
training processes write and the orchestrator's decisions all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

FailureKind = Literal[
    "node_lost", "hang", "transient", "oom", "diverged", "user_error", "data_error", "preempted"
]  # fmt: skip
"""A ``Literal`` so that pydantic validates a spec's ``recovery.actions`` keys and mypy checks every use."""
Action = Literal["retry", "scale_down", "rollback", "fail"]


@dataclass(frozen=True)
class Kind:
    """A failure kind's traits. No field has a default: a new kind must answer every question."""

    action: Action
    """What recovery does about it when the spec's ``recovery.actions`` does not say."""
    in_place: bool
    """The survivors can heal it by regrouping (``recovery.in_place``); else it relaunches."""
    rejoins: bool
    """A failure of a node's process, not of the node: in place, the node is started again and may rejoin."""
    blames: bool
    """A rank's record or log line of this kind blames its node (a scale-down excludes it)."""
    why: str
    """One line for docs/architecture.md's table: what the kind means."""


TABLE: dict[FailureKind, Kind] = {
    "node_lost": Kind("scale_down", in_place=True, rejoins=True, blames=True,
                      why="a node or its process died (hardware error, SIGKILL, a lost pod)"),
    "hang": Kind("scale_down", in_place=True, rejoins=False, blames=False,
                 why="heartbeats went stale while the processes lived (the stale nodes are blamed by name)"),
    "transient": Kind("retry", in_place=True, rejoins=True, blames=False,
                      why="a communication error with no node at fault"),
    "oom": Kind("retry", in_place=False, rejoins=False, blames=True,
                why="out of memory: fresh processes with a smaller micro-batch"),
    "diverged": Kind("rollback", in_place=False, rejoins=False, blames=False,
                     why="the loss became non-finite: back to an earlier checkpoint"),
    "user_error": Kind("fail", in_place=False, rejoins=False, blames=False,
                       why="the script or its spec is wrong: a person must fix it"),
    "data_error": Kind("fail", in_place=False, rejoins=False, blames=False,
                       why="the dataset is wrong: a person must fix it"),
    # Notice, not a fault: in place the node leaves at a step boundary; else the same nodes again (no exclusion).
    "preempted": Kind("retry", in_place=True, rejoins=False, blames=False,
                      why="a node was given notice (SIGTERM, a preempted pod) and leaves"),
}  # fmt: skip

KINDS: tuple[FailureKind, ...] = get_args(FailureKind)
ACTIONS: tuple[Action, ...] = get_args(Action)

if set(TABLE) != set(KINDS):  # pragma: no cover - fails the import, on purpose, for a kind half declared
    raise TypeError(f"trainyard.kinds.TABLE and FailureKind disagree: {sorted(set(TABLE) ^ set(KINDS))}")

DEFAULT_ACTIONS: dict[FailureKind, Action] = {name: kind.action for name, kind in TABLE.items()}
IN_PLACE_KINDS: frozenset[FailureKind] = frozenset(name for name, kind in TABLE.items() if kind.in_place)
REJOIN_KINDS: frozenset[FailureKind] = frozenset(name for name, kind in TABLE.items() if kind.rejoins)
BLAMING_KINDS: frozenset[FailureKind] = frozenset(name for name, kind in TABLE.items() if kind.blames)
