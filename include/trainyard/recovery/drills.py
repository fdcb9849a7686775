"""Drills acted out from outside the training processes, for any script: when, on whom, or why not.

Who acts each drill is decided once, by the entrypoint (``spec.checks.acts_drills``): the reference
workload acts out every drill itself, exactly at its step (``runtime.drills``, its ``TRAINYARD_DRILLS``);
for any other script the blocking driver acts out ``kill`` (SIGKILL of the node's processes), ``hang``
(SIGSTOP) and ``slow`` (a SIGSTOP/SIGCONT duty cycle) through a launcher that signals nodes
(``backends.base.SignalsNodes``), and the spec check refuses the faults that need the process. So no
drill is acted twice and none is silently dropped.

A drill strikes at the first look where the node's progress reached its step: the step its ranks' heartbeats
report, or, for a script that writes none, the furthest step its nodes' logs show (``recovery.logwatch``), else
the newest checkpoint folder (``step_NNNNNN``) that appeared in the checkpoint root since the attempt started. Looks are a poll apart, so the fault may come a few steps late.
``due`` and ``refused`` decide (pure); ``Actor`` looks and carries them out, recording ``drill_fired`` and
``drill_refused`` in the ledger.

A drill the script acts out itself whose node is not in the attempt's group (the pressure test ranked it below
the others and left it a spare) does nothing until that node joins: ``waiting`` says so (pure), and
``announce_waiting`` records it as the attempt starts (``drill_waiting``), so a rehearsal that never struck is
never silent.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.backends.base import LaunchPlan, SignalsNodes
from trainyard.checkpoint.format import step_of
from trainyard.events.fold import TrainRun
from trainyard.events.ledger import Ledger
from trainyard.events.schema import DrillRefused, DrillWaiting
from trainyard.protocol.env import FaultDrill
from trainyard.protocol.heartbeat import HOW_TO_BEAT, scan
from trainyard.recovery.logsteps import LogStep
from trainyard.recovery.state import STAGE
from trainyard.recovery.watch import STARTUP_GRACE_S, beatless
from trainyard.spec.checks import OUTSIDE_FAULTS

log = logging.getLogger(__name__)

INSIDE_WHY = (
    "{fault} at step {step} is acted out inside the training process, and the script did not: train with"
    " trainyard.runtime's drills (the reference loop), or add the Hugging Face / Lightning TrainyardCallback"
    " (trainyard.runtime.hf, trainyard.runtime.lightning); kill, hang and slow are acted out from outside"
)


@dataclass(frozen=True)
class Progress:
    """What is known of an attempt's progress at one look."""

    steps: dict[str, int]
    """Node -> the furthest step its ranks' heartbeats report (empty: no beat yet)."""
    checkpoint: int | None = None
    """The newest checkpoint step saved since the attempt started (None: none)."""
    beatless: bool = False
    """No rank beat by the time one that did would have been called hung: the script writes no heartbeats."""
    logged: int | None = None
    """The furthest step the nodes' logs show, for a script that writes no heartbeats (``recovery.logwatch``):
    the job's, not one node's (often only rank 0 prints), so every node has reached it."""


def target(drill: FaultDrill, nodes: list[str]) -> str:
    """The node a drill strikes: its own, else the attempt's first (``Drill.node``: null is node-0)."""
    return drill.node or nodes[0]


def due(drills: list[FaultDrill], nodes: list[str], seen: Progress) -> list[tuple[FaultDrill, str, int, str]]:
    """The drills whose node reached their step: ``(drill, node, step reached, what said so)``."""
    out = []
    for drill in drills:
        node = target(drill, nodes)
        if seen.steps:
            reached, source = seen.steps.get(node), "heartbeats"
        elif drill.fault == "hang":  # only a script that beats has its frozen node found: wait for its beats
            continue
        elif seen.logged is not None:
            reached, source = seen.logged, "log"
        else:
            reached, source = seen.checkpoint, "checkpoints"
        if reached is not None and reached >= drill.step:
            out.append((drill, node, reached, source))
    return out


def refused(drill: FaultDrill, nodes: list[str], seen: Progress) -> str | None:
    """Why a drill cannot be acted out in this attempt (None: it can, or it is not known yet)."""
    node = target(drill, nodes)
    if node not in nodes:
        return f"{node} is not a node of the attempt ({', '.join(nodes)})"
    if drill.fault == "hang" and seen.beatless:
        # A frozen node of a script without heartbeats is never found: the run would wait forever.
        return (
            f"the script writes no heartbeats, so hang detection is off and a frozen node is never found; {HOW_TO_BEAT}"
        )
    return None


def waiting(drills: list[FaultDrill], nodes: list[str], warm: list[str]) -> list[tuple[FaultDrill, str]]:
    """The drills armed for an attempt on ``nodes`` (``warm``: its spares started outside the group) whose node
    is not in its group, with why: they strike only if that node joins the group in time."""
    out = []
    for drill in drills:
        node = target(drill, nodes)
        if node in nodes:
            continue
        group = ", ".join(nodes)
        where = (f"a warm spare waiting outside the attempt's group ({group})" if node in warm else
                 f"not a node of the attempt ({group}) and not started with it")  # fmt: skip
        # Which nodes train is the pressure test's choice (its ranking), made after the spec named the drill's node.
        out.append((drill, f"{node} is {where}: the drill strikes only if {node} joins the group before step"
                           f" {drill.step} (in place, when a node of the group fails or leaves), else never; to drill"
                           f" a node that trains, name one of {group}"))  # fmt: skip
    return out


def announce_waiting(ledger: Ledger, attempt: int, drills: list[FaultDrill], nodes: list[str], warm: list[str]) -> None:
    """Record (``drill_waiting``) and log each of the attempt's ``drills`` that ``waiting`` finds."""
    for drill, why in waiting(drills, nodes, warm):
        record = DrillWaiting(attempt=attempt, fault=drill.fault, node=target(drill, nodes), step=drill.step,
                              reason=why)  # fmt: skip
        ledger.append(STAGE, record.event, **record.fields())
        log.warning("attempt %d: drill %s at step %d waits: %s", attempt, drill.fault, drill.step, why)


def unreached(drill: FaultDrill, seen: Progress) -> str:
    """Why a drill never struck in an attempt that ended: its node's progress never showed its step."""
    if seen.steps or not seen.beatless:
        return f"its node's heartbeats never reported step {drill.step}"
    return (
        f"the script reports no step (no heartbeats, no step line in its log) and saved no checkpoint of step"
        f" {drill.step} or later in the checkpoint root; {HOW_TO_BEAT}"
    )


def newest_checkpoint(root: Path, since: float) -> int | None:
    """The newest step folder in ``root`` made since ``since``: names and ``lstat`` only, nothing is opened."""
    try:
        names = os.listdir(root)
    except OSError:
        return None
    steps = []
    for name in names:
        step = step_of(name)
        try:
            if step is not None and (root / name).lstat().st_mtime >= since:
                steps.append(step)
        except OSError:
            continue
    return max(steps, default=None)


class Actor:
    """One attempt's outside drills, carried out at each poll of the blocking watch (``each_poll``)."""

    def __init__(self, drills: list[FaultDrill], plan: LaunchPlan, launcher: SignalsNodes, ledger: Ledger,
                 started: float, timeout_s: float, grace_s: float = STARTUP_GRACE_S) -> None:  # fmt: skip
        self.left, self.plan, self.launcher, self.ledger = list(drills), plan, launcher, ledger
        self.started, self.timeout_s, self.grace_s = started, timeout_s, grace_s
        self.seen = Progress({})
        self.acting = False
        self.logged: Callable[[], LogStep | None] | None = None
        """The furthest step the nodes' logs show (``LogSteps.read``, read at every poll), while no rank beats."""

    def look(self) -> Progress:
        beats = scan(self.plan.heartbeat_dir).beats
        steps: dict[str, int] = {}
        for beat in beats.values():
            node = str(beat.get("folder") or beat.get("node") or "")
            steps[node] = max(steps.get(node, 0), int(beat.get("step") or 0))
        quiet = beatless(beats, self.started, time.time(), self.timeout_s, self.grace_s)
        read = self.logged() if self.logged is not None and not steps else None
        logged = read.step if read is not None else None
        return Progress(steps, newest_checkpoint(self.plan.train_env.checkpoint_dir, self.started), quiet, logged)

    def __call__(self, handle: Any) -> None:
        outside = [d for d in self.left if d.fault in OUTSIDE_FAULTS]
        if not outside or self._self_acting():
            return
        self.seen = seen = self.look()
        for drill in outside:
            if why := refused(drill, self.plan.nodes, seen):
                self._refuse(drill, why)
                outside.remove(drill)
        for drill, node, step, source in due(outside, self.plan.nodes, seen):
            self.left.remove(drill)
            self.ledger.append(STAGE, "drill_fired", attempt=self.plan.attempt, fault=drill.fault, node=node,
                               step=step)  # fmt: skip
            log.warning("attempt %d: drill %s on %s at step %d (by its %s), acted out from outside",
                        self.plan.attempt, drill.fault, node, step, source)  # fmt: skip
            self.launcher.signal_nodes(handle, [node], drill.fault, drill.factor)

    def _self_acting(self) -> bool:
        """The script said it acts out its drills itself (``drills_acted``, written as its processes start):
        then every drill is its own, exactly at its step, and none is acted twice."""
        if not self.acting:
            self.acting = self.plan.attempt in TrainRun.of(self.ledger.events(STAGE, "drills_acted")).drills_acted
        return self.acting

    def ended(self, failed: bool) -> None:
        """The attempt ended: a drill that never struck is refused, with why (never silently dropped). One acted
        out inside the process struck if the process said so (its ``drill_fired``)."""
        fired = {(d.fault, d.step) for d in TrainRun.of(self.ledger.events(STAGE, "drill_fired")).fired}
        for drill in list(self.left):
            if (drill.fault, drill.step) in fired:
                self.left.remove(drill)
                continue
            if drill.fault in OUTSIDE_FAULTS and not self._self_acting():
                why = f"the attempt failed before step {drill.step}" if failed else unreached(drill, self.seen)
            elif self._self_acting():
                why = f"the script acts out its drills itself and did not reach step {drill.step}"
            else:
                why = INSIDE_WHY.format(fault=drill.fault, step=drill.step)
            self._refuse(drill, why)

    def _refuse(self, drill: FaultDrill, why: str) -> None:
        self.left.remove(drill)
        record = DrillRefused(attempt=self.plan.attempt, fault=drill.fault, node=target(drill, self.plan.nodes),
                              step=drill.step, reason=why)  # fmt: skip
        self.ledger.append(STAGE, record.event, **record.fields())
        log.warning(
            "attempt %d: drill %s at step %d not acted out: %s", self.plan.attempt, drill.fault, drill.step, why
        )
