"""One trainyard train stage of the recovery bench, and the pure sizing of its step counts.

``trainyard_run`` runs the train stage in this process on local nodes (the spec template ``SPEC``); the
fault is a drill the workload acts out (``fault``/``node``/``at``), or, for a script that acts out no
drills (``examples/byo_train.py``), a signal sent by hand (``by_hand``): the bench records the fault's
time as the drill's ``drill_fired`` would, then signals the node's process, so the figures
(``trainyard.recovery.figures.figures_from``, over the one fold) count from the same moment either way.
"""

from __future__ import annotations

import json
import math
import signal
import statistics
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from peers.versus import no_fault_step_ms

from trainyard.backends.local.launcher import LocalLauncher, process_tree, signal_all
from trainyard.events.fold import TrainRun, fold
from trainyard.pipeline import stages
from trainyard.pipeline.run import Run, open_run
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.figures import figures_from

CALIBRATION_STEPS = 40
# A model big enough that a step costs ~0.25-0.5 s on 2 cores: training time, not start-up, dominates.
MODEL = {"seq-len": 128, "d-model": 256, "n-layers": 4, "n-heads": 4, "lr": 0.003, "vocab-size": 256}
ARGS = [a for k, v in MODEL.items() if k != "vocab-size" for a in (f"--{k}", str(v))]
"""The same model as flags, for torchrun and the peers (vocab-size is the workload's default, 256)."""
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes: {{count: 3, min: 2, spare: {spare}, procs_per_node: {procs}}}
pressure_test: {{enabled: false}}
training:
{entrypoint}  args: {args}
  max_steps: {steps}
  global_batch: {batch}
  micro_batch: 2
  checkpoint_every: {every}
  checkpoint_async: {background}
  heartbeat_timeout_s: {hb}
  progress_every_s: 0  # a step event per step, as the torchrun baseline gets: same ETTR definition on both
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"{expect}}}
recovery: {{max_attempts: 3, backoff_s: 0, in_place: {in_place}, snapshot_every: {snapshot_every}}}
drills: [{drills}]
"""


@dataclass(frozen=True)
class Workload:
    """What trains: the entrypoint (None: the reference workload), its arguments, ranks per node, batch."""

    args: Mapping[str, Any] = field(default_factory=lambda: dict(MODEL))
    entrypoint: str | None = None
    procs: int = 1
    global_batch: int = 12
    spike_check: bool = True  # off for a script whose loss is noise near 0 (byo's): a "spike" there is no fault


DEFAULT = Workload()


@dataclass(frozen=True)
class ByHand:
    """A fault sent by the bench, not acted out by the workload: ``signal`` to ``node``'s process once its
    ranks' heartbeats reach ``step`` (SIGKILL: its whole process tree, as a lost host; SIGTERM: the process
    alone, as the kubelet gives notice to a container's first process)."""

    node: str
    step: int
    signal: signal.Signals
    fault: str  # what the drill_fired event calls it: kill or preempt


def trainyard_run(root: Path, steps: int, at: int | list[int], fault: str, node: str | list[str], hb: float,
                  every: int, background: bool, in_place: bool = True, spares: int = 0,
                  workload: Workload = DEFAULT, by_hand: ByHand | None = None, snapshot_every: int = 1) -> dict:  # fmt: skip
    """One train stage; ``at``/``node``: a fault's step and node, or lists of them (a fault at each);
    ``snapshot_every``: ``recovery.snapshot_every`` (0: no in-memory snapshots, the relaunch path before them)."""
    write_synthetic_corpus(root / "cold", shards=2, tokens_per_shard=16_384)
    steps_at, nodes_at = (at, node) if isinstance(at, list) else ([at], [node])  # [] and []: no fault
    drills = ", ".join(f"{{fault: {fault}, node: {n}, step: {a}}}" for a, n in zip(steps_at, nodes_at, strict=True))
    spec = root / "bench.yaml"
    spec.write_text(
        SPEC.format(
            root=root,
            steps=steps,
            drills=drills,
            spare=spares,
            procs=workload.procs,
            batch=workload.global_batch,
            entrypoint=f"  entrypoint: {workload.entrypoint}\n" if workload.entrypoint else "",
            args=json.dumps(dict(workload.args)),  # JSON is YAML: a flow mapping
            expect="" if workload.spike_check else ", expectations: {max_spike_ratio: null}",
            hb=hb,
            every=every,
            background=str(background).lower(),
            in_place=str(in_place).lower(),
            snapshot_every=snapshot_every,
        )
    )
    run = open_run(spec, "bench", f"{fault}-{time.time_ns()}", "2026-11-28")
    stages.stage_dataset(run)
    launcher = LocalLauncher()
    ended = threading.Event()  # a fault not yet sent when the stage ends is never sent
    sender = _send_when(run, launcher, by_hand, ended) if by_hand else None
    try:
        stages.train(run, ["node-0", "node-1", "node-2"], launcher=launcher,
                     spares=[f"node-{3 + i}" for i in range(spares)])  # fmt: skip
    finally:
        ended.set()
    if sender is not None:
        sender.join(timeout=5)
    return run_figures(run)


def run_figures(run: Run) -> dict[str, Any]:
    """The figures of a finished train stage, with its wall time, save cost, step time and start-up.

    A script's step events carry no step time (``runtime.heartbeat`` has none to give): there the step
    times are the gaps between its consecutive step events (``timed_steps``), so its ETTR is computed
    by the same definition, and ``step_ms_from`` says so."""
    state = fold(run.ledger.events("train"))
    timed = any("step_ms" in e or "step_ms_mean" in e for e in state.train.steps)
    if not timed:
        state = replace(state, train=replace(state.train, steps=tuple(timed_steps(list(state.train.steps)))))
    figures = figures_from(state)
    wall = state.stages["train"]["seconds"]
    blocked = [r.blocked_s for r in state.checkpoints if r.blocked_s is not None]
    start, steps = state.train.stage_start, state.train.steps
    first = steps[0]["ts"] if steps else None
    return {
        **figures,
        "wall_s": wall,
        "save_blocked_s": round(sum(blocked) / len(blocked), 3) if blocked else None,
        "step_ms": _rounded(no_fault_step_ms(state.train)),
        "wall_step_ms": _rounded(wall_step_ms(state.train)),
        "startup_s": round(first - start, 3) if start is not None and first is not None else None,
        "step_ms_from": "events" if timed else "gaps between step events",
        "path": [f["path"] for f in figures["failures"]],
        "checkpoint_root": str(run.checkpoint_root),
    }


def wall_step_ms(train: TrainRun) -> float | None:
    """The median wall time (ms) from one step event to its writer's next, before the first fault: a step with
    all that happens between steps (the snapshot's copy, which the workload's own ``step_ms`` leaves out)."""
    fault = train.fired[0].at if train.fired else math.inf
    bare = [
        {k: v for k, v in e.items() if k not in ("step_ms", "step_ms_mean")} for e in train.steps if e["ts"] < fault
    ]
    gaps = [e["step_ms"] for e in timed_steps(bare) if "step_ms" in e]
    return statistics.median(gaps) if gaps else None


def timed_steps(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` with a ``step_ms`` on each step event that lacks one and follows its writer's event of the
    step before in the same attempt: the time between the two (the first of each stretch gets none)."""
    out, last = [], {}
    for e in events:
        if e["event"] != "step" or "step_ms" in e or "step_ms_mean" in e:
            out.append(e)
            continue
        key = (e.get("node"), e.get("attempt"))
        prev, last[key] = last.get(key), e
        follows = prev is not None and int(e["step"]) == int(prev["step"]) + 1
        out.append({**e, "step_ms": round((e["ts"] - prev["ts"]) * 1000, 3)} if follows and prev else e)
    return out


def _send_when(run: Run, launcher: LocalLauncher, hand: ByHand, ended: threading.Event) -> threading.Thread:
    """A thread that records the fault and signals ``hand.node`` once attempt 1's heartbeats reach ``hand.step``
    (or gives up when ``ended`` is set)."""

    def reached() -> int:
        beats = read_heartbeats(run.dir / "attempt-1" / "heartbeat")
        return max((int(b.get("step") or 0) for b in beats.values()), default=0)

    def send() -> None:
        while not ended.is_set():
            handle = launcher.active[0] if launcher.active else None
            if handle is not None and hand.node in handle.procs and reached() >= hand.step:
                proc = handle.procs[hand.node]
                run.ledger.append("train", "drill_fired", fault=hand.fault, node=hand.node, step=reached())
                if hand.signal == signal.SIGKILL:
                    signal_all(process_tree(proc.pid), signal.SIGKILL)
                else:
                    proc.send_signal(hand.signal)
                return
            ended.wait(0.01)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def calibrated_step_ms(root: Path, hb: float, workload: Workload = DEFAULT, steps: int = CALIBRATION_STEPS) -> float:
    """This machine's step time (ms) for ``workload``: a short run without a fault or a save."""
    calibration = trainyard_run(root, steps, [], "kill", [], hb, steps, True, workload=workload)
    if not calibration["step_ms"]:  # not SystemExit: a configuration's failure must not end the bench
        raise RuntimeError(f"the calibration run reported no step time; its folder: {root}")
    return float(calibration["step_ms"])


def _rounded(ms: float | None) -> float | None:
    return None if ms is None else round(ms, 1)


def fault_plan(step_ms: float, train_s: float, saves_per_run: int = 6) -> dict[str, int]:
    """Steps for ``train_s`` seconds of training at ``step_ms`` per step, a save every ``1/saves_per_run``
    of it and the fault at the middle save's step (the worst moment for a relaunch: it loses a whole
    interval less one step). At least one step per save interval."""
    if step_ms <= 0 or train_s <= 0 or saves_per_run < 2:
        raise ValueError(f"fault_plan: step_ms {step_ms} and train_s {train_s} must be > 0, saves_per_run >= 2")
    every = max(1, round(train_s / saves_per_run / (step_ms / 1000)))
    return {"steps": saves_per_run * every, "fault_at": saves_per_run // 2 * every, "checkpoint_every": every}
