"""The training contract: the TRAINYARD_* environment of one training process, as one typed value.

The orchestrator builds a ``TrainEnv`` per attempt (``pipeline.train._plan``, carried by ``LaunchPlan``); a
launcher gives each node its own ``node``/``host`` (``for_node``), turns the value into the processes'
environment (``to_env``) and mounts its paths with the access they declare (``paths``); the workload
reads it back (``from_env``, through ``trainyard.runtime.context``). Each variable is declared
once, on its field: its name, what it means, how it is parsed, and (for a path) whether a pod may
write it. ``trainyard.runtime``'s docstring lists them as ``variable_table`` writes them.

Importing this module imports no torch: the launchers and the Airflow layer use it.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import MISSING, Field, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

from trainyard.protocol.live_metrics import otlp_url
from trainyard.protocol.sealing import KEY_PATTERN

Access = Literal["read", "write"]
NODE_VARIABLES = ("TRAINYARD_NODE", "TRAINYARD_HOST")
STORE_BIND_VARIABLE = "TRAINYARD_STORE_BIND"  # a coordinator pod's own IP, where it serves the store (backends.store)
"""Set per node by the launcher (``for_node``), not in the plan: the rest is the same on every node."""
_SEE = "the trainyard launcher sets it (see trainyard.protocol.env)"


@dataclass(frozen=True)
class ContractPath:
    """One path of the contract, with the access a training process needs to it (what a pod mounts)."""

    name: str
    """The variable that names it, e.g. ``TRAINYARD_CHECKPOINT_DIR``."""
    path: Path
    writable: bool
    is_dir: bool


@dataclass(frozen=True)
class FaultDrill:
    """One fault to act out in the workload (``trainyard.runtime.drills``), from the spec's ``drills``."""

    fault: str
    step: int
    node: str | None = None
    """The node that acts it out; None: every node."""
    factor: float = 1.0
    attempt: int = 1


# ---------------------------------------------------------------- parsers: raw text -> value, or ValueError


def _path(name: str, raw: str) -> Path:
    return Path(raw)


def _text(name: str, raw: str) -> str:
    return raw


def _int_from(minimum: int) -> Callable[[str, str], int]:
    def parse(name: str, raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not an integer; set a whole number >= {minimum}") from None
        if value < minimum:
            raise ValueError(f"{name}={value} must be >= {minimum}")
        return value

    return parse


def _float_from(minimum: float) -> Callable[[str, str], float]:
    def parse(name: str, raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r} is not a number; set a number >= {minimum}") from None
        if not math.isfinite(value) or value < minimum:
            raise ValueError(f"{name}={raw} must be a finite number >= {minimum}")
        return value

    return parse


def _store_key(name: str, raw: str) -> str:
    if not KEY_PATTERN.match(raw):  # the value is a secret: the message never quotes it
        raise ValueError(f"{name} must be this node's key, 64 hex digits; {_SEE}")
    return raw


def _flag(name: str, raw: str) -> bool:
    if raw.lower() not in ("0", "1", "true", "false"):
        raise ValueError(f"{name}={raw!r} must be 1 or 0")
    return raw.lower() in ("1", "true")


_DRILL_TYPES: dict[str, tuple[type, ...]] = {
    "fault": (str,),
    "step": (int,),
    "node": (str, type(None)),
    "factor": (int, float),
    "attempt": (int,),
}


def _drills(name: str, raw: str) -> tuple[FaultDrill, ...]:
    """A JSON list of drill objects (``FaultDrill`` fields), as ``to_env`` writes it."""
    try:
        items = json.loads(raw)
    except ValueError:
        raise ValueError(f"{name} is not JSON; it is a list of drills, as {_SEE}") from None
    if not isinstance(items, list):
        raise ValueError(f"{name} must be a JSON list of drills, not {type(items).__name__}")
    drills: list[FaultDrill] = []
    for i, item in enumerate(items):
        where = f"{name}: drill {i}"
        if not isinstance(item, dict) or not isinstance(item.get("fault"), str) or "step" not in item:
            raise ValueError(f"{where} must be an object with a 'fault' and a 'step'")
        for key, value in item.items():
            allowed = _DRILL_TYPES.get(key)
            if allowed is None:
                raise ValueError(f"{where}: unknown field {key!r} (known: {', '.join(_DRILL_TYPES)})")
            if isinstance(value, bool) or not isinstance(value, allowed):
                raise ValueError(f"{where}: {key!r} must be {' or '.join(t.__name__ for t in allowed)}")
        drills.append(FaultDrill(**item))
    return tuple(drills)


def _meta(name: str, doc: str, parse: Callable[[str, str], Any], access: Access | None = None) -> dict[str, Any]:
    """A field's variable, its line in the table, its parser and (for a path) the access a pod needs."""
    return {"env": name, "doc": doc, "parse": parse, "access": access}


@dataclass(frozen=True)
class TrainEnv:
    """The TRAINYARD_* environment of one training process, parsed and checked."""

    data_dir: Path = field(
        metadata=_meta("TRAINYARD_DATA_DIR", "directory of *.tok shards (the hot tier); required", _path, "read")
    )
    checkpoint_dir: Path = field(
        metadata=_meta(
            "TRAINYARD_CHECKPOINT_DIR",
            "checkpoint root (step_NNNNNN/ below it); shared by all ranks; required",
            _path,
            "write",
        )
    )
    max_steps: int = field(
        metadata=_meta("TRAINYARD_MAX_STEPS", "last step to train (steps are numbered from 1); required", _int_from(1))
    )
    resume_from: str = field(
        default="",
        metadata=_meta(
            "TRAINYARD_RESUME_FROM",
            '"" or "none": fresh; "latest": newest valid checkpoint under the checkpoint dir (fresh if none);'
            " else a checkpoint dir (mounted read-only)",
            _text,
        ),
    )
    heartbeat_dir: Path | None = field(
        default=None,
        metadata=_meta(
            "TRAINYARD_HEARTBEAT_DIR",
            "the node's folder: its beat (node.json) and pulse (node.alive), written by its local rank 0, and"
            " each rank's failure record, failure-rank-<RANK>.json (unset: none written)",
            _path,
            "write",
        ),
    )
    events_dir: Path | None = field(
        default=None,
        metadata=_meta(
            "TRAINYARD_EVENTS_DIR",
            "the run's events.d/: each writing process appends to a file of its own there (unset: no events)",
            _path,
            "write",
        ),
    )
    run_id: str = field(default="local", metadata=_meta("TRAINYARD_RUN_ID", 'default "local"', _text))
    pipeline: str = field(
        default="", metadata=_meta("TRAINYARD_PIPELINE", "the pipeline (the DAG id) the run belongs to", _text)
    )
    node: str = field(
        default="",
        metadata=_meta(
            "TRAINYARD_NODE", 'the node\'s name in the plan, e.g. "node-1"; set per node (default: host name)', _text
        ),
    )
    host: str = field(
        default="",
        metadata=_meta(
            "TRAINYARD_HOST",
            "the machine the node runs on (Kubernetes: the pod's spec.nodeName); set per node (default: host name)",
            _text,
        ),
    )
    attempt: int = field(default=1, metadata=_meta("TRAINYARD_ATTEMPT", "attempt number, default 1", _int_from(0)))
    global_batch: int = field(
        default=32,
        metadata=_meta(
            "TRAINYARD_GLOBAL_BATCH", "sequences per optimizer step over all ranks, default 32", _int_from(1)
        ),
    )
    micro_batch: int | None = field(
        default=None,
        metadata=_meta(
            "TRAINYARD_MICRO_BATCH", "sequences per forward pass (unset: global / world, no accumulation)", _int_from(1)
        ),
    )
    checkpoint_every: int = field(
        default=50,
        metadata=_meta(
            "TRAINYARD_CHECKPOINT_EVERY", "steps between checkpoints, default 50 (0: only the last step)", _int_from(0)
        ),
    )
    checkpoint_async: bool = field(
        default=False,
        metadata=_meta(
            "TRAINYARD_CHECKPOINT_ASYNC", "1: ``Checkpointer`` writes checkpoints in the background (default 0)", _flag
        ),
    )
    seed: int = field(default=0, metadata=_meta("TRAINYARD_SEED", "default 0", _int_from(0)))
    progress_every_s: float = field(
        default=30.0,
        metadata=_meta(
            "TRAINYARD_PROGRESS_EVERY_S",
            "seconds between ledger ``step`` events, default 30 (0: one per step); see ``trainyard.protocol.steps``",
            _float_from(0.0),
        ),
    )
    drills: tuple[FaultDrill, ...] = field(
        default=(),
        metadata=_meta(
            "TRAINYARD_DRILLS",
            "JSON list of fault drills to act out (``trainyard.runtime.drills``); unset: none",
            _drills,
        ),
    )

    store: str | None = field(
        default=None,
        metadata=_meta(
            "TRAINYARD_STORE",
            "host:port of the supervisor's coordination store: the run recovers in place (``trainyard.runtime.elastic``); "
            "unset: torchrun's process group, as before",
            _text,
        ),
    )
    store_key: str | None = field(
        default=None,
        repr=False,  # a secret: never in a log line or an error that prints the contract
        metadata=_meta(
            "TRAINYARD_STORE_KEY",
            "with TRAINYARD_STORE: this node's key (64 hex digits) that seals what it writes there and opens what "
            "the supervisor sealed for it; set per node, never on a command line",
            _store_key,
        ),
    )
    collective_timeout_s: float | None = field(
        default=None,
        metadata=_meta(
            "TRAINYARD_COLLECTIVE_TIMEOUT_S",
            "with TRAINYARD_STORE: seconds a collective may wait for a silent peer before the node regroups "
            "(default 10)",
            _float_from(0.1),
        ),
    )

    snapshot_dir: Path | None = field(
        default=None,
        metadata=_meta(
            "TRAINYARD_SNAPSHOT_DIR",
            "the run's in-memory snapshot tier (node-local shared memory): each node keeps the training state of"
            " recent steps in <dir>/<node>/ for a relaunch of the same run (``trainyard.runtime.snapshots``);"
            " unset: no snapshots",
            _path,
        ),
    )
    snapshot_every: int = field(
        default=1,
        metadata=_meta(
            "TRAINYARD_SNAPSHOT_EVERY",
            "with TRAINYARD_SNAPSHOT_DIR: steps between snapshots, default 1 (0: none)",
            _int_from(0),
        ),
    )
    metrics_otlp: str | None = field(
        default=None,
        metadata=_meta(
            "TRAINYARD_METRICS_OTLP",
            "the OTLP/HTTP URL rank 0 pushes live training metrics to, once per progress interval "
            "(``trainyard.protocol.live_metrics``); unset: none",
            otlp_url,
        ),
    )

    # ------------------------------------------------------------ what the workload asks of it

    def should_checkpoint(self, step: int) -> bool:
        """Checkpoint every ``checkpoint_every`` steps and always at the last step."""
        every = self.checkpoint_every
        return step == self.max_steps or (every > 0 and step % every == 0)

    def writer_name(self, rank: int) -> str:
        """The name of a process's own event file in ``events_dir`` (``attempt-3.node-1.rank-0``)."""
        return f"attempt-{self.attempt}.{self.node or 'node'}.rank-{rank}"

    @property
    def resume_path(self) -> Path | None:
        """The checkpoint ``resume_from`` names by path; None for a fresh start or ``latest``."""
        return None if self.resume_from.strip().lower() in ("", "none", "latest") else Path(self.resume_from)

    # ------------------------------------------------------------ what a launcher asks of it

    def for_node(self, node: str, host: str | None = None, store_key: str | None = None) -> TrainEnv:
        """This contract as one node sees it; ``host`` defaults to ``node`` (a local node is its own host);
        ``store_key``: the node's own key to the coordination store (the plan's ``store_keys``)."""
        return replace(self, node=node, host=host if host is not None else node, store_key=store_key)

    def paths(self) -> list[ContractPath]:
        """Every path of the contract a training process uses, with the access it needs (all folders)."""
        out = [
            ContractPath(f.metadata["env"], Path(value), f.metadata["access"] == "write", True)
            for f in fields(self)
            if f.metadata["access"] is not None and (value := getattr(self, f.name)) is not None
        ]
        if (resume := self.resume_path) is not None:
            out.append(ContractPath("TRAINYARD_RESUME_FROM", resume, False, True))
        return out

    def to_env(self) -> dict[str, str]:
        """The variables, as text (an unset value is left out: the workload reads it as its default)."""
        env = {}
        for f in fields(self):
            text = _format(getattr(self, f.name))
            if text:
                env[f.metadata["env"]] = text
        return env

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> TrainEnv:
        """Parse the variables of ``env``; ``ValueError`` names the one missing or malformed and the fix."""
        values = {}
        for f in fields(cls):
            name = f.metadata["env"]
            raw = env.get(name, "").strip()
            if raw:
                values[f.name] = f.metadata["parse"](name, raw)
            elif f.default is MISSING:
                raise ValueError(f"{name} is not set; {_SEE}")
        if values.get("store") and not values.get("store_key"):  # nothing it wrote would be believed
            raise ValueError(f"TRAINYARD_STORE is set but TRAINYARD_STORE_KEY is not; {_SEE}")
        return cls(**values)


def _format(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, tuple):  # the drills
        return json.dumps([asdict(d) for d in value]) if value else ""
    return str(value)


def variables() -> list[Field[Any]]:
    """The contract's fields in order; ``f.metadata["env"]`` and ``["doc"]`` say what each is."""
    return list(fields(TrainEnv))


def variable_table(indent: int = 4, width: int = 112) -> str:
    """The variables and what they mean, one block per variable (``trainyard.runtime``'s docstring)."""
    column = indent + 28
    lines = []
    for f in variables():
        head = f"{' ' * indent}{f.metadata['env']:<27} "
        lines += textwrap.wrap(f.metadata["doc"], width, initial_indent=head, subsequent_indent=" " * column)
    return "\n".join(lines)
