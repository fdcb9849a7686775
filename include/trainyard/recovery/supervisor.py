"""The supervisor: run one training attempt to its end, watching exits and heartbeats.

It tells running, finished, crashed and hung apart: a node whose agent exits
non-zero has crashed; a rank whose heartbeat is older than the timeout (or
that never beat within it) is hung. On any failure it ends every node of the
attempt -- survivors of a dead collective would otherwise wait out gloo's
timeout -- and records what it saw in the ledger.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainyard.errors import TrainingFailed
from trainyard.launch.base import AttemptStatus, LaunchPlan, Launcher
from trainyard.ledger import Ledger

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttemptResult:
    attempt: int
    seconds: float
    last_step: int | None


def read_heartbeats(directory: Path) -> dict[str, dict[str, Any]]:
    beats = {}
    for path in sorted(directory.glob("rank-*.json")):
        try:
            beats[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced between glob and read; the next poll sees it
    return beats


def stale_ranks(beats: dict[str, dict[str, Any]], expected: int, started: float, now: float, timeout_s: float) -> list[str]:
    """Ranks silent for longer than ``timeout_s``; a rank that never beat counts from ``started``."""
    stale = [rank for rank, b in beats.items() if b.get("status") != "finished" and now - b["time"] > timeout_s]
    if len(beats) < expected and now - started > timeout_s:
        stale += [f"rank-{r}" for r in range(expected) if f"rank-{r}" not in beats]
    return stale


def tail(path: str, lines: int = 20) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_attempt(
    launcher: Launcher, plan: LaunchPlan, heartbeat_dir: Path, heartbeat_timeout_s: float, ledger: Ledger, poll_s: float = 0.5
) -> AttemptResult:
    """Launch ``plan`` and block until it succeeds; raise ``TrainingFailed`` when it does not."""
    started = time.time()
    ledger.append("train", "attempt_start", attempt=plan.attempt, nodes=plan.nodes, world_size=plan.world_size)
    handle = launcher.launch(plan)
    try:
        while True:
            status = launcher.poll(handle)
            if status.state == "succeeded":
                break
            if status.state == "failed":
                _fail(plan, status, ledger, kind="crash", reason=_crash_reason(status))
            stale = stale_ranks(read_heartbeats(heartbeat_dir), plan.world_size, started, time.time(), heartbeat_timeout_s)
            if stale:
                _fail(plan, status, ledger, kind="hang", reason=f"no heartbeat for {heartbeat_timeout_s:.0f} s from {', '.join(stale)}")
            time.sleep(poll_s)
    finally:
        launcher.cancel(handle)  # a no-op after success; ends every survivor after a failure
    beats = read_heartbeats(heartbeat_dir)
    last = max((b.get("step", 0) for b in beats.values()), default=None)
    result = AttemptResult(plan.attempt, round(time.time() - started, 3), last)
    ledger.append("train", "attempt_end", attempt=plan.attempt, state="succeeded", seconds=result.seconds, last_step=last)
    return result


def _crash_reason(status: AttemptStatus) -> str:
    return "; ".join(f"{n.node} exited {n.exit_code}" + (f" ({n.reason})" if n.reason else "") for n in status.failed())


def _fail(plan: LaunchPlan, status: AttemptStatus, ledger: Ledger, kind: str, reason: str) -> None:
    evidence = "\n".join(f"--- {n.node} ({n.log})\n{tail(n.log)}" for n in (status.failed() or status.nodes))
    ledger.append("train", "attempt_end", attempt=plan.attempt, state="failed", kind=kind, reason=reason)
    log.error("attempt %d failed (%s): %s\n%s", plan.attempt, kind, reason, evidence)
    raise TrainingFailed(f"attempt {plan.attempt} failed ({kind}): {reason}", kind=kind, evidence=evidence)
