"""A synthetic ledger of a long training run, written through the runtime's own writer with a fake clock.

Used by tests/unit/test_progress.py (sizes, exactness) and bench/view.py (time to render its page).
The steps go through ``runtime.heartbeat`` exactly as the reference loop reports them, so
the ledger is as big as the runtime would make it: drop the rate bound and it grows a
hundredfold. One fault part-way: attempt 1 dies after ``fault_at``, attempt 2 resumes
from the checkpoint before it and trains those steps again.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from trainyard import runtime
from trainyard.events.ledger import LEDGER_FILE, Ledger, run_dir
from trainyard.runtime import process, progress

STEPS = 1_000_000
STEP_S = 0.1  # a small model on one GPU; a slower step makes fewer events
CHECKPOINT_EVERY = 1000


def loss_at(step: int) -> float:
    """A deterministic, noisy, decreasing loss: the test knows the exact value at every step."""
    return 2.0 + 8.0 / math.sqrt(step) + 0.05 * math.sin(step * 0.37)


@contextmanager
def fake_clock() -> Iterator[list[float]]:
    """Give the runtime's progress digest a clock the caller advances; restore the real one after."""
    now = [0.0]
    saved = progress._clock, progress._progress
    progress._clock, progress._progress = (lambda: now[0]), None
    try:
        yield now
    finally:
        progress._clock, progress._progress = saved


def _attempt(ctx: runtime.RunContext, ledger: Ledger, now: list[float], first: int, last: int) -> None:
    ledger.append(
        "train",
        "attempt_start",
        attempt=ctx.attempt,
        nodes=["node-0", "node-1"],
        world_size=2,
        micro_batch=4,
        resume_from="latest",
    )
    if first > 1:
        process.ledger_event(
            ctx,
            "resumed",
            step=first - 1,
            path=f"/ck/step_{first - 1:06d}",
            from_world_size=2,
            from_global_batch=32,
            seconds=1.0,
        )
    for step in range(first, last + 1):
        now[0] += STEP_S
        runtime.heartbeat(
            step, {"loss": loss_at(step), "lr": 1e-3, "step_ms": STEP_S * 1e3, "tokens_per_s": 20480.0}, ctx=ctx
        )
        if ctx.should_checkpoint(step):
            path = f"/ck/step_{step:06d}"
            runtime.flush_progress(ctx)  # as Checkpointer.save does before saving
            process.ledger_event(ctx, "checkpoint_saved", step=step, path=path, seconds=2.0, blocked_s=0.1)
            ledger.append("train", "checkpoint_validated", path=path, step=step, valid=True, problems=[], seconds=1.5)
            ledger.append("train", "checkpoint_promoted", path=path, step=step)
            if step > 3 * CHECKPOINT_EVERY:
                ledger.append(
                    "train",
                    "checkpoint_retired",
                    path=f"/ck/step_{step - 3 * CHECKPOINT_EVERY:06d}",
                    step=step - 3 * CHECKPOINT_EVERY,
                )


def write_long_run(root: Path, steps: int = STEPS, progress_every_s: float = 30.0,
                   dag_id: str = "nightly", run_id: str = "long") -> Path:  # fmt: skip
    """Write the run folder of a ``steps``-step run under ``root``; return the folder."""
    folder = run_dir(root, dag_id, run_id)
    folder.mkdir(parents=True)
    ledger = Ledger(folder / LEDGER_FILE)
    ledger.append("train", "stage_start")
    fault_at = steps * 2 // 5 + CHECKPOINT_EVERY // 2
    resumed = fault_at // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # the last checkpoint before the fault
    with fake_clock() as now:
        for attempt, (first, last) in enumerate([(1, fault_at), (resumed + 1, steps)], 1):
            ctx = runtime.RunContext(
                data_dir=root,
                checkpoint_dir=root,
                max_steps=steps,
                events_dir=ledger.events_dir,
                run_id=run_id,
                node="node-0",
                attempt=attempt,
                checkpoint_every=CHECKPOINT_EVERY,
                progress_every_s=progress_every_s,
            )
            _attempt(ctx, ledger, now, first, last)
            if attempt == 1:
                runtime.flush_progress(ctx)  # the process exits (atexit) before the supervisor sees it
                ledger.append(
                    "train",
                    "attempt_end",
                    attempt=1,
                    state="failed",
                    trigger="crash",
                    reason="node-1 exited -9",
                    last_step=fault_at,
                )
                ledger.append(
                    "train",
                    "failure_classified",
                    attempt=1,
                    kind="node_lost",
                    evidence="node-1 exit -9",
                    culprits=["node-1"],
                    detected_at=0,
                )
                ledger.append(
                    "train",
                    "decision",
                    attempt=1,
                    kind="node_lost",
                    action="retry",
                    nodes=["node-0", "node-1"],
                    reason="retry on the same nodes",
                    delay_s=0,
                )
        runtime.finish(steps, {"loss": loss_at(steps)}, ctx=ctx)
    ledger.append("train", "attempt_end", attempt=2, state="succeeded", seconds=now[0], last_step=steps)
    ledger.append(
        "train",
        "stage_end",
        seconds=now[0] + 60,
        result={"nodes": ["node-0", "node-1"], "checkpoint": f"/ck/step_{steps:06d}"},
    )
    return folder
