"""Classification: what one failed training attempt was, as a failure kind (pure: docs/architecture.md, decisions).

``classify(failure) -> Classified`` is pure: it reads the node statuses and log
tails the supervisor collected and returns a kind (``node_lost``, ``hang``,
``transient``, ``oom``, ``diverged``, ``user_error``, ``data_error``), one line
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
from a cancel) are never root causes either.

Precedence is the order of ``RULES``; the first rule that fires decides:

0. Failure records (``trainyard.protocol.records``): a rank of the training
   runtime that died of an exception said why before it exited. A root cause
   there (diverged, data_error, oom, node_lost, user_error, in that order)
   decides, quoting the record; ``transient`` (a peer vanished) is a symptom
   and leaves it to the rules below. Only records naming a node of the attempt
   count. The log rules below are for scripts that do not use the runtime.
1. Kubernetes reasons (``trainyard.backends.kubernetes.reasons``, the one list): OOMKilled ->
   oom; Evicted/NodeLost/preemption/node shutdown -> node_lost; image pull /
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
4. Connection / collective / rendezvous errors -> transient, unless some node
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
- SIGTERM (exit -15/143) blames no node: in practice it is the attempt being
  torn down (the supervisor's cancel, Kubernetes ending a failed Job's other
  pods), and Kubernetes' own evictions and preemptions carry a reason (rule 1).
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

from trainyard.backends.kubernetes.reasons import CONFIG_REASONS, NODE_LOST_REASONS, OOM_REASONS
from trainyard.protocol.records import FailureRecord
from trainyard.protocol.signs import LOG_PATTERNS
from trainyard.spec.models import FailureKind

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


@dataclass(frozen=True)
class Finding:
    """What one rule found: its evidence and the nodes to blame (``RULES`` says which kind it is)."""

    evidence: str
    culprits: list[str] = field(default_factory=list)


# ---------------------------------------------------------------- what the words mean

_COMPILED = {cat: re.compile("|".join(f"(?:{p})" for p in pats), re.IGNORECASE) for cat, pats in LOG_PATTERNS.items()}
# Categories that name a root cause, in the order their rules are tried (user exceptions come after them).
ROOT_CAUSES = ("diverged", "data", "spec", "oom", "hardware")

SIGKILL_EXITS = frozenset({-9, 137})
# torchrun's wrappers and the ways an attempt is ended from outside: never a root cause.
NOT_ROOT_CAUSES = frozenset({"ChildFailedError", "SignalException", "KeyboardInterrupt", "SystemExit"})

_RANK_PREFIX = re.compile(r"^\[([A-Za-z_]*\d+)\]:\s?")
_EXCEPTION = re.compile(r"^(?P<name>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Failed|Interrupt|Exit))(?::|$)")
_CHAINED = re.compile(r"During handling of the above exception|The above exception was the direct cause")
_AT_STEP = re.compile(r"\bat step (\d+)")
# glog headers of torch's C++ and elastic logs ("E1129 22:05:25.913000 26115 .../api.py:1002] ",
# "[W1129 22:02:17.454685851 TCPStore.cpp:115] "): noise in a one-line evidence.
_LOG_HEADER = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +(?:\d+ )?\S+:\d+\] ")
_WORKER_EXIT = re.compile(r"failed \(exitcode: -?\d+\)")


# ---------------------------------------------------------------- reading the logs


@dataclass(frozen=True)
class Hit:
    node: str
    line: str
    """The matching log line, stripped (a rank prefix kept: it says which rank)."""


@dataclass(frozen=True)
class Seen:
    """Everything the rules look at, gathered once from a ``Failure``."""

    failure: Failure
    hits: dict[str, list[Hit]]
    """Per category (``LOG_PATTERNS`` keys and ``user``), the best line of each node that shows it."""
    killed: dict[str, str]
    """SIGKILLed nodes and how we know (``exit -9``, or the agent's line)."""
    records: list[FailureRecord]
    """The failure records that name a node of the attempt, earliest first."""


def _streams(log: str) -> dict[str, list[tuple[str, str]]]:
    """Lines by rank prefix (``""`` for unprefixed ones): (text without the prefix, line to quote)."""
    streams: dict[str, list[tuple[str, str]]] = {}
    for raw in log.splitlines():
        m = _RANK_PREFIX.match(raw)
        quoted = _LOG_HEADER.sub("", raw.strip())
        streams.setdefault(m.group(1) if m else "", []).append((raw[m.end() :] if m else raw, quoted))
    return streams


def _chains(stream: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    """The exception lines of one stream, grouped into chains of chained tracebacks."""
    chains: list[list[tuple[str, str]]] = []
    joined = False
    for text, raw in stream:
        if _CHAINED.search(text):
            joined = True
        elif _EXCEPTION.match(text):
            if joined and chains:
                chains[-1].append((text, raw))
            else:
                chains.append([(text, raw)])
            joined = False
    return chains


def _raised_by_user_code(chain: list[tuple[str, str]]) -> bool:
    """A chain a worker raised on its own: not a wrapper, not a peer's disappearance, not a known category."""
    name = _EXCEPTION.match(chain[-1][0]).group("name").rsplit(".", 1)[-1]  # type: ignore[union-attr]
    if name in NOT_ROOT_CAUSES:
        return False
    if any(_COMPILED["comm"].search(text) for text, _ in chain):
        return False
    return not any(_COMPILED[cat].search(chain[-1][0]) for cat in ROOT_CAUSES)


Streams = dict[str, list[tuple[str, str]]]


def _best_line(streams: Streams, category: str) -> str | None:
    """The most telling line in ``category``: an exception line, else an unindented one, else any."""
    best: tuple[int, str] | None = None
    for text, raw in (line for stream in streams.values() for line in stream):
        if not _COMPILED[category].search(text):
            continue
        score = 2 if _EXCEPTION.match(text) else 1 if not text[:1].isspace() else 0
        if best is None or score > best[0]:
            best = (score, raw)
    return best[1] if best else None


def _user_exception(streams: Streams) -> str | None:
    for stream in streams.values():
        for chain in _chains(stream):
            if _raised_by_user_code(chain):
                return chain[-1][1]
    return None


def gather(failure: Failure) -> Seen:
    """What the statuses and logs of ``failure`` show, per category, for the rules."""
    # Failed nodes first: when several nodes show the same thing, the one that failed is quoted.
    nodes = sorted((n for n in failure.nodes if n.state != "succeeded"), key=lambda n: n.state != "failed")
    hits: dict[str, list[Hit]] = {cat: [] for cat in (*LOG_PATTERNS, "user")}
    killed: dict[str, str] = {}
    for n in nodes:
        streams = _streams(n.log_tail)
        for cat in LOG_PATTERNS:
            line = _best_line(streams, cat)
            if line is not None:
                hits[cat].append(Hit(n.node, line))
        user = _user_exception(streams)
        if user is not None:
            hits["user"].append(Hit(n.node, user))
        agent_saw = next((h.line for h in hits["sigkill"] if h.node == n.node), None)
        if n.state == "failed" and n.exit_code in SIGKILL_EXITS:
            killed[n.node] = f"exit {n.exit_code}"
        elif agent_saw is not None:
            killed[n.node] = f"worker SIGKILLed ({_clip(agent_saw, 100)})"
    attempt_nodes = {n.node for n in failure.nodes}
    records = sorted((r for r in failure.records if r.node in attempt_nodes), key=lambda r: (r.time, r.rank))
    return Seen(failure, hits, killed, records)


# ---------------------------------------------------------------- the rules


def _clip(text: str, limit: int = MAX_EVIDENCE) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: max(limit - 3, 0)] + "..."


def _quote(hits: list[Hit], room: int = MAX_EVIDENCE) -> str:
    """``node: line (also on ...)``, the line clipped so the whole fits in ``room``."""
    others = sorted({h.node for h in hits[1:]} - {hits[0].node})
    head, tail = f"{hits[0].node}: ", f" (also on {', '.join(others)})" if others else ""
    return head + _clip(hits[0].line, room - len(head) - len(tail)) + tail


def _recorded(kind: FailureKind, blame: bool) -> Callable[[Seen], Finding | None]:
    """The earliest failure record of ``kind``: ``node rank N: Type: message (failure record; also ...)``."""

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


def _k8s(reasons: frozenset[str], blame: bool) -> Callable[[Seen], Finding | None]:
    def rule(seen: Seen) -> Finding | None:
        found = [n for n in seen.failure.nodes if n.reason in reasons]
        if not found:
            return None
        said = "; ".join(f"{n.node}: pod {n.reason}" + (f" (exit {n.exit_code})" if n.exit_code is not None else "")
                         for n in found)  # fmt: skip
        return Finding(said, [n.node for n in found] if blame else [])

    return rule


def _log(category: str, blame: bool) -> Callable[[Seen], Finding | None]:
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


def _unclassified(seen: Seen) -> Finding:
    failed = [n for n in seen.failure.nodes if n.state == "failed"] or list(seen.failure.nodes)
    parts = []
    for n in failed:
        last = _last_words(n.log_tail)
        parts.append(f"{n.node} exited {n.exit_code}" + (f" ({n.reason})" if n.reason else "")
                     + (f", last line: {_clip(last)}" if last else ""))  # fmt: skip
    return Finding("unclassified: " + ("; ".join(parts) or f"{seen.failure.trigger} with no node status"), [])


def _last_words(log: str) -> str:
    """What to quote from a log nothing matched: the agent's word on its worker's exit, else the last real line."""
    lines = [_LOG_HEADER.sub("", line.strip()) for line in log.splitlines() if line.strip(" =-\t")]
    return next((line for line in reversed(lines) if _WORKER_EXIT.search(line)), lines[-1] if lines else "")


# The precedence, top to bottom; the first rule that fires decides (see the module docstring).
RULES: tuple[tuple[FailureKind, Callable[[Seen], Finding | None]], ...] = (
    ("diverged", _recorded("diverged", blame=False)),
    ("data_error", _recorded("data_error", blame=False)),
    ("oom", _recorded("oom", blame=True)),
    ("node_lost", _recorded("node_lost", blame=True)),
    ("user_error", _recorded("user_error", blame=False)),
    ("oom", _k8s(OOM_REASONS, blame=True)),
    ("node_lost", _k8s(NODE_LOST_REASONS, blame=True)),
    ("user_error", _k8s(CONFIG_REASONS, blame=False)),
    ("diverged", _log("diverged", blame=False)),
    ("data_error", _log("data", blame=False)),
    ("user_error", _log("spec", blame=False)),
    ("oom", _log("oom", blame=True)),
    ("node_lost", _log("hardware", blame=True)),
    ("user_error", _log("user", blame=False)),
    ("hang", _hang),
    ("node_lost", _peer_killed),
    ("hang", _log("nccl_timeout", blame=False)),
    ("transient", _log("comm", blame=False)),
    ("node_lost", _killed),
    ("transient", _unclassified),
)


def classify(failure: Failure) -> Classified:
    """The kind of ``failure``, one line of evidence, and the nodes to blame."""
    seen = gather(failure)
    for kind, rule in RULES:
        found = rule(seen)
        if found is not None:
            return Classified(kind, _clip(found.evidence), found.culprits, _step(kind, seen))
    raise AssertionError("the last rule always fires")  # pragma: no cover


def _step(kind: FailureKind, seen: Seen) -> int | None:
    if kind == "diverged":
        said = [r.message for r in seen.records if r.kind == "diverged"] + [h.line for h in seen.hits["diverged"]]
        m = _AT_STEP.search(said[0]) if said else None
        if m:
            return int(m.group(1))
    return seen.failure.last_step
