"""Policy: what to do about a classified failure (docs/architecture.md, rule 4).

``decide(history, failure, situation, policy) -> Regroup | Retry | ScaleDown | Rollback | GiveUp``
is pure: no sleeps, no I/O, no API calls; the supervisor carries the decision
out. The action for a failure kind comes from the spec (``recovery.actions``)
or the defaults (``spec.DEFAULT_ACTIONS``, docs/architecture.md), both in the spec's ``Action``
vocabulary, which ``ACTIONS`` implements one function each; the attempt budget, the
backoff, the micro-batch after an OOM, the world size of a scale-down and the
rollback target are worked out here, so each is a row in a table test.

Choices this module makes (each a line of the reason it returns):

- A ``fail`` action wins over the budget: "user_error: ..." says more than
  "budget exhausted" when both hold.
- Backoff is ``backoff_s * 2**(n-1)``, n counting this kind's earlier failures
  plus this one, capped at ``MAX_DELAY_S``; it applies to every action.
- Scale-down keeps the global batch: the world size must divide it, and the
  micro-batch is the largest divisor of the per-rank batch that is not above
  the current one (more gradient accumulation). Spares replace culprits first,
  so the run keeps its size; the world never grows past the failed attempt's.
- With no culprit to leave out (a hang whose silent node is unknown), the
  scale-down is a ``Retry`` on the same nodes: that is what would happen.
- In place first (``Regroup``): a lost, hung, transient or preempted node (one given
  notice leaves: ``Classified.leaving``, never blamed) whose survivors can regroup (``Situation.in_place``: the runtime and launcher say they can) keeps them
  running: the world is the one a scale-down would pick (spares replace culprits
  first, the global batch kept), and nothing restarts. Each reason it cannot is a
  line of the relaunch decision's reason, so the ledger says which path and why.
  The same kind failing again at the step of the last regroup (no progress since),
  or more than ``MAX_REGROUPS`` times since the newest valid checkpoint (in one attempt),
  relaunches instead: what does not heal in place is not tried in place forever, while
  a long run that saves between its faults heals each of them in place.
- Rollback goes to the newest valid checkpoint below the step the divergence
  was seen at; if the failed attempt had itself resumed after an earlier
  divergence, that starting checkpoint is suspect too and the target is below
  it: each recurrence steps back one more checkpoint. With nothing earlier,
  an attempt that resumed from a checkpoint rolls back to step 0 (a fresh
  start), while an attempt that *was* a fresh start fails: training the same
  seed from scratch again would diverge the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, ClassVar, Literal, get_args

from trainyard.kinds import IN_PLACE_KINDS as IN_PLACE_KINDS
from trainyard.recovery.classify import Classified
from trainyard.spec.models import Action, FailureKind

if TYPE_CHECKING:
    from trainyard.spec import RecoverySpec

MAX_DELAY_S = 3600.0
"""Longest pause before the next attempt, however often a kind recurs."""
MAX_REGROUPS = 3
"""In-place regroups per failure kind in one attempt since its newest valid checkpoint; the next failure of that
kind relaunches."""
# ``IN_PLACE_KINDS`` (``trainyard.kinds``, the ``in_place`` trait): failures the survivors can heal by regrouping;
# the others keep their relaunch actions (an OOM needs a smaller micro-batch in fresh processes, a divergence a
# rollback, a user or data error a person).

# ---------------------------------------------------------------- decisions


@dataclass(frozen=True)
class Retry:
    delay_s: float
    reason: str
    micro_batch: int | None = None
    """None: unchanged."""
    action: ClassVar[Action] = "retry"


@dataclass(frozen=True)
class ScaleDown:
    nodes: list[str]
    """The next attempt's nodes; spares may join (the scale-back-up path)."""
    delay_s: float
    reason: str
    micro_batch: int
    action: ClassVar[Action] = "scale_down"


@dataclass(frozen=True)
class Rollback:
    to_step: int
    """0: no earlier valid checkpoint; start fresh."""
    delay_s: float
    reason: str
    action: ClassVar[Action] = "rollback"


@dataclass(frozen=True)
class GiveUp:
    reason: str
    action: ClassVar[Action] = "fail"


@dataclass(frozen=True)
class Regroup:
    """Recover in place: the survivors keep their processes and state and form a new group of ``nodes``."""

    nodes: list[str]
    """The new group's nodes, survivors first, then ``joiners``."""
    joiners: list[str]
    """Spares that join and receive the state by broadcast."""
    leave_out: list[str]
    """The culprits left out (the decision's ``left_out``); the controller kills every node outside ``nodes``,
    these (a hung node must not hold its sockets open) and any that already exited."""
    micro_batch: int
    reason: str
    action: ClassVar[Literal["regroup"]] = "regroup"


Decision = Regroup | Retry | ScaleDown | Rollback | GiveUp

# ---------------------------------------------------------------- the input


@dataclass(frozen=True)
class AttemptRecord:
    """One earlier failed attempt, from the run ledger."""

    attempt: int
    kind: FailureKind
    decision: Action | Literal["regroup"]
    nodes: list[str]
    progressed: bool = True
    """Whether the attempt trained past the step it started from before it ended (a notice that cut short an
    attempt that made progress is a change of members, not a failure: ``spends``)."""


def spends(record: AttemptRecord) -> bool:
    """Whether an earlier decision used up an attempt of the budget and a step of the backoff: every relaunch
    but a regroup (no new attempt) and a notice to an attempt that had trained on (torchelastic's rule too:
    membership changes are not restarts). A notice before any progress spends, so a fleet that preempts every
    attempt before its first step still runs out of attempts."""
    return record.decision != "regroup" and not (record.kind == "preempted" and record.progressed)


@dataclass(frozen=True)
class InPlace:
    """Whether the failed attempt's survivors can regroup in place, from the supervisor's view of it."""

    ok: bool
    why_not: str = ""
    """Why not (said in the relaunch decision's reason): the script does not use the elastic runtime,
    the backend cannot keep processes across a regroup, the store is gone, ..."""
    regroups: list[tuple[FailureKind, int | None]] = field(default_factory=list)
    """This attempt's earlier regroups: (kind, the step its failure was seen at)."""


@dataclass(frozen=True)
class Situation:
    """Every node name here is a host (where a rank group runs: a Kubernetes node name, or the local
    backend's simulated node), as ``Classified.culprits`` are: hosts are compared with hosts."""

    nodes: list[str]
    """The failed attempt's hosts (its plan's nodes, which its pods were pinned to)."""
    spares: list[str]
    """Healthy hosts not in use (from the pressure test), to replace culprits."""
    min_nodes: int
    procs_per_node: int
    global_batch: int
    micro_batch: int
    """In use by the failed attempt."""
    valid_steps: list[int] = field(default_factory=list)
    """Steps of valid checkpoints, ascending."""
    resumed_from: int | None = None
    """Step the failed attempt started from; None: a fresh start."""
    in_place: InPlace | None = None
    """None: in-place recovery is not offered at all (nothing said about it)."""
    running: list[str] | None = None
    """Hosts whose processes still ran when the failure was seen; None: not known (assumed running)."""
    batch_followed: bool = True
    """The script applies ``TRAINYARD_GLOBAL_BATCH``/``TRAINYARD_MICRO_BATCH`` (it said so: ``batch_followed``);
    False: it keeps its own batch size, so a change of world changes its global batch."""


# ---------------------------------------------------------------- arithmetic


def backoff(history: list[AttemptRecord], kind: FailureKind, policy: RecoverySpec) -> float:
    """``backoff_s * 2**(n-1)``; n = earlier failures of ``kind`` + this one."""
    n = sum(1 for h in history if h.kind == kind and spends(h)) + 1
    return float(min(policy.backoff_s * 2 ** (n - 1), max(MAX_DELAY_S, policy.backoff_s)))


def fitting_micro_batch(global_batch: int, ranks: int, at_most: int) -> int | None:
    """The largest micro-batch <= ``at_most`` that splits ``global_batch`` evenly over ``ranks``."""
    if ranks < 1 or global_batch % ranks:
        return None
    per_rank = global_batch // ranks
    return next((m for m in range(min(at_most, per_rank), 0, -1) if per_rank % m == 0), None)


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _what(failure: Classified, culprits: list[str] | None = None) -> str:
    where = f" on {', '.join(culprits)}" if culprits else ""
    return f"{failure.kind}{where} ({_one_line(failure.evidence)})"


FOLLOW_BATCH = "call trainyard.runtime.follow_batch() and train with the micro-batch and accumulation it returns"
"""The fix a decision names for a script that does not apply the batch settings."""


def _batch(s: Situation, nodes: int, micro: int) -> str:
    """The batch after a change to ``nodes`` nodes at micro-batch ``micro``: kept where the script applies the
    settings; else unknown, with what a script that keeps its own per-rank batch trains with, and the fix."""
    ranks = nodes * s.procs_per_node
    if s.batch_followed:
        accum = s.global_batch // (ranks * micro)
        return f"micro-batch {micro} x {accum} accumulation, global batch {s.global_batch} kept"
    after = s.global_batch * ranks // max(1, len(s.nodes) * s.procs_per_node)
    change = f"changes from {s.global_batch} to {after}" if after != s.global_batch else f"stays {s.global_batch}"
    # Unknown, not denied: trainyard cannot see into a script that never said whether it reads the settings.
    return (f"global batch unknown: the script has not confirmed it read TRAINYARD_GLOBAL_BATCH/TRAINYARD_MICRO_BATCH"
            f" (no batch_followed event); if it keeps its own per-rank batch, the global batch {change} and"
            f" micro-batch {micro} is not applied; {FOLLOW_BATCH}")  # fmt: skip


# ---------------------------------------------------------------- actions

Act = Callable[[list[AttemptRecord], Classified, Situation, float], "Decision"]


def _retry(history: list[AttemptRecord], failure: Classified, s: Situation, delay: float) -> Decision:
    if failure.kind == "oom":
        return _smaller_micro_batch(failure, s, delay)
    return Retry(delay, f"{_what(failure)}: retry on the same {len(s.nodes)} nodes in {delay:g} s")


def _smaller_micro_batch(failure: Classified, s: Situation, delay: float) -> Decision:
    if s.micro_batch <= 1:
        return GiveUp(f"out of memory at micro-batch 1: {_what(failure, failure.culprits)}")
    micro = fitting_micro_batch(s.global_batch, len(s.nodes) * s.procs_per_node, s.micro_batch // 2)
    if micro is None:  # the spec's cross-field check rules this out; kept for a hand-built Situation
        return GiveUp(f"{_what(failure)}: global batch {s.global_batch} does not split over"
                    f" {len(s.nodes)} x {s.procs_per_node} ranks")  # fmt: skip
    return Retry(delay, f"{_what(failure, failure.culprits)}: retry with micro-batch {s.micro_batch} -> {micro}"
                        f" ({_batch(s, len(s.nodes), micro)}) in {delay:g} s", micro)  # fmt: skip


def _scale_down(history: list[AttemptRecord], failure: Classified, s: Situation, delay: float) -> Decision:
    culprits = [n for n in s.nodes if n in failure.culprits]
    if not culprits:
        outside = [n for n in failure.culprits if n not in s.nodes]
        why = (f"{', '.join(outside)} is not among the attempt's hosts {', '.join(s.nodes)} (were its pods pinned?)"
               if outside else "no node to leave out")  # fmt: skip
        return Retry(delay, f"{_what(failure)}: {why}; retry on the same {len(s.nodes)} nodes in {delay:g} s")
    keep = [n for n in s.nodes if n not in culprits]
    spares = [n for n in s.spares if n not in s.nodes and n not in failure.culprits]
    what = _what(failure, culprits)
    if len(spares) >= len(culprits):
        joined = spares[: len(culprits)]
        return ScaleDown(keep + joined, delay, f"{what}: replace with spare {', '.join(joined)}, scaling back up to"
                                               f" {len(s.nodes)} nodes, micro-batch {s.micro_batch} kept",
                         s.micro_batch)  # fmt: skip
    pool = keep + spares  # too few spares to keep the size: the ones there are still help
    for world in range(len(pool), s.min_nodes - 1, -1):
        micro = fitting_micro_batch(s.global_batch, world * s.procs_per_node, s.micro_batch)
        if micro is not None:
            joining = f" (spare {', '.join(spares)} joins)" if spares else ""
            return ScaleDown(pool[:world], delay, f"{what}: scale down {len(s.nodes)} -> {world} nodes{joining},"
                                                  f" {_batch(s, world, micro)}", micro)  # fmt: skip
    return GiveUp(f"{what}: cannot scale down: no world size from {len(pool)} down to nodes.min {s.min_nodes}"
                f" x {s.procs_per_node} procs divides the global batch {s.global_batch}")  # fmt: skip


def _rollback(history: list[AttemptRecord], failure: Classified, s: Situation, delay: float) -> Decision:
    ceiling = failure.step
    resumed = s.resumed_from
    if resumed is not None and any(h.kind == failure.kind for h in history):
        # the failed attempt resumed after the same failure, from a checkpoint that is now suspect
        ceiling = resumed if ceiling is None else min(ceiling, resumed)
    below = [v for v in s.valid_steps if v > 0 and (ceiling is None or v < ceiling)]
    seen_at = f" below step {ceiling}" if ceiling is not None else ""
    if below:
        return Rollback(max(below), delay, f"{_what(failure)}: roll back to step {max(below)}, the newest valid"
                                           f" checkpoint{seen_at}")  # fmt: skip
    if not s.resumed_from:
        return GiveUp(f"{_what(failure)}: a fresh start diverged and there is no valid checkpoint{seen_at} to roll"
                    f" back to")  # fmt: skip
    return Rollback(0, delay, f"{_what(failure)}: no valid checkpoint{seen_at}; start fresh")


def _fail(history: list[AttemptRecord], failure: Classified, s: Situation, delay: float) -> Decision:
    return GiveUp(f"{_what(failure)}: not retried (recovery action for {failure.kind} is fail)")


ACTIONS: dict[Action, Act] = {"retry": _retry, "scale_down": _scale_down, "rollback": _rollback, "fail": _fail}
# Every action the spec can name has its function (a new one in the Literal fails here, at import).
if set(ACTIONS) != set(get_args(Action)):  # pragma: no cover
    raise ImportError(f"recovery.policy.ACTIONS {sorted(ACTIONS)} != spec Action {sorted(get_args(Action))}")


def _regroup(history: list[AttemptRecord], failure: Classified, s: Situation) -> Regroup | str:
    """The in-place decision, or why there is none (a phrase for the relaunch decision's reason)."""
    in_place = s.in_place
    assert in_place is not None
    if not in_place.ok:
        return in_place.why_not or "the attempt cannot regroup in place"
    same = [step for kind, step in in_place.regroups if kind == failure.kind]
    # Counted since the newest valid checkpoint: a long run heals a fault every hour in place for days, but
    # faults that come back before the run can even save again are not healing.
    newest = max(s.valid_steps, default=None)
    recent = [step for step in same if newest is None or step is None or step >= newest]
    if len(recent) >= MAX_REGROUPS:
        since = f" since the checkpoint of step {newest}" if newest is not None else " in this attempt"
        return f"{failure.kind} regrouped in place {len(recent)} times{since} already"
    if same and failure.step is not None and same[-1] == failure.step:
        return f"{failure.kind} again at step {failure.step}, where the last regroup resumed: no progress in place"
    if failure.kind == "hang" and not failure.culprits:
        return "the silent node of the hang is not known, so no survivor set can be chosen"
    if failure.kind == "preempted":  # the nodes given notice are left out, never blamed (nothing is excluded)
        failure = replace(failure, culprits=list(failure.leaving))
    world = _scale_down(history, failure, s, 0.0)
    if isinstance(world, GiveUp):
        return world.reason
    culprits = [n for n in s.nodes if n in failure.culprits]
    nodes, micro = (world.nodes, world.micro_batch) if isinstance(world, ScaleDown) else (s.nodes, s.micro_batch)
    joiners = [n for n in nodes if n not in s.nodes]
    if s.running is not None and (exited := [n for n in nodes if n in s.nodes and n not in s.running]):
        # Their state died with them (a failed regroup, a lost store): only a restart from the checkpoint is left.
        return f"{', '.join(exited)} exited too, so no survivor keeps the state"
    what = _what(failure, culprits)
    if isinstance(world, ScaleDown) and joiners and len(nodes) == len(s.nodes):
        how = f"spare {', '.join(joiners)} joins with the survivors' state, {len(nodes)} nodes kept"
    elif isinstance(world, ScaleDown):
        how = f"{len(s.nodes)} -> {len(nodes)} nodes, {_batch(s, len(nodes), micro)}"
    else:
        how = f"the same {len(nodes)} nodes in a new group"
    return Regroup(nodes, joiners, culprits, micro, f"{what}: regroup in place, {how}; survivors keep their state")


def decide(history: list[AttemptRecord], failure: Classified, situation: Situation, policy: RecoverySpec) -> Decision:
    """What to do after the attempt described by ``failure`` (``history``: the attempts before it)."""
    action = policy.action_for(failure.kind)
    if action == "fail":
        return _fail(history, failure, situation, 0.0)
    # A regroup is no attempt; nor is a notice to an attempt that trained on (it ends, and spends, nothing).
    notice = failure.kind == "preempted" and failure.step is not None and failure.step > (situation.resumed_from or 0)
    if sum(map(spends, history)) + (0 if notice else 1) >= policy.max_attempts:
        return GiveUp(f"attempt budget of {policy.max_attempts} exhausted: {failure.kind}:"
                    f" {_one_line(failure.evidence)}")  # fmt: skip
    why_not = ""
    if policy.in_place and situation.in_place is not None and failure.kind in IN_PLACE_KINDS:
        if action in ("retry", "scale_down"):
            regroup = _regroup(history, failure, situation)
            if isinstance(regroup, Regroup):
                return regroup
            why_not = f"; relaunch, not in place: {regroup}"
        else:
            why_not = f"; relaunch, not in place: recovery action for {failure.kind} is {action}"
    decision = ACTIONS[action](history, failure, situation, backoff(history, failure.kind, policy))
    # a GiveUp's reason already says why no world exists, in place or not
    return (
        replace(decision, reason=decision.reason + why_not)
        if why_not and not isinstance(decision, GiveUp)
        else decision
    )
