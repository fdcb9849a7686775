"""Failure records: a rank's own word on why it died, written by the runtime and read by the supervisor.

A rank of the training runtime that dies of an exception writes
``<heartbeat dir>/failure-rank-<N>.json`` (atomically) before it exits (its heartbeat dir is its
node's folder of the attempt's, ``<attempt hb>/<node>/``)::

    {"kind", "rank", "node", "host", "type", "message", "time"}

``kind`` is the runtime's reading of its exception (``reading``): by type first
(trainyard's own errors, ``MemoryError`` and torch's ``OutOfMemoryError``,
``torch.distributed``'s ``Dist*Error``), then by the words ``classify`` knows
from logs. A rank that failed because a peer vanished says ``transient``: it
is a symptom, and ``classify`` lets the other evidence (a SIGKILLed peer, a
Kubernetes reason) decide. Any other kind is a root cause ``classify`` takes
before any log line.

The file is written by training code, which is untrusted (docs/architecture.md, rule 11):
``failure_records`` reads only regular files (never a link or FIFO), at most
``MAX_BYTES`` each, takes only known kinds and a rank matching the file name,
truncates every string, and takes a record only from the folder of the node it names, for the
nodes the orchestrator says ran the attempt: a rank cannot blame another node (on Kubernetes each pod
mounts only its own folder; locally the folder is its writer's slot).

Importing this module imports neither torch nor the spec: the runtime uses it.
"""

from __future__ import annotations

import logging
import math
import re
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainyard.atomic import loads_untrusted, read_capped, write_json_atomic
from trainyard.errors import CheckpointInvalid, DataError, SpecError, TrainingFailed, TransientError
from trainyard.kinds import KINDS as KINDS
from trainyard.protocol.heartbeat import is_node_folder, names_in, node_folder, short_reason
from trainyard.protocol.signs import LOG_PATTERNS

log = logging.getLogger(__name__)

# ``KINDS`` (re-exported from ``trainyard.kinds``) is what a record may say. No rule of ``classify`` takes
# ``preempted`` from a record: notice is read from the store or an exit by SIGTERM, never a rank's word.
MAX_BYTES = 16 * 1024
MAX_MESSAGE = 2000
MAX_NAME = 253  # a DNS name: the longest node or host name
_NAME = re.compile(r"failure-rank-(\d{1,6})\.json\Z")
_DIST_ERRORS = {"DistError", "DistNetworkError", "DistBackendError", "DistStoreError", "DistQueueEmptyError"}
# What the runtime's words mean in classify's log categories (``signs.LOG_PATTERNS``), in this order.
_CATEGORY_KINDS = (
    ("diverged", "diverged"),
    ("data", "data_error"),
    ("spec", "user_error"),
    ("oom", "oom"),
    ("hardware", "node_lost"),
    ("comm", "transient"),
)


@dataclass(frozen=True)
class FailureRecord:
    kind: str
    rank: int
    node: str
    """The node as the plan names it (``TRAINYARD_NODE``)."""
    host: str
    """Where it ran (``TRAINYARD_HOST``)."""
    type: str
    """The exception's class name."""
    message: str
    time: float


def record_name(rank: int) -> str:
    return f"failure-rank-{rank}.json"


# ---------------------------------------------------------------- the runtime's side


def reading(exc: BaseException) -> str:
    """The failure kind ``exc`` shows, as the rank that raised it sees it (one of ``KINDS``)."""
    chain = _chain(exc)
    for link in chain:
        names = {cls.__name__ for cls in type(link).__mro__}
        if isinstance(link, TrainingFailed) and link.kind in KINDS:
            return link.kind
        if isinstance(link, DataError):
            return "data_error"
        if isinstance(link, (SpecError, CheckpointInvalid)):
            return "user_error"
        if isinstance(link, MemoryError) or "OutOfMemoryError" in names:
            return "oom"
        if isinstance(link, TransientError) or names & _DIST_ERRORS:
            return "transient"
    text = "\n".join(f"{type(link).__name__}: {link}" for link in chain)
    for category, kind in _CATEGORY_KINDS:
        if any(re.search(pattern, text, re.IGNORECASE) for pattern in LOG_PATTERNS.get(category, ())):
            return kind
    return "user_error"


def _chain(exc: BaseException, limit: int = 8) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from or while handling (a DCP or gloo error wraps the cause)."""
    chain: list[BaseException] = []
    link: BaseException | None = exc
    while link is not None and link not in chain and len(chain) < limit:
        chain.append(link)
        link = link.__cause__ or link.__context__
    return chain


def failure_record(exc: BaseException, rank: int, node: str, host: str) -> FailureRecord:
    return FailureRecord(
        kind=reading(exc),
        rank=rank,
        node=node[:MAX_NAME],
        host=host[:MAX_NAME],
        type=type(exc).__name__[:MAX_NAME],
        message=str(exc)[:MAX_MESSAGE],
        time=time.time(),
    )


def write_record(heartbeat_dir: Path, record: FailureRecord) -> Path:
    """Write ``record`` whole (a temporary file renamed into place), replacing a planted link, not following it."""
    path = heartbeat_dir / record_name(record.rank)
    write_json_atomic(path, asdict(record))
    return path


# ---------------------------------------------------------------- the orchestrator's side


def failure_records(
    heartbeat_dir: Path, nodes: Collection[str], refused: list[str] | None = None
) -> list[FailureRecord]:
    """The failure records of an attempt's ranks on ``nodes``, earliest first; a bad one is skipped with a warning.

    Each node's records are read from its own folder (``heartbeat.node_folder``) and must name that node:
    a rank may blame no node but its own. ``refused`` collects a line per record skipped (evidence)."""
    records = []
    for node in sorted(n for n in set(nodes) if is_node_folder(n)):
        folder = node_folder(heartbeat_dir, node)
        for name in sorted(n for n in names_in(folder) if _NAME.match(n)):
            try:
                records.append(_own_record(folder / name, node))
            except FileNotFoundError:
                continue  # replaced between listing and reading
            except (OSError, ValueError) as exc:  # UnsafePath, TooLarge, malformed, another node's
                log.warning("failure record %s skipped: %s", folder / name, exc)
                if refused is not None:
                    refused.append(f"{node}/{name} refused ({short_reason(exc, folder / name)})")
    return sorted(records, key=lambda r: (r.time, r.rank))


def _own_record(path: Path, node: str) -> FailureRecord:
    """The record at ``path`` in ``node``'s folder, if it is one and names ``node``; else ``ValueError``/``OSError``."""
    record = parse_record(read_capped(path, MAX_BYTES), int(_NAME.match(path.name).group(1)))  # type: ignore[union-attr]
    if record.node != node:
        raise ValueError(f"names node {record.node[:40]!r} but lies in {node}'s folder: a rank blames only its own")
    return record


def parse_record(data: bytes, rank: int) -> FailureRecord:
    """The record of rank ``rank`` in ``data``, or ``ValueError`` saying what is wrong with it."""
    raw = loads_untrusted(data, "failure record")  # ValueError for any bytes that are not a JSON value
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    kind, when = raw.get("kind"), raw.get("time")
    if kind not in KINDS:
        raise ValueError(f"kind {str(kind)[:40]!r} is not one of {', '.join(KINDS)}")
    if raw.get("rank") != rank or isinstance(raw.get("rank"), bool):
        raise ValueError(f"rank {str(raw.get('rank'))[:20]!r} is not the file's rank {rank}")
    # An int past what a float holds would raise OverflowError in isfinite, out of the supervisor.
    if not isinstance(when, (int, float)) or isinstance(when, bool) or abs(when) > 2**53 or not math.isfinite(when):
        raise ValueError("time is not a number")
    return FailureRecord(
        kind=kind,
        rank=rank,
        node=_text(raw, "node", MAX_NAME),
        host=_text(raw, "host", MAX_NAME),
        type=_text(raw, "type", MAX_NAME),
        message=_text(raw, "message", MAX_MESSAGE),
        time=float(when),
    )


def _text(raw: dict[str, Any], key: str, limit: int) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{key} is not a string")
    return value[:limit]
