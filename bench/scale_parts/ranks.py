"""The orchestrator's side of a large job, simulated: ``n`` ranks writing what the runtime writes, one watch.

Ranks are light: a few writer processes (one per 256 ranks), each stepping its ranks at 4 steps/s
and writing what ``runtime.progress`` writes (each rank's beat every step and pulse each second in
its node's local folder; each node's beat every step and pulse each second on the shared folder), 8
ranks per node: at 1,024 ranks 512 node beats and 128 pulses a second reach the shared folder
(``shared_writes_per_s``; a beat and a pulse per rank before: 4,096 and 1,024).
The watch is the blocking supervisor's own (``recovery.attempt.watch_attempt`` and its
``detect``), over a launcher that reports every node running until told otherwise:

- ``detection_s``: a node's processes exit (the launcher says ``failed``) -> the watch returns it;
- ``hang_over_timeout_s``: every rank stops stepping (a collective stuck on one hung rank, whose
  beat and pulse stop too) -> the watch names the hung rank's node, minus the timeout after the
  step time of the hung rank's last beat;
- ``supervisor_cpu_fraction``: the watch's CPU over its wall time, steady state (goal <= 0.10);
- ``poll_interval_s``: the median wait between polls (it grows with a poll's cost);
- ``ledger_mb_per_hour`` and ``page_s``: one hour of rank 0's step events (4 steps/s, the default
  ``progress_every_s``) and the run page's render from that ledger (``summarize`` + ``run_page``):
  rank 0 alone writes steps, so neither grows with the world size.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.events.ledger import LEDGER_FILE, Ledger
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.heartbeat import (
    NODE_BEAT,
    NODE_PULSE,
    local_folder,
    node_beat,
    publish_pulse,
    read_local_beats,
    write_beat,
    write_node_beat,
)
from trainyard.recovery.attempt import watch_attempt
from trainyard.recovery.look import AttemptView
from trainyard.recovery.observations import AttemptFailed
from trainyard.report import pages
from trainyard.report.summary import run_identity, summarize

PER_NODE = 8
PER_WRITER = 256
STEP_S = 0.25  # 4 steps/s
TIMEOUT_S = 5.0
HUNG_NODE = 3
STEADY_S = 8.0
"""Seconds the watch runs beside stepping ranks before a node exits: its steady state, whose CPU share is measured."""


def _writer(hb: Path, ranks: range, hang_flag: Path, stop_flag: Path) -> None:
    """Step ``ranks`` at 4 steps/s and write what the runtime writes (``runtime.progress``): every rank's beat
    every step and its pulse each second in its node's local folder, and each node's local rank 0 the node's
    beat every step and the node's pulse each second on the shared folder. Once ``hang_flag`` exists no rank
    steps (nor beats), and the hung node's first rank stops its pulse too (so its node's stops)."""
    step, next_step, next_pulse = 0, time.time(), 0.0
    hung = HUNG_NODE * PER_NODE
    local = {node: local_folder(hb / f"node-{node}") for node in {r // PER_NODE for r in ranks}}
    while not stop_flag.exists():
        now = time.time()
        pulse = now >= next_pulse
        if not hang_flag.exists() and now >= next_step:
            step, next_step = step + 1, next_step + STEP_S
            for rank in ranks:
                node = f"node-{rank // PER_NODE}"
                record = {
                    "rank": rank, "node": node, "host": node, "pid": os.getpid(), "step": step,
                    "time": now, "status": "running", "metrics": {"loss": 2.5, "step_ms": STEP_S * 1e3},
                    "attempt": 1, "run_id": "scale",
                }  # fmt: skip
                here = local[rank // PER_NODE]
                write_beat(here, rank % PER_NODE, record)
                if rank % PER_NODE == PER_NODE - 1:  # the node's last rank: its local rank 0 writes now
                    mine = json.loads((here / "rank-0.json").read_text())
                    write_node_beat(hb / node, node_beat(mine, read_local_beats(here, skip=0)))
        if pulse:
            for rank in ranks:
                here = local[rank // PER_NODE]
                if not (hang_flag.exists() and rank == hung):
                    (here / f"rank-{rank % PER_NODE}.alive").touch()
                if rank % PER_NODE == PER_NODE - 1:
                    publish_pulse(hb / f"node-{rank // PER_NODE}" / NODE_PULSE, here)
            next_pulse = now + 1.0
        time.sleep(max(0.0, min(next_step, next_pulse) - time.time()))


class Launcher:
    """Every node running, until ``fail`` names one."""

    def __init__(self, nodes: list[str]):
        self.nodes, self.failed = nodes, ""

    def poll(self, handle: object) -> AttemptStatus:
        return AttemptStatus(
            [NodeStatus(n, "failed" if n == self.failed else "running", 137 if n == self.failed else None)
             for n in self.nodes]
        )  # fmt: skip


def one_world(n: int, root: Path, steady_s: float = STEADY_S) -> dict[str, Any]:
    """``n`` ranks watched for ``steady_s`` (the CPU share's window; shorter in ``--smoke``), then a node's exit, then
    a hang."""
    hb, flags = root / f"hb-{n}", root / f"flags-{n}"
    nodes = [f"node-{i}" for i in range(n // PER_NODE)]
    for node in nodes:
        (hb / node).mkdir(parents=True)
    flags.mkdir()
    hang, stop = flags / "hang", flags / "stop"
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_writer, args=(hb, range(k, min(n, k + PER_WRITER)), hang, stop), daemon=True)
               for k in range(0, n, PER_WRITER)]  # fmt: skip
    for w in writers:
        w.start()
    try:
        time.sleep(2.5)  # every rank beat
        plan = LaunchPlan("scale", 1, nodes, PER_NODE, "train.py", [], TrainEnv(root, root, 10**9), root)
        launcher = Launcher(nodes)
        polls: list[float] = []

        def pause(s: float) -> None:
            polls.append(s)
            time.sleep(s)

        # A node exits steady_s in: the watch's CPU until then is its steady state.
        wall, cpu = time.time(), time.thread_time()
        killer = _after(steady_s, lambda: setattr(launcher, "failed", nodes[-1]))
        seen = watch_attempt(launcher, None, plan, AttemptView.of(plan, time.time(), TIMEOUT_S, hb), pause=pause)
        detection = time.time() - killer.at
        cpu_fraction = (time.thread_time() - cpu) / (time.time() - wall)
        assert isinstance(seen, AttemptFailed) and seen.failure.nodes, seen
        # Every rank stops stepping; the hung node's first rank stops beating and pulsing.
        launcher.failed = ""
        hang.touch()
        last_step = _last_step_time(hb)
        seen = watch_attempt(launcher, None, plan, AttemptView.of(plan, time.time() - 10, TIMEOUT_S, hb))
        hang_over = time.time() - (last_step + TIMEOUT_S)
        assert isinstance(seen, AttemptFailed) and seen.failure.stale_nodes == [f"node-{HUNG_NODE}"], seen.failure
    finally:
        stop.touch()
        for w in writers:
            w.join(5)
    for node in nodes:
        shutil.rmtree(local_folder(hb / node), ignore_errors=True)
    shutil.rmtree(hb, ignore_errors=True)
    return {
        # Files written on the shared volume each second: a node beat per node and step, a pulse per node.
        "shared_writes_per_s": round(len(nodes) * (1 / STEP_S + 1)),
        "ranks": n,
        "detection_s": round(detection, 2),
        "hang_over_timeout_s": round(hang_over, 2),
        "supervisor_cpu_fraction": round(cpu_fraction, 4),
        "poll_interval_s": round(sorted(polls)[len(polls) // 2], 2) if polls else None,
    }


class _after:
    """Call ``act`` ``seconds`` from now on a thread; ``at``: when it did."""

    def __init__(self, seconds: float, act: Any):
        self.at = float("inf")

        def run() -> None:
            time.sleep(seconds)
            act()
            self.at = time.time()

        threading.Thread(target=run, daemon=True).start()


def _last_step_time(hb: Path) -> float:
    """The step time of the hung rank's last beat, once the writers have stopped stepping (a second after the
    flag): what the watch can know of when it stopped."""
    time.sleep(1.5)
    return float(json.loads((hb / f"node-{HUNG_NODE}" / NODE_BEAT).read_text())["time"])


def one_hour_ledger(root: Path) -> dict[str, Any]:
    """Rank 0's step events of one hour at 4 steps/s, and the run page rendered from that ledger."""
    from trainyard import runtime
    from trainyard.runtime import progress

    folder = root / "runs" / "scale" / "hour"
    folder.mkdir(parents=True)
    ledger = Ledger(folder / LEDGER_FILE)
    ledger.append("train", "stage_start")
    steps = int(3600 / STEP_S)
    ctx = runtime.RunContext(data_dir=root, checkpoint_dir=root, max_steps=steps, events_dir=folder / "events.d",
                             checkpoint_every=1000, progress_every_s=30.0)  # fmt: skip
    now = [0.0]
    saved = progress._clock, progress._progress
    progress._clock, progress._progress = (lambda: now[0]), None
    try:
        for step in range(1, steps + 1):
            now[0] += STEP_S
            runtime.heartbeat(step, {"loss": 3.0 - step / steps, "step_ms": STEP_S * 1e3}, ctx=ctx)
        runtime.flush_progress(ctx)
    finally:
        progress._clock, progress._progress = saved
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    started = time.perf_counter()
    html = pages.run_page(summarize(Ledger.in_dir(folder)), run_identity(folder), False)
    page_s = time.perf_counter() - started
    assert "hour" in html
    return {"ledger_mb_per_hour": round(size / 1e6, 3), "page_s": round(page_s, 3)}
