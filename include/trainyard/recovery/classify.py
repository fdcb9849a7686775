"""Classification: what one failed training attempt was, as a failure kind (pure: docs/architecture.md, decisions).

``classify(failure) -> Classified`` is pure: it reads the node statuses and log
tails the supervisor collected and returns a kind (``node_lost``, ``hang``,
``transient``, ``oom``, ``diverged``, ``user_error``, ``data_error``, ``preempted``), one line
of evidence a person can act on, and the nodes to blame. It sleeps, reads no
file and calls no API; ``policy.decide`` turns its answer into an action.

How the logs are read. A node's log is its torchrun agent's output plus its
workers' stderr. Each tail is split into streams -- one per rank prefix
(``[rank3]: ``, which torch puts before a worker's uncaught traceback) and one
for unprefixed lines (the agent, and workers before the process group forms)
-- and each stream into exception chains (``During handling of the above
exception`` joins two tracebacks into one chain). A chain whose exceptions
mention a connection or collective error is a symptom of a vanished peer, never
a root cause; torchrun's own wrappers (``ChildFailedError``, ``SignalException``
from a cancel) are never root causes either, nor is anything raised in the agent's
own code (its teardown after a cancel can fail to kill a process group already gone).

Precedence is the order of ``RULES``; the first rule that fires decides:

P. ``trigger == "preempted"``: nodes given notice reported on the coordination store (sealed with their
   own keys) that they leave at a step boundary -> preempted. Notice is no fault: no node is blamed
   (``Classified.leaving`` names them, for a regroup to leave out, never ``culprits``).
0. Failure records (``trainyard.protocol.records``): a rank of the training
   runtime that died of an exception said why before it exited. A root cause
   there (diverged, data_error, oom, node_lost, user_error, in that order)
   decides, quoting the record; ``transient`` (a peer vanished) is a symptom
   and leaves it to the rules below. Only records naming a node of the attempt
   count. The log rules below are for scripts that do not use the runtime.
1. Kubernetes reasons (``trainyard.backends.kubernetes.reasons``, the one list): OOMKilled ->
   oom; the scheduler's preemption, a node's graceful shutdown -> preempted (no blame);
   Evicted/NodeLost/taint eviction -> node_lost; image pull /
   container config errors, a pod no node fits (Unschedulable) -> user_error.
2. Root causes in a log (any node): non-finite loss -> diverged; DataError ->
   data_error; SpecError -> user_error; out of memory (CUDA's, NCCL's, the
   host's) -> oom; broken GPU (ECC, fallen off the bus, the driver's hardware
   Xid codes) -> node_lost; any other exception a worker raised that was not
   caused by a peer disconnect -> user_error (a CUDA illegal memory access
   too: a kernel's bad address is the program's, unless an Xid says otherwise).
3. ``trigger == "hang"`` -> hang, blaming the nodes whose ranks went silent.
   It comes before the symptoms below because the supervisor ends a hung
   attempt itself, and what the logs show afterwards is that ending.
4. A node that had already failed when the supervisor looked, by SIGTERM (exit -15 or 143, or its
   torchrun agent's "got signal: 15") -> preempted, its peers' errors being symptoms; no node is
   blamed. Connection / collective / rendezvous errors -> transient, unless some node
   was SIGKILLed (exit -9 or 137, or its agent reports a worker killed by
   SIGKILL): then that node is lost and its peers only saw it vanish. Among
   them, NCCL's watchdog timing out a collective -> hang, blaming no node:
   every rank that waited reports it, the one that never joined may not, and
   with no culprit the policy retries on the same nodes. NCCL's system, remote
   and internal errors (a peer or the network went away) stay transient.
5. Exit codes with no log evidence: SIGKILL -> node_lost.
6. Anything else -> transient, "unclassified: ..." (retrying once is the safe default).

Limits, knowingly accepted:

- Only the tails are read: a root cause scrolled out of the last ~50 lines by
  later noise is missed, and the failure reads as its symptoms.
- Logs of nodes that succeeded are ignored: a node that finished holds no root
  cause, and its shutdown warnings (a vanished rendezvous host) are noise.
- Root causes beat symptoms whatever the order nodes exited in; between two
  root causes on two nodes the earlier rule wins (diverged over data_error
  over ... over user_error).
- SIGTERM (exit -15/143) blames no node. It counts as notice (rule 4) only on a node that had failed
  when the supervisor looked, before its own cancel: the statuses are polled before it, the logs read
  after it (where every node shows the teardown). A SIGTERM of a failed Job's other pods seen in the same
  poll as a root cause loses to it (rules 1-2 come first).
- A kernel OOM kill outside Kubernetes is only a SIGKILL to us: it reads as a
  lost node unless the log says "out of memory".
- The patterns are the English messages of torch 2.x, gloo, NCCL and the
  kubelet; a message worded otherwise falls through to "unclassified".
- Culprits are named only where a node is at fault (node_lost, hang, oom);
  for diverged, user_error, data_error and transient the evidence names the
  node but nothing is to be excluded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from trainyard.backends.kubernetes.reasons import CONFIG_REASONS, NODE_LOST_REASONS, OOM_REASONS, PREEMPTED_REASONS
from trainyard.kinds import TABLE, FailureKind
from trainyard.protocol.records import FailureRecord
from trainyard.protocol.signs import LOG_PATTERNS
from trainyard.recovery.logread import Hit, best_line, last_words, split_streams, user_exception

MAX_EVIDENCE = 300
"""Characters of a quoted log line kept in the evidence (a CUDA OOM message runs to ~600)."""

# ---------------------------------------------------------------- the input and the answer


@dataclass(frozen=True)
class NodeFailure:
    node: str
    state: str
    """``failed`` | ``running`` | ``succeeded`` at the moment the supervisor stopped the attempt."""
    exit_code: int | None
    """Negative: killed by that signal (Popen's convention); 137 = 128 + 9 in containers."""
    reason: str = ""
    """Kubernetes' reason, if any (OOMKilled, Evicted, NodeLost, ImagePullBackOff, ...)."""
    log_tail: str = ""
    """The last lines of the node's log (torchrun agent and its workers' stderr)."""


@dataclass(frozen=True)
class Failure:
    attempt: int
    trigger: str
    """``crash`` (a node exited non-zero) | ``hang`` (heartbeats went stale while processes lived)."""
    nodes: list[NodeFailure]
    stale_nodes: list[str] = field(default_factory=list)
    """Nodes whose ranks stopped heartbeating (for ``hang``)."""
    last_step: int | None = None
    """Newest step any rank reported by heartbeat."""
    records: list[FailureRecord] = field(default_factory=list)
    """The ranks' failure records (``records.failure_records``), earliest first."""
    leaving: list[str] = field(default_factory=list)
    """Nodes that reported on the coordination store that they leave on notice (trigger ``preempted``)."""
    silence: str = ""
    """A hang seen in the nodes' logs rather than the heartbeats (``training.log_silence_s``): what they showed."""


@dataclass(frozen=True)
class Classified:
    kind: FailureKind
    """The spec's ``FailureKind`` vocabulary, whose ``recovery.actions`` say what to do about it."""
    evidence: str
    """One line a human can act on, quoting the decisive log line, exit code or reason."""
    culprits: list[str] = field(default_factory=list)
    """Nodes to blame (to exclude on scale-down); [] when no node is at fault."""
    step: int | None = None
    """Step the failure was seen at: a diverged loss's own step, else the last heartbeat step."""
    leaving: list[str] = field(default_factory=list)
    """``preempted``: the nodes given notice, which leave (a regroup leaves them out); never blamed."""


@dataclass(frozen=True)
class Finding:
    """What one rule found: its evidence and the nodes to blame (``RULES`` says which kind it is)."""

    evidence: str
    culprits: list[str] = field(default_factory=list)
    leaving: list[str] = field(default_factory=list)


SIGKILL_EXITS = frozenset({-9, 137})
SIGTERM_EXITS = frozenset({-15, 143})
_AT_STEP = re.compile(r"\bat step (\d+)")

# ---------------------------------------------------------------- what the logs show


@dataclass(frozen=True)
class Seen:
    """Everything the rules look at, gathered once from a ``Failure``."""

    failure: Failure
    hits: dict[str, list[Hit]]
    """Per category (``LOG_PATTERNS`` keys and ``user``), the best line of each node that shows it."""
    killed: dict[str, str]
    """SIGKILLed nodes and how we know (``exit -9``, or the agent's line)."""
    terminated: dict[str, str]
    """Nodes that had failed by SIGTERM when the supervisor looked, and how we know."""
    records: list[FailureRecord]
    """The failure records that name a node of the attempt, earliest first."""


def gather(failure: Failure) -> Seen:
    """What the statuses and logs of ``failure`` show, per category, for the rules."""
    # Failed nodes first: when several nodes show the same thing, the one that failed is quoted.
    nodes = sorted((n for n in failure.nodes if n.state != "succeeded"), key=lambda n: n.state != "failed")
    hits: dict[str, list[Hit]] = {cat: [] for cat in (*LOG_PATTERNS, "user")}
    killed: dict[str, str] = {}
    terminated: dict[str, str] = {}
    for n in nodes:
        streams = split_streams(n.log_tail)
        for cat in LOG_PATTERNS:
            line = best_line(streams, cat)
            if line is not None:
                hits[cat].append(Hit(n.node, line))
        user = user_exception(streams)
        if user is not None:
            hits["user"].append(Hit(n.node, user))
        agent_saw = next((h.line for h in hits["sigkill"] if h.node == n.node), None)
        if n.state == "failed" and n.exit_code in SIGKILL_EXITS:
            killed[n.node] = f"exit {n.exit_code}"
        elif agent_saw is not None:
            killed[n.node] = f"worker SIGKILLed ({_clip(agent_saw, 100)})"
        if n.state == "failed" and n.node not in killed:
            termed = next((h.line for h in hits["sigterm"] if h.node == n.node), None)
            if n.exit_code in SIGTERM_EXITS or termed is not None:
                terminated[n.node] = f"exit {n.exit_code}" + (f" ({_clip(termed, 100)})" if termed else "")
    attempt_nodes = {n.node for n in failure.nodes}
    records = sorted((r for r in failure.records if r.node in attempt_nodes), key=lambda r: (r.time, r.rank))
    return Seen(failure, hits, killed, terminated, records)


# ---------------------------------------------------------------- the rules


def _clip(text: str, limit: int = MAX_EVIDENCE) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _quote(hits: list[Hit], room: int = MAX_EVIDENCE) -> str:
    """``node: line (also on ...)``, the line clipped so the whole fits in ``room``."""
    others = sorted({h.node for h in hits[1:]} - {hits[0].node})
    head, tail = f"{hits[0].node}: ", f" (also on {', '.join(others)})" if others else ""
    return head + _clip(hits[0].line, room - len(head) - len(tail)) + tail


def _recorded(kind: FailureKind) -> Callable[[Seen], Finding | None]:
    """The earliest failure record of ``kind``: ``node rank N: Type: message (failure record; also ...)``."""
    blame = TABLE[kind].blames

    def rule(seen: Seen) -> Finding | None:
        found = [r for r in seen.records if r.kind == kind]
        if not found:
            return None
        first = found[0]
        others = sorted({r.node for r in found[1:]} - {first.node})
        head = f"{first.node} rank {first.rank}: "
        tail = " (its failure record" + (f"; also on {', '.join(others)})" if others else ")")
        said = head + _clip(f"{first.type}: {first.message}", MAX_EVIDENCE - len(head) - len(tail)) + tail
        return Finding(said, sorted({r.node for r in found}) if blame else [])

    return rule


def _k8s(kind: FailureKind, reasons: frozenset[str]) -> Callable[[Seen], Finding | None]:
    blame = TABLE[kind].blames

    def rule(seen: Seen) -> Finding | None:
        found = [n for n in seen.failure.nodes if n.reason in reasons]
        if not found:
            return None
        said = "; ".join(f"{n.node}: pod {n.reason}" + (f" (exit {n.exit_code})" if n.exit_code is not None else "")
                         for n in found)  # fmt: skip
        return Finding(said, [n.node for n in found] if blame else [])

    return rule


def _log(kind: FailureKind, category: str) -> Callable[[Seen], Finding | None]:
    """Lines of the runtime's ``category`` (``signs.LOG_PATTERNS``), read as ``kind``."""
    blame = TABLE[kind].blames

    def rule(seen: Seen) -> Finding | None:
        hits = seen.hits[category]
        if not hits:
            return None
        return Finding(_quote(hits), sorted({h.node for h in hits}) if blame else [])

    return rule


def _hang(seen: Seen) -> Finding | None:
    failure = seen.failure
    if failure.trigger != "hang":
        return None
    after = f" after step {failure.last_step}" if failure.last_step is not None else ""
    if failure.silence:  # a script without heartbeats, whose log went quiet: no node can be named
        return Finding(failure.silence, [])
    if not failure.stale_nodes:
        return Finding(f"heartbeats went stale{after}, but no silent node was identified", [])
    return Finding(f"no heartbeat from {', '.join(failure.stale_nodes)}{after}", list(failure.stale_nodes))


def _peer_killed(seen: Seen) -> Finding | None:
    if not (seen.hits["comm"] and seen.killed):
        return None
    lost = "; ".join(f"{node} {how}" for node, how in seen.killed.items())
    said = f"{lost}; peers lost it: "
    return Finding(said + _quote(seen.hits["comm"], MAX_EVIDENCE - len(said)), list(seen.killed))


def _killed(seen: Seen) -> Finding | None:
    if not seen.killed:
        return None
    lost = "; ".join(f"{node} {how}" for node, how in seen.killed.items())
    return Finding(f"{lost} (killed by SIGKILL, no error in its log)", list(seen.killed))


def _left(seen: Seen) -> Finding | None:
    failure = seen.failure
    if failure.trigger != "preempted" or not failure.leaving:
        return None
    at = f" after step {failure.last_step}" if failure.last_step is not None else ""
    said = f"{', '.join(failure.leaving)} given notice (SIGTERM): left at a step boundary{at}"
    return Finding(said, [], list(failure.leaving))


def _terminated(seen: Seen) -> Finding | None:
    """Notice by SIGTERM, when every other failed node only lost its peers (a failed Job's teardown of the
    other pods, seen beside an unexplained exit, is no preemption)."""
    symptoms = {h.node for h in seen.hits["comm"]}
    failed = [n.node for n in seen.failure.nodes if n.state == "failed" and n.node not in seen.terminated]
    if not seen.terminated or seen.killed or any(node not in symptoms for node in failed):
        return None
    said = "; ".join(f"{node} {how}" for node, how in seen.terminated.items())
    return Finding(f"{said}: terminated by SIGTERM (notice; not the host's fault)", [], list(seen.terminated))


def _preempted_pods(seen: Seen) -> Finding | None:
    found = _k8s("preempted", PREEMPTED_REASONS)(seen)
    return found and Finding(found.evidence, [], [n.node for n in seen.failure.nodes if n.reason in PREEMPTED_REASONS])


def _unclassified(seen: Seen) -> Finding:
    failed = [n for n in seen.failure.nodes if n.state == "failed"] or list(seen.failure.nodes)
    parts = []
    for n in failed:
        last = last_words(n.log_tail)
        parts.append(f"{n.node} exited {n.exit_code}" + (f" ({n.reason})" if n.reason else "")
                     + (f", last line: {_clip(last)}" if last else ""))  # fmt: skip
    return Finding("unclassified: " + ("; ".join(parts) or f"{seen.failure.trigger} with no node status"), [])


# The precedence, top to bottom; the first rule that fires decides (see the module docstring).
RULES: tuple[tuple[FailureKind, Callable[[Seen], Finding | None]], ...] = (
    ("preempted", _left),
    ("diverged", _recorded("diverged")),
    ("data_error", _recorded("data_error")),
    ("oom", _recorded("oom")),
    ("node_lost", _recorded("node_lost")),
    ("user_error", _recorded("user_error")),
    ("oom", _k8s("oom", OOM_REASONS)),
    ("preempted", _preempted_pods),
    ("node_lost", _k8s("node_lost", NODE_LOST_REASONS)),
    ("user_error", _k8s("user_error", CONFIG_REASONS)),
    ("diverged", _log("diverged", "diverged")),
    ("data_error", _log("data_error", "data")),
    ("user_error", _log("user_error", "spec")),
    ("oom", _log("oom", "oom")),
    ("node_lost", _log("node_lost", "hardware")),
    ("user_error", _log("user_error", "user")),
    ("hang", _hang),
    ("node_lost", _peer_killed),
    ("preempted", _terminated),
    ("hang", _log("hang", "nccl_timeout")),
    ("transient", _log("transient", "comm")),
    ("node_lost", _killed),
    ("transient", _unclassified),
)


def classify(failure: Failure) -> Classified:
    """The kind of ``failure``, one line of evidence, and the nodes to blame."""
    seen = gather(failure)
    for kind, rule in RULES:
        found = rule(seen)
        if found is not None:
            return Classified(kind, _clip(found.evidence), found.culprits, _step(kind, seen), found.leaving)
    raise AssertionError("the last rule always fires")  # pragma: no cover


def _step(kind: FailureKind, seen: Seen) -> int | None:
    if kind == "diverged":
        said = [r.message for r in seen.records if r.kind == "diverged"] + [h.line for h in seen.hits["diverged"]]
        m = _AT_STEP.search(said[0]) if said else None
        if m:
            return int(m.group(1))
    return seen.failure.last_step
