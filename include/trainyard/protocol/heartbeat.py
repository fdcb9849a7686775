"""Heartbeat files: each rank's latest step, time and status, ``rank-<RANK>.json`` in its node's heartbeat folder.

One writer (the runtime, every step) and one reader (the supervisor, the progress line, the
Kubernetes trigger). Files rather than ledger events because the watcher needs the latest state
of every rank cheaply. The writer renames a finished temporary over the final name, so a reader
sees the old beat or the new one, never half. Imports no torch.

Layout: an attempt's heartbeat folder holds one folder per node (``<attempt hb>/<node>/``, named by
``TRAINYARD_NODE``: a local node's slot, a pod's host), and each node's processes are given only
their own (``node_folder``): beats, failure records and pulses (``rank-N.alive``) go there. The
folder, not the file, says which node wrote it: on Kubernetes a pod mounts only its own.

One writer per node (``runtime.progress``): every rank keeps its beat and pulse in a folder on its
own machine (``local_folder``: ``/dev/shm``), and the node's local rank 0 writes the node's beat,
``node.json`` (``write_node_beat``: its own step, and of the node's ranks the oldest time and the
least finished status, so a rank that stopped still shows), at each of its steps, and touches the
node's pulse, ``node.alive``, each second, stamped with the oldest of its ranks' pulses. The shared volume
then sees one write per node and step and one pulse per node and second, not one of each per rank;
the orchestrator reads one file per node. ``scan`` turns a node beat into the beats of the ranks it
lists (each with ``pulse``: the node's pulse file), and still takes ``rank-N.json`` files as written
before (and by tests).

Beats are written by training code, which is untrusted (docs/architecture.md, rule 14): the reader
takes regular files only (``atomic.read_capped``, never a link, FIFO or device), at most
``MAX_BYTES`` each, checks every field the readers use (``parse_beat``) and returns a validated
dict per rank. A file refused is skipped with a warning (at most one per file and reason a minute)
and reported in ``Scan.refused``: a rank whose only beat is garbage counts as one that never beat.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainyard.atomic import loads_untrusted, read_capped

log = logging.getLogger(__name__)

MAX_BYTES = 4096
"""A beat's cap: the runtime's beats are a few hundred bytes; the writer drops metrics that would pass it."""
STATUSES = ("running", "saving", "regrouping", "finished")
"""What the runtime writes (``runtime.progress``, ``runtime.checkpoints``); only "finished" is never stale."""
HOW_TO_BEAT = (
    "call trainyard.runtime.heartbeat(step, metrics) every step on every rank, or train with"
    " trainyard.runtime.hf.TrainyardCallback (Hugging Face Trainer) or trainyard.runtime.lightning.TrainyardCallback"
    " (Lightning)"
)
"""What a script adds to write heartbeats: the words every message about missing beats ends with."""
MAX_NAME = 253  # a DNS name: the longest node or host name
MAX_METRICS = 32
MAX_METRIC_NAME = 64
MAX_INT = 2**53
MAX_ENTRIES = 4096
"""Names looked at per folder and poll: a rank that fills its folder cannot make every poll read it all."""
WARN_EVERY_S = 60.0
_BEAT = re.compile(r"rank-(\d{1,6})\.json\Z")
NODE_BEAT = "node.json"
NODE_PULSE = "node.alive"
MAX_NODE_RANKS = 256
"""Ranks one node beat may list (a node of 8 GPUs lists 8)."""
MAX_RANK = 999_999
_FOLDER = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}\Z")
"""A node folder's name: a node name (``node-1``, a Kubernetes node's DNS name); nothing to quote in a log."""
_warned: dict[tuple[str, str], float] = {}


def beat_name(rank: int) -> str:
    return f"rank-{rank}.json"


def node_folder(directory: Path, node: str) -> Path:
    """The folder of ``node``'s processes in the attempt's heartbeat folder ``directory``.

    ``ValueError`` for a name that is not one plain folder name (a node name is a DNS name)."""
    if not is_node_folder(node):
        raise ValueError(f"node {node[:40]!r} cannot name a heartbeat folder; a node name is a DNS name")
    return directory / node


def is_node_folder(name: str) -> bool:
    return bool(_FOLDER.match(name))


def node_folders(directory: Path) -> list[str]:
    """The node folders in ``directory`` (at most ``MAX_ENTRIES`` names looked at; no links), sorted."""
    try:
        with os.scandir(directory) as entries:
            return sorted(
                e.name
                for _, e in zip(range(MAX_ENTRIES), entries)
                if is_node_folder(e.name) and e.is_dir(follow_symlinks=False)
            )
    except OSError:
        return []


def write_beat(directory: Path, rank: int, record: dict[str, Any]) -> None:
    """This rank's heartbeat; no fsync: a beat means something only while its writer lives, and it beats every step."""
    _write(directory / beat_name(rank), record)


def _write(final: Path, record: dict[str, Any]) -> None:
    if record.get("status") not in STATUSES:
        raise ValueError(f"heartbeat status {record.get('status')!r} is not one of {', '.join(STATUSES)}")
    text = json.dumps(record, default=float)
    if len(text.encode()) > MAX_BYTES:  # a beat past the reader's cap would read as no beat: a hang
        text = json.dumps({**record, "metrics": {}}, default=float)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, final)


def local_folder(shared: Path, make: bool = True) -> Path:
    """This node's own folder for its ranks' beats and pulses (``/dev/shm``, else the temp folder): one per
    node folder ``shared`` of the shared volume, private to the user."""
    key = hashlib.sha256(str(shared.absolute()).encode()).hexdigest()[:24]
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    folder = base / f"trainyard-hb-{os.getuid()}" / key
    if make:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    return folder


def drop_local_folder(shared: Path) -> None:
    """Remove node folder ``shared``'s local folder once its processes ended (the local backend's nodes share
    this machine's ``/dev/shm``; a pod's goes with the pod)."""
    shutil.rmtree(local_folder(shared, make=False), ignore_errors=True)


def node_beat(mine: dict[str, Any], others: list[dict[str, Any]]) -> dict[str, Any]:
    """The node's beat from its local rank 0's own (``mine``, just written) and its other ranks' latest:
    the step is the writer's (exact: a synchronous step ends on every rank), the ranks all of theirs, and
    the time and status those of the oldest rank still at work (a rank that stopped shows as the node's
    staleness), "finished" only when every rank is."""
    beats = [mine, *others]
    working = [b for b in beats if b.get("status") != "finished"]
    oldest = min(working, key=lambda b: b["time"]) if working else mine
    status = mine["status"] if mine.get("status") != "finished" else oldest["status"]
    return {
        **mine,
        "ranks": sorted({int(b["rank"]) for b in beats}),
        "time": oldest["time"] if working else max(b["time"] for b in beats),
        "status": status,
    }


def write_node_beat(directory: Path, record: dict[str, Any]) -> None:
    """The node's beat (``node_beat``) in its node folder ``directory``, replaced whole."""
    _write(directory / NODE_BEAT, record)


def oldest_pulse(folder: Path) -> float | None:
    """The oldest pulse time of the ranks that keep one in the node's local folder (a finished rank removes
    its own); None when none does. The node's pulse carries it (``publish_pulse``)."""
    times = []
    for name in names_in(folder):
        if name.endswith(".alive"):
            with contextlib.suppress(OSError):  # removed meanwhile: finished
                times.append((folder / name).lstat().st_mtime)
    return min(times) if times else None


def publish_pulse(node_pulse: Path, local: Path) -> None:
    """The node's pulse on the shared volume, stamped with its oldest rank's pulse: a rank that stopped stops
    the node's pulse as soon as its own, as the watch reads it (``watch.silent_ranks``)."""
    oldest = oldest_pulse(local)
    if oldest is None:
        return
    if not node_pulse.exists():
        node_pulse.touch()
    os.utime(node_pulse, (oldest, oldest))


def read_local_beats(folder: Path, skip: int) -> list[dict[str, Any]]:
    """The beats the node's other ranks keep in its local folder (``rank-L.json`` by local rank), but ``skip``'s."""
    out = []
    for name in names_in(folder):
        m = _BEAT.match(name)
        if not m or int(m[1]) == skip:
            continue
        try:
            data = read_capped(folder / name, MAX_BYTES)
            out.append(parse_beat(data, int(loads_untrusted(data, "beat")["rank"])))
        except (OSError, ValueError, TypeError, KeyError, OverflowError):  # OverflowError: a rank of 1e400
            continue  # being replaced, or not a beat: the next step reads it again
    return out


# ---------------------------------------------------------------- the orchestrator's side


def parse_beat(data: bytes, rank: int) -> dict[str, Any]:
    """The beat of rank ``rank`` in ``data`` as a validated dict, or ``ValueError`` saying what is wrong.

    Kept: ``rank``, ``step`` (an int >= 0), ``time`` (a finite number), ``status`` (one of ``STATUSES``),
    ``node`` and ``host`` (strings, "" when absent), ``metrics`` (numbers only); nothing else."""
    raw = loads_untrusted(data, "beat")  # ValueError for any bytes that are not a JSON value (nesting included)
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    step: Any = raw.get("step")
    when: Any = raw.get("time")
    status: Any = raw.get("status")
    if not _number(when) or not math.isfinite(when):
        raise ValueError(f"time {str(when)[:40]!r} is not a finite number")
    if not isinstance(step, int) or not _number(step) or step < 0:
        raise ValueError(f"step {str(step)[:40]!r} is not a whole number >= 0")
    if status not in STATUSES:
        raise ValueError(f"status {str(status)[:40]!r} is not one of {', '.join(STATUSES)}")
    if raw.get("rank", rank) != rank or isinstance(raw.get("rank"), bool):
        raise ValueError(f"rank {str(raw.get('rank'))[:20]!r} is not the file's rank {rank}")
    return {
        "rank": rank,
        "step": step,
        "time": float(when),
        "status": status,
        "node": _name(raw, "node"),
        "host": _name(raw, "host"),
        "metrics": _metrics(raw.get("metrics")),
    }


def _number(value: Any) -> bool:
    """A JSON number that is a float or an int a float holds exactly (a huge int would overflow the readers)."""
    if isinstance(value, bool):
        return False
    return isinstance(value, float) or (isinstance(value, int) and abs(value) <= MAX_INT)


def _name(raw: dict[str, Any], key: str) -> str:
    value = raw.get(key, "")
    if not isinstance(value, str) or len(value) > MAX_NAME:
        raise ValueError(f"{key} is not a string of at most {MAX_NAME} characters")
    return value


def _metrics(value: Any) -> dict[str, float | int]:
    """The numbers of a beat's metrics (text never reaches a log line), at most ``MAX_METRICS`` of them."""
    if not isinstance(value, dict):
        return {}
    numbers = {k: v for k, v in value.items() if isinstance(k, str) and len(k) <= MAX_METRIC_NAME and _number(v)}
    return dict(list(numbers.items())[:MAX_METRICS])


@dataclass(frozen=True)
class Scan:
    """What one look at an attempt's heartbeat folder found."""

    beats: dict[str, dict[str, Any]] = field(default_factory=dict)
    """``rank-N`` -> its validated beat, with ``folder``: the node folder it lay in ("" for the folder itself)."""
    refused: dict[str, str] = field(default_factory=dict)
    """``<folder>/rank-N.json`` -> why it was not taken (a link, a FIFO, too large, malformed)."""


Owner = Callable[[int], str | None]
"""Which node folder rank N's beat must come from (None: any), where the orchestrator knows it."""


def scan(directory: Path, owner: Owner | None = None) -> Scan:
    """Every rank's latest valid beat in ``directory`` and its node folders; never raises.

    A rank beating in more than one folder (an in-place regroup renumbers ranks; a node's old beat
    stays) is taken from ``owner``'s folder where that is known, else the newest beat wins."""
    found = Scan()
    for folder, path, rank in _candidates(directory):
        try:
            data = read_capped(path, MAX_BYTES)
            beats = parse_node_beat(data) if rank is None else [parse_beat(data, rank)]
        except FileNotFoundError:
            continue  # replaced between listing and reading; the next poll sees it
        except (OSError, ValueError) as exc:  # UnsafePath, TooLarge, malformed
            _refuse(found, folder, path, short_reason(exc, path))
            continue
        for beat in beats:
            if folder and beat["node"] and beat["node"] != folder:
                _refuse(found, folder, path, f"names node {beat['node'][:40]!r}, not {folder!r} whose folder it is in")
                break
            name = f"rank-{beat['rank']}"
            beat["folder"] = folder
            beat["pulse"] = NODE_PULSE if rank is None else f"{name}.alive"
            if _better(beat, found.beats.get(name), owner(beat["rank"]) if owner else None):
                found.beats[name] = beat
    return found


def parse_node_beat(data: bytes) -> list[dict[str, Any]]:
    """The beats of the ranks a node beat lists, each validated as ``parse_beat`` does one rank's."""
    raw = loads_untrusted(data, "node beat")
    if not isinstance(raw, dict):
        raise ValueError("not a JSON object")
    ranks = raw.get("ranks")
    if (
        not isinstance(ranks, list)
        or not 0 < len(ranks) <= MAX_NODE_RANKS
        or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r <= MAX_RANK for r in ranks)
        or len(set(ranks)) != len(ranks)
    ):
        raise ValueError(f"ranks is not a list of 1 to {MAX_NODE_RANKS} distinct rank numbers")
    one = parse_beat(json.dumps({**raw, "rank": ranks[0]}).encode(), ranks[0])
    return [{**one, "rank": r} for r in ranks]


def _better(beat: dict[str, Any], held: dict[str, Any] | None, owner: str | None) -> bool:
    if held is None:
        return True
    if owner is not None and (beat["folder"] == owner) != (held["folder"] == owner):
        return bool(beat["folder"] == owner)
    return bool(beat["time"] > held["time"])


def _candidates(directory: Path) -> list[tuple[str, Path, int | None]]:
    """(folder, path, rank) of each beat file name in ``directory`` ("") and in its node folders; rank None:
    a node beat (``node.json``)."""
    out: list[tuple[str, Path, int | None]] = []
    for folder, names in [("", names_in(directory)), *_node_folders(directory)]:
        for name in names:
            path = (directory / folder / name) if folder else directory / name
            if m := _BEAT.match(name):
                out.append((folder, path, int(m[1])))
            elif name == NODE_BEAT and folder:
                out.append((folder, path, None))
    return sorted(out, key=lambda c: (c[0], str(c[1])))


def _node_folders(directory: Path) -> list[tuple[str, list[str]]]:
    return [(f, names_in(directory / f)) for f in node_folders(directory)]


def names_in(folder: Path) -> list[str]:
    """Up to ``MAX_ENTRIES`` names in ``folder`` (none if it is missing, not a folder, or a link: a node's
    folder swapped for a link to another must not lend it that folder's files)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        with os.scandir(fd) as entries:
            names = [e.name for _, e in zip(range(MAX_ENTRIES + 1), entries)]
    except OSError:
        return []
    finally:
        os.close(fd)
    if len(names) > MAX_ENTRIES:
        warn_once(str(folder), "entries", "%s holds more than %d names; only %d are read", folder, MAX_ENTRIES,
                  MAX_ENTRIES)  # fmt: skip
    return names[:MAX_ENTRIES]


def short_reason(exc: Exception, path: Path) -> str:
    """What is wrong with the file at ``path``, in a few words for a hang's reason (``a symbolic link``,
    ``not a regular file``, ``larger than 4096 bytes``, the schema's complaint): not the path, nor the fix."""
    text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return str(text).removeprefix(f"{path} is ").split("; ")[0][:200]


def _refuse(found: Scan, folder: str, path: Path, why: str) -> None:
    found.refused[f"{folder}/{path.name}" if folder else path.name] = why
    warn_once(str(path), why[:80], "heartbeat %s skipped: %s", path, why)


def warn_once(key: str, reason: str, message: str, *args: Any) -> None:
    """Log ``message`` at most once per ``WARN_EVERY_S`` for ``(key, reason)``: a bad file seen at every
    poll must not flood the log (and an attacker's many files must not grow this memory without end)."""
    now = time.monotonic()
    if now - _warned.get((key, reason), -math.inf) < WARN_EVERY_S:
        return
    if len(_warned) >= 1024:
        _warned.clear()
    _warned[(key, reason)] = now
    log.warning(message, *args)


def read_heartbeats(directory: Path, owner: Owner | None = None) -> dict[str, dict[str, Any]]:
    """Every rank's latest valid beat by file stem (``rank-N``); see ``scan``."""
    return scan(directory, owner).beats
