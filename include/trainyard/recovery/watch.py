"""Detection: what is wrong with a running attempt, seen from the files its ranks write, and the evidence.

A node whose agent exits non-zero has crashed; a rank whose heartbeat is
older than the timeout (or that never beat within it) is hung, and of the
hung ranks those whose liveness pulse stopped are the suspects. Hang
detection needs heartbeats: while no rank of an attempt has beaten, nothing
is called hung (a script that makes no trainyard calls never beats, and its
liveness is its processes' own: exits, the launcher's view); past the first
beat's grace that is ``beatless`` (the run says once that hang detection is
off, and how to turn it on: ``protocol.heartbeat.HOW_TO_BEAT``). Once any rank
beat, the script beats: a rank that never did, or stopped, is hung as before. ``failed``
turns what was seen into the controller's observation, with its evidence
(node statuses, log tails, failure records, the last step). Both drivers
look through here: the blocking watch (``recovery.attempt``) and the
deferred one's trigger (``airflow.triggers``, ``recovery.deferred``).
Everything read here was written by training code (docs/architecture.md,
untrusted input): heartbeats and failure records through the protocol's
readers, log tails from regular files only. Each node's processes write into
a folder of their own (``protocol.heartbeat.node_folder``), so the folder a
beat or record lies in, not what it says, names the node: the only nodes
blamed are where the attempt's nodes ran (the launcher's word), and a
beat's own ``node``/``host`` never names a suspect. Pulse files are only
``lstat``ed, never opened.
"""

from __future__ import annotations

import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from trainyard.atomic import open_regular
from trainyard.backends.base import AttemptStatus, LaunchPlan
from trainyard.protocol.heartbeat import HOW_TO_BEAT, Owner, read_heartbeats, scan, warn_once
from trainyard.protocol.records import FailureRecord, failure_records
from trainyard.recovery.classify import Failure
from trainyard.recovery.controller import node_failures
from trainyard.recovery.observations import AttemptFailed, Checkpoints
from trainyard.text import printable

TAIL_LINES = 50
CRASH: Final = "crash"
HANG: Final = "hang"
BEATLESS: Final = "beatless"
"""What a look can find wrong with a running attempt (``Detection.trigger``), named once."""


@dataclass(frozen=True)
class Detection:
    """What is wrong with a running attempt: ``trigger`` (``CRASH``, ``HANG`` or ``BEATLESS``), why, and the
    nodes to blame (a hang's silent nodes; none for a crash, whose failed nodes are in the status)."""

    trigger: str
    reason: str
    suspects: list[str] = field(default_factory=list)


STARTUP_GRACE_S = 120.0  # interpreter, torch import, rendezvous and data before a rank's first step


def group_beats(beats: dict[str, dict[str, Any]], members: list[str], per_node: int = 1) -> dict[str, dict[str, Any]]:
    """The beats of a regrouped attempt's current group: rank ``k`` is ``members[k // per_node]``'s (each member
    node has ``per_node`` ranks), or not yet there.

    A regroup renumbers the ranks: a file left by the node that held a rank before (a dead node's last
    beat, a survivor's beat under its old number) says nothing about the group that runs now."""
    owner = _owner(members, per_node)
    return {
        rank: beat
        for rank, beat in beats.items()
        if (k := _rank_number(rank)) is not None and (node := owner(k)) is not None and _node_of(beat) == node
    }


def _owner(members: list[str], per_node: int) -> Owner:
    """The member node whose folder holds rank ``k``'s beat in a regrouped attempt (None: no such rank)."""
    per = max(1, per_node)
    return lambda k: members[k // per] if k < len(members) * per else None


def _members_folder(members: list[str] | None, per_node: int = 1) -> Owner | None:
    """Where rank ``k``'s beat must lie in a regrouped attempt (None: not regrouped)."""
    return None if members is None else _owner(members, per_node)


def _node_of(beat: dict[str, Any]) -> Any:
    """The node a beat is from: its folder's (the writer could not choose it), else what it says."""
    return beat.get("folder") or beat.get("node")


def _rank_number(name: str) -> int | None:
    number = name.removeprefix("rank-")
    return int(number) if number.isdigit() else None


def stale_ranks(
    beats: dict[str, dict[str, Any]],
    expected: int,
    started: float,
    now: float,
    timeout_s: float,
    grace_s: float = STARTUP_GRACE_S,
    beats_known: bool = False,
) -> list[str]:
    """Ranks without progress for longer than ``timeout_s``; a rank that never beat gets ``grace_s`` to start.

    No beat at all is no hang: the script may write none (``beatless``); its ranks are judged by their exits.
    ``beats_known``: the script beat in an earlier attempt of the run, so ranks that never beat are hung."""
    stale = [rank for rank, b in beats.items() if b.get("status") != "finished" and now - b["time"] > timeout_s]
    if (beats or beats_known) and len(beats) < expected and now - started > first_beat_s(timeout_s, grace_s):
        stale += [f"rank-{r}" for r in range(expected) if f"rank-{r}" not in beats]
    return stale


def beatless(beats: dict[str, dict[str, Any]], started: float, now: float, timeout_s: float,
             grace_s: float = STARTUP_GRACE_S) -> bool:  # fmt: skip
    """Whether the attempt's script looks like one that writes no heartbeats: no rank beat by the time one
    that did would have been called hung. Hang detection is off for it until a first beat."""
    return not beats and now - started > first_beat_s(timeout_s, grace_s)


def first_beat_s(timeout_s: float, grace_s: float) -> float:
    """How long after the start a rank may be without its first heartbeat: the start-up grace, or the
    timeout where that is longer (a rank that started is never held to less than one that beat)."""
    return max(timeout_s, grace_s)


def silent_ranks(
    directory: Path,
    ranks: list[str],
    now: float,
    after_s: float = 3.0,
    folders: dict[str, str] | None = None,
    pulses: dict[str, str] | None = None,
) -> list[str]:
    """Of ``ranks``, those whose liveness pulse (touched every second) stopped.

    ``folders``: the node folder of each rank's pulse (its beat's); ``pulses``: its file's name there (the
    beat's ``pulse``: ``node.alive`` for a node's beat), by default ``rank-N.alive``. A pulse is ``lstat``ed,
    never opened or followed: a FIFO costs nothing, and a link (to a file something else keeps fresh) is no
    pulse."""
    silent = []
    for rank in ranks:
        folder = (folders or {}).get(rank, "")
        path = (directory / folder if folder else directory) / (pulses or {}).get(rank, f"{rank}.alive")
        try:
            st = path.lstat()
        except OSError:
            silent.append(rank)
            continue
        if not stat.S_ISREG(st.st_mode):
            warn_once(str(path), "pulse", "pulse %s is not a regular file; counted as no pulse", path)
            silent.append(rank)
        elif now - st.st_mtime > after_s:
            silent.append(rank)
    return silent


TAIL_BYTES = 64 * 2**10
"""The end of a node's log read for its tail: 50 lines of tracebacks fit; a log is never read whole."""
TAIL_LINE_CHARS = 1000
"""Characters of one log line quoted; a longer one is cut."""


def tail(path: str, lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a node's log, from its last ``TAIL_BYTES`` only, each one printable text.

    The log is written by training code: it may be gigabytes (or a sparse file of them), so only its end is
    read; a line may hold escape sequences meant to rewrite what the task log shows, so each is quoted
    through ``text.printable`` (tabs as spaces), cut at ``TAIL_LINE_CHARS``.
    """
    try:  # a node log training code replaced with a link to a secret is not quoted into the ledger
        with open_regular(Path(path)) as fh:
            start = max(0, os.fstat(fh.fileno()).st_size - TAIL_BYTES)
            fh.seek(start)
            rows = fh.read(TAIL_BYTES).decode(errors="replace").splitlines()
    except OSError:
        return ""
    if start and len(rows) > 1:
        rows = rows[1:]  # the first began before the part read
    return "\n".join(printable(row.expandtabs(), TAIL_LINE_CHARS) for row in rows[-lines:])


def detect(
    status: AttemptStatus,
    heartbeat_dir: Path,
    world_size: int,
    started: float,
    timeout_s: float,
    grace_s: float = STARTUP_GRACE_S,
    members: list[str] | None = None,
    beatless_said: bool = True,
    beats_known: bool = False,
) -> Detection | None:
    """What is wrong with a running attempt, if anything (``Detection``).

    A failed node is a crash. A rank without progress past the timeout is a
    hang; of those, ranks whose liveness pulse stopped are the suspects --
    ranks stuck behind a hung peer still pulse. ``beatless_said`` False: an
    attempt without a single beat past the first beat's grace is news too
    (trigger ``beatless``, no failure: the driver tells the controller once). ``beats_known``: an earlier
    attempt of the run beat, so an attempt without a beat is stuck before its loop (hung), not beatless.
    """
    if status.state == "failed":
        return Detection(CRASH, _crash_reason(status))
    per_node = max(1, world_size // len(members)) if members else 1  # a member node brings all its ranks
    seen = scan(heartbeat_dir, _members_folder(members, per_node))
    beats = seen.beats
    if members is not None:  # regrouped at ``started``: every rank of the group has a full timeout from then
        beats = {r: {**b, "time": max(b["time"], started)} for r, b in group_beats(beats, members, per_node).items()}
    now = time.time()
    if not beatless_said and not beats_known and beatless(beats, started, now, timeout_s, grace_s):
        return Detection(
            BEATLESS, f"no heartbeat from any rank {first_beat_s(timeout_s, grace_s):.0f} s after the start"
        )
    stale = stale_ranks(beats, world_size, started, now, timeout_s, grace_s, beats_known)
    if not stale:
        return None
    # Every rank still at work is a suspect, not only those past the timeout: the ranks waiting on a hung
    # peer went quiet at the same step, and the first poll past the timeout may see only one of them stale.
    # The pulse tells them apart (waiting ranks pulse; a stopped or frozen one does not).
    working = sorted({*stale, *(r for r, b in beats.items() if b.get("status") != "finished")})
    silent = silent_ranks(
        heartbeat_dir, working, now,
        folders={r: b.get("folder", "") for r, b in beats.items()},
        pulses={r: b["pulse"] for r, b in beats.items() if b.get("pulse")},
    )  # fmt: skip
    # Hosts, as everywhere recovery names nodes: where the beat's folder's node ran, never what a beat says.
    ran = where_nodes_ran(status)
    nodes = sorted({n for r in silent if r in beats and (n := _node_of(beats[r])) in ran})
    # A rank that never beat is not one that stopped: say which it is (pods that never started look so).
    stopped, never = [r for r in stale if r in beats], [r for r in stale if r not in beats]
    said = [f"no progress for {timeout_s:.0f} s from {', '.join(stopped)}"] if stopped else []
    if never:  # others beat (or did in an earlier attempt): these never started their loop, or skip the call
        others = "other ranks beat" if beats else "earlier attempts beat"
        said.append(
            f"no first heartbeat {first_beat_s(timeout_s, grace_s):.0f} s after the start from {', '.join(never)}"
            f" though {others} (each rank must {HOW_TO_BEAT})"
        )
    refused = [f"{name} refused ({why})" for name, why in sorted(seen.refused.items())[:4]]
    return Detection(HANG, "; ".join([*said, f"no pulse from {', '.join(silent) or 'none'}", *refused]), nodes)


def where_nodes_ran(status: AttemptStatus) -> list[str]:
    """The node folders that count, by the launcher's word: each node's is named by its ``TRAINYARD_NODE``,
    a local node's slot (its host) or a pod's host (``spec.nodeName``), which is what recovery blames."""
    return sorted({n.where for n in status.nodes})


def host_records(heartbeat_dir: Path, status: AttemptStatus, refused: list[str] | None = None) -> list[FailureRecord]:
    """The ranks' failure records, each from the folder of a node that ran (what recovery blames).

    ``failure_records`` takes a record only from the folder of the node it names, so a rank can blame
    no node but its own, and only a node the attempt ran on (``where_nodes_ran``)."""
    return failure_records(heartbeat_dir, where_nodes_ran(status), refused)


def last_step(heartbeat_dir: Path) -> int | None:
    """The heartbeats' newest step (the rate-bounded step events may not have reached it)."""
    return max((b.get("step", 0) for b in read_heartbeats(heartbeat_dir).values()), default=None)


def failed(
    plan: LaunchPlan,
    status: AttemptStatus,
    heartbeat_dir: Path,
    trigger: str,
    suspects: list[str],
    reason: str,
    checkpoints: Checkpoints | None = None,
    *,
    at: float,
    leaving: list[str] | None = None,
    silence: str = "",
) -> AttemptFailed:
    """The observation of a failed attempt, with its evidence: node statuses, their log tails, the last step.

    ``at``: when the failure was seen, before any evidence was gathered; ``leaving``: the nodes that reported
    on the coordination store that they leave on notice (trigger ``preempted``); ``silence``: a hang the
    nodes' logs showed (``training.log_silence_s``), what they showed."""
    tails = {n.where: tail(n.log) for n in status.nodes}
    refused: list[str] = []
    records = host_records(heartbeat_dir, status, refused)
    failure = Failure(
        attempt=plan.attempt,
        trigger=trigger,
        stale_nodes=list(suspects),
        last_step=last_step(heartbeat_dir),
        nodes=node_failures(status.nodes, tails),
        records=records,
        leaving=list(leaving or []),
        silence=silence,
    )
    reason = "; ".join([reason, *refused[:4]])  # a forged or broken record is evidence, not a verdict
    return AttemptFailed(plan.attempt, at, failure, reason, checkpoints or Checkpoints())


def _crash_reason(status: AttemptStatus) -> str:
    return "; ".join(
        f"{n.where} exited {n.exit_code}" + (f" ({n.reason})" if n.reason else "") for n in status.failed()
    )
