"""The recovery bench's configurations beside its default one (issue 30): each a short run of its own.

Each configuration trains about ``--config-train-s`` seconds (default 60) with one fault half way, its
steps sized to its own step time, measured on this machine by a short run without a fault (the
Kubernetes one uses the default workload's): a save every sixth of the run, the fault at the middle
save's step (``recovery_parts.runs.fault_plan``). So each reports one fault per ``train_s_per_fault``
seconds (its wall time, start-up included), not the 3 minutes of the default configuration: its ETTR
goal (``ettr_goal``) is the one for that rate, or none for a run shorter than a minute.

- ``two_ranks``: 3 nodes x 2 ranks (global batch 24), node-1 killed by a drill (both its ranks);
- ``byo``: ``examples/byo_train.py`` on 3 nodes, node-1's process tree SIGKILLed by the bench (a user's
  script acts out no drills);
- ``preempt``: the same script, node-1 given notice (SIGTERM to its process, as the kubelet gives it);
- ``kubernetes``: the reference workload on the fake cluster (``recovery_parts.k8s``): a pod's processes
  killed, and in a second run a host lost with its pod; ``path`` is whichever the backend took;
- ``big_model``: a model ~50x the reference workload's default size (``BIG_MODEL``), node-1 killed, in
  place and (``big_model.relaunch``) on the relaunch path, with its parameter count, checkpoint bytes
  and the save's blocked seconds, beside the default configuration's model;
- the relaunch path (issue 53), node-1 (or gpu-b's pod) killed at the middle save's step, with in-memory
  snapshots every step, and the same configuration again without them (``baseline``: ``recovery.snapshot_every:
  0``, the relaunch from the checkpoint that main did before snapshots) in the same bench run: ``relaunch``
  (the reference workload, ``recovery.in_place: false``), ``hf_relaunch`` and ``lightning_relaunch``
  (``examples/byo_hf.py``, ``examples/byo_lightning.py``: their ranks never form a group, so they relaunch) and
  ``kubernetes_relaunch`` (the fake cluster, ``in_place: false``). Each adds ``resumed_from`` (``snapshot`` or
  ``checkpoint``: the ``resumed`` event's source; None where the runtime did not say) and ``resumed_why``,
  ``ettr_fault_per_3min`` and ``ettr_fault_per_min`` (``ettr_at``: a 3-minute run with one start-up and one or
  three faults, each costing what this run's fault cost) and issue 53's ``goals``;
- ``snapshot_cost``: runs without a fault, with and without snapshots, of the default configuration's model
  and ``big_model``'s: the wall time between step events with over without, less 1 (goal <= 0.05).

Every object has ``resume_delay_s``, ``lost_steps``, ``ettr``, ``path``, ``step_ms``, ``wall_s``, the
fault's cost split (``restart_total_s``, ``restore_total_s``, ``replay_total_s``, beside ``detection_s``) and
``startup_s`` (stage start to first step: a short run's ETTR is mostly that), what was measured
(``steps``, ``fault_at``, ``checkpoint_every``, ``fault``), ``goals`` and ``peers``: which peer ran on it,
and why not where one did not.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peers.host import peer_run
from peers.versus import versus_best_peer
from recovery_parts.runs import DEFAULT, MODEL, ByHand, Workload, calibrated_step_ms, fault_plan, trainyard_run

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ("two_ranks", "byo", "preempt", "kubernetes", "big_model", "relaunch", "hf_relaunch", "lightning_relaunch",
           "kubernetes_relaunch", "snapshot_cost")  # fmt: skip
BIG_MODEL = {**MODEL, "d-model": 352}
"""6.1 M parameters: 50x the reference workload's default (d-model 64, 2 layers: 0.12 M) and 1.9x the default
configuration's (3.3 M); with Adam's state its checkpoint is ~74 MB (the default configuration's ~40 MB).
A step costs ~2x the default one."""
BYO = Workload(args={}, entrypoint=str(ROOT / "examples" / "byo_train.py"), global_batch=6, spike_check=False)
BYO_CALIBRATION_STEPS = 400  # its steps take milliseconds: 40 would measure start-up noise
# The framework adapters' examples (a tiny GPT-2 under a Hugging Face Trainer, a Lightning module): their ranks
# never form a group, so a fault relaunches them; they act the kill drill out themselves. Their loss is a tiny
# model's on random tokens: a "spike" there is no fault.
HF = Workload(args={}, entrypoint=str(ROOT / "examples" / "byo_hf.py"), spike_check=False)
LIGHTNING = Workload(args={}, entrypoint=str(ROOT / "examples" / "byo_lightning.py"), spike_check=False)
FRAMEWORK_CALIBRATION_STEPS = 100
SNAPSHOT_COST_GOAL = 0.05
"""The snapshot's cost: at most 5% of a step (issue 53)."""
FIGURES = (
    "resume_delay_s",
    "lost_steps",
    "ettr",
    "detection_s",
    "step_ms",
    "step_ms_from",
    "wall_s",
    "startup_s",
    "restart_total_s",  # the fault's cost split, with detection_s (docs/recovery.md)
    "restore_total_s",
    "replay_total_s",
)
NOT_HERE = {
    "two_ranks": "the peers' nodes are one process each (bench/peers/host.py): a node of two ranks is not built",
    "byo": "a peer trains its own loop (bench/peers/*_peer.py), not a user's script",
    "preempt": "a peer trains its own loop, not a user's script, and takes no SIGTERM notice",
    "kubernetes": "the peers run as local processes: neither has a backend on the fake cluster",
    "relaunch": "the peers are the in-place side: they are measured in the default configuration",
    "hf_relaunch": "a peer trains its own loop, not a Hugging Face Trainer",
    "lightning_relaunch": "a peer trains its own loop, not a Lightning Trainer",
    "snapshot_cost": "no fault: a cost without one, of trainyard's own snapshots",
}
TORCHRUN_WHY = "torchrun runs in the default configuration only (its re-rendezvous stalls; see torchrun_resumed)"


@dataclass(frozen=True)
class Settings:
    """What every configuration shares: from the bench's flags and its default configuration's run."""

    train_s: float
    hb: float
    background: bool
    peers: list[str]
    grace_s: float
    step_ms: float | None  # the default workload's step on this machine (None: measure it again)
    default: Mapping[str, Any]  # the default configuration's figures (its checkpoint, for the size axis)


def run_configs(args: argparse.Namespace, root: Path, names: list[str], peers: list[str], step_ms: float | None,
                default: Mapping[str, Any]) -> dict[str, dict[str, Any]]:  # fmt: skip
    """Each configuration named, one after another, with the bench's flags ``args``; each object printed to
    stderr as it ends; one that fails reports why, not the bench's end."""
    settings = Settings(args.config_train_s, args.heartbeat_timeout, not args.sync, peers, args.torchrun_grace,
                        step_ms, default)  # fmt: skip
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        try:
            out[name] = RUNNERS[name](root / name, settings)
        except Exception as exc:  # one configuration's failure must not lose the others' figures
            out[name] = {"ran": False, "why": f"{type(exc).__name__}: {exc}"}
        print(f"{name}: {json.dumps(out[name])}", file=sys.stderr)
    return out


def print_lines(objs: Mapping[str, Mapping[str, Any]]) -> None:
    """The configurations' figures in words, for the bench's summary."""
    for name, obj in objs.items():
        print(f"{name}: " + (f"not run ({obj['why']})" if obj.get("ran") is False else config_line(obj)))


def ettr_goal(train_s_per_fault: float | None) -> float | None:
    """The ETTR goal at this fault rate: >= 0.95 at one fault per 3 minutes of training or rarer, >= 0.90 at
    one per minute up to that; none for faults more often than a minute (no goal was set there)."""
    if train_s_per_fault is None or train_s_per_fault < 60:
        return None
    return 0.95 if train_s_per_fault >= 180 else 0.90


def goals(figures: Mapping[str, Any], resume_goal_s: float = 2.0) -> dict[str, Any]:
    """Which goals a configuration met (None where it has no such figure or no goal applies)."""
    resume, lost, ettr = figures.get("resume_delay_s"), figures.get("lost_steps"), figures.get("ettr")
    goal = ettr_goal(figures.get("train_s_per_fault"))
    versus = figures.get("ettr_vs_best_peer")
    return {
        "resume_ok": None if resume is None else resume <= resume_goal_s,
        "lost_ok": None if lost is None else lost <= 1,
        "ettr_goal": goal,
        "ettr_ok": None if goal is None or ettr is None else ettr >= goal,
        "vs_best_peer_ok": None if versus is None else versus >= 1.0,
    }


def summary(run: Mapping[str, Any], plan: Mapping[str, int], fault: str) -> dict[str, Any]:
    """A configuration's object: its figures, the one fault's path, the run's shape and what struck."""
    faults = max(1, len(run["failures"]))
    return {
        **{k: run.get(k) for k in FIGURES},
        "path": run["path"][0] if len(run["path"]) == 1 else (run["path"] or None),
        "train_s_per_fault": round(run["wall_s"] / faults, 1),
        **plan,
        "fault": fault,
        "world_path": run.get("world_path"),
    }


def config_line(obj: Mapping[str, Any]) -> str:
    """A configuration's figures in words, for the bench's summary lines."""
    if "snapshot_cost" in obj and "path" not in obj:
        return "snapshot cost (step time with / without, less 1): " + ", ".join(
            f"{name} {cost}" for name, cost in obj["snapshot_cost"].items()
        )
    line = (
        f"{obj['path']}, resume delay {obj['resume_delay_s']} s, lost steps {obj['lost_steps']}, ETTR {obj['ettr']}"
        f" (one fault in {obj['train_s_per_fault']} s, start-up {obj['startup_s']} s), step {obj['step_ms']} ms"
    )
    if base := obj.get("baseline"):
        line += (
            f"; resumed from {obj['resumed_from']}, ETTR at a fault per 3 min {obj['ettr_fault_per_3min']}, per"
            f" minute {obj['ettr_fault_per_min']}; without snapshots: resume delay {base['resume_delay_s']} s, lost"
            f" steps {base['lost_steps']}, resumed from {base['resumed_from']}, ETTR per 3 min"
            f" {base['ettr_fault_per_3min']}, per minute {base['ettr_fault_per_min']}"
        )
    return line


def finish(obj: dict[str, Any], peers: dict[str, Any], resume_goal_s: float = 2.0) -> dict[str, Any]:
    obj["peers"] = {"torchrun": {"ran": False, "why": TORCHRUN_WHY}, **peers}
    return {**obj, "goals": goals(obj, resume_goal_s)}


def not_here(name: str, settings: Settings) -> dict[str, Any]:
    return {p: {"ran": False, "why": NOT_HERE[name]} for p in settings.peers} or {
        "all": {"ran": False, "why": "--peers none"}
    }


def _plan(root: Path, settings: Settings, workload: Workload, steps: int | None = None) -> dict[str, int]:
    measured = calibrated_step_ms(root / "calibration", settings.hb, workload, *([steps] if steps else []))
    return {**fault_plan(measured, settings.train_s), "calibration_step_ms": round(measured, 1)}


def _run(root: Path, settings: Settings, plan: Mapping[str, int], workload: Workload, *, fault: str = "kill",
         by_hand: ByHand | None = None, in_place: bool = True) -> dict[str, Any]:  # fmt: skip
    drilled = ([], []) if by_hand else (plan["fault_at"], "node-1")
    return trainyard_run(root, plan["steps"], drilled[0], fault, drilled[1], settings.hb, plan["checkpoint_every"],
                         settings.background, in_place=in_place, workload=workload, by_hand=by_hand)  # fmt: skip


def two_ranks(root: Path, settings: Settings) -> dict[str, Any]:
    workload = Workload(procs=2, global_batch=24)  # 6 ranks x 2 x 2; 4 survivors x 2 x 3
    plan = _plan(root, settings, workload)
    run = _run(root / "kill", settings, plan, workload)
    obj = summary(run, plan, f"drill: node-1 (2 ranks) SIGKILLed at step {plan['fault_at']}")
    return finish(obj, not_here("two_ranks", settings))


def byo(root: Path, settings: Settings, notice: bool = False) -> dict[str, Any]:
    plan = _plan(root, settings, BYO, BYO_CALIBRATION_STEPS)
    sig, fault = (signal.SIGTERM, "preempt") if notice else (signal.SIGKILL, "kill")
    run = _run(root / fault, settings, plan, BYO, fault=fault, by_hand=ByHand("node-1", plan["fault_at"], sig, fault))
    what = "SIGTERM to node-1's process (notice)" if notice else "node-1's process tree SIGKILLed"
    obj = summary(run, plan, f"by hand: {what} once its heartbeat reached step {plan['fault_at']}")
    return finish(obj, not_here("preempt" if notice else "byo", settings))


def preempt(root: Path, settings: Settings) -> dict[str, Any]:
    return byo(root, settings, notice=True)


def big_model(root: Path, settings: Settings) -> dict[str, Any]:
    workload = Workload(args=BIG_MODEL)
    plan = _plan(root, settings, workload)
    ours = _run(root / "kill", settings, plan, workload)
    relaunch = _run(root / "relaunch", settings, plan, workload, in_place=False)
    obj = summary(ours, plan, f"drill: node-1 SIGKILLed at step {plan['fault_at']}")
    obj |= {
        "params": parameters(BIG_MODEL),
        "params_default": parameters(MODEL),
        "params_workload_default": parameters({}),
        "checkpoint_bytes": checkpoint_bytes(Path(ours["checkpoint_root"])),
        "checkpoint_bytes_default": checkpoint_bytes(Path(settings.default["checkpoint_root"]))
        if settings.default.get("checkpoint_root")
        else None,
        "save_blocked_s": ours["save_blocked_s"],
        "relaunch": {**summary(relaunch, plan, obj["fault"]), "save_blocked_s": relaunch["save_blocked_s"]},
    }
    flags = [a for k, v in BIG_MODEL.items() if k != "vocab-size" for a in (f"--{k}", str(v))]
    limit = 3 * ours["wall_s"] + settings.grace_s
    peers: dict[str, Any] = {}
    for peer in settings.peers:  # the same model, data, global batch and fault, one after another
        try:
            peers[peer] = peer_run(peer, root / peer, plan["steps"], plan["fault_at"], flags, limit, settings.grace_s)
        except Exception as exc:
            peers[peer] = {"ran": False, "why": f"{type(exc).__name__}: {exc}"}
    obj |= versus_best_peer(obj, peers)
    return finish(obj, peers or {"all": {"ran": False, "why": "--peers none"}})


def parameters(model_args: Mapping[str, Any]) -> int:
    """The reference workload's parameter count with these flags (the workload's defaults for the rest)."""
    from trainyard.workload.model import GPT, GPTConfig

    base = GPTConfig()
    cfg = GPTConfig(
        int(model_args.get("vocab-size", base.vocab_size)),
        int(model_args.get("seq-len", base.seq_len)),
        int(model_args.get("d-model", base.d_model)),
        int(model_args.get("n-layers", base.n_layers)),
        int(model_args.get("n-heads", base.n_heads)),
    )
    return sum(p.numel() for p in GPT(cfg).parameters())


def checkpoint_bytes(root: Path) -> int | None:
    """The bytes of the newest ``step_*`` checkpoint under ``root`` (its pipeline folder's), if any."""
    steps = sorted(root.rglob("step_*"), key=lambda p: p.name)
    return sum(f.stat().st_size for f in steps[-1].rglob("*") if f.is_file()) if steps else None


def kubernetes(root: Path, settings: Settings) -> dict[str, Any]:
    from recovery_parts.k8s import kubernetes_runs  # the fake cluster's helpers come from tests/integration

    return kubernetes_runs(root, settings)


# --- the relaunch path (issue 53): each configuration with in-memory snapshots and its baseline without ----------


def ettr_at(figures: Mapping[str, Any], every_s: float, span_s: float = 180.0) -> float | None:
    """The ETTR the default configuration would measure with a fault every ``every_s`` seconds: a ``span_s`` run
    (3 minutes) with one start-up and ``span_s / every_s`` faults, each costing what this run's faults cost,
    training between them at this run's steady rate.

    A fault's cost is the wall time it took from training: its resume delay (detection, restart, restore) and its
    replayed steps. The steady rate is the run's productive time over its wall time less its start-up and its
    faults' cost (what saves and snapshots take stays in it). At the run's own length and fault count this is
    the run's ETTR. None where a part is unknown."""
    ettr, wall, startup = figures.get("ettr"), figures.get("wall_s"), figures.get("startup_s")
    costs = [(f.get("resume_delay_s"), f.get("replay_s")) for f in figures.get("failures") or []]
    if ettr is None or not wall or startup is None or not costs or any(d is None or r is None for d, r in costs):
        return None
    cost = sum(d + r for d, r in costs)
    steady = wall - startup - cost
    if steady <= 0:
        return None
    rate = ettr * wall / steady
    return round(rate * max(0.0, span_s - startup - span_s / every_s * cost / len(costs)) / span_s, 4)


def relaunch_figures(run: Mapping[str, Any], plan: Mapping[str, int], fault: str) -> dict[str, Any]:
    """A relaunch configuration's object: the configuration's figures, what the relaunch resumed from, and its
    ETTR at one fault per 3 minutes and per minute (``ettr_at``)."""
    sources = [f.get("resumed_source") for f in run["failures"]]
    return {
        **summary(run, plan, fault),
        "resumed_from": sources[0] if len(sources) == 1 else (sources or None),
        "resumed_why": [f.get("resumed_why") for f in run["failures"]],
        "ettr_fault_per_3min": ettr_at(run, 180.0),
        "ettr_fault_per_min": ettr_at(run, 60.0),
        "wall_step_ms": run.get("wall_step_ms"),
    }


def relaunch_goals(figures: Mapping[str, Any], resume_goal_s: float = 2.0) -> dict[str, Any]:
    """Issue 53's goals: resume within ``resume_goal_s`` (2 s locally, 5 s on Kubernetes), at most a step lost,
    ETTR >= 0.95 at one fault per 3 minutes and >= 0.90 at one a minute."""
    resume, lost = figures.get("resume_delay_s"), figures.get("lost_steps")
    per_3min, per_min = figures.get("ettr_fault_per_3min"), figures.get("ettr_fault_per_min")
    return {
        "resume_ok": None if resume is None else resume <= resume_goal_s,
        "lost_ok": None if lost is None else lost <= 1,
        "ettr_fault_per_3min_ok": None if per_3min is None else per_3min >= 0.95,
        "ettr_fault_per_min_ok": None if per_min is None else per_min >= 0.90,
    }


def relaunch_pair(run: Callable[[str, int], Mapping[str, Any]], plan: Mapping[str, int], fault: str,
                  resume_goal_s: float = 2.0) -> dict[str, Any]:  # fmt: skip
    """The configuration run twice, one after the other: ``run(folder, snapshot_every)`` with snapshots every step,
    then without (``baseline``: the relaunch path before snapshots, from the checkpoint)."""
    ours = relaunch_figures(run("snapshots", 1), plan, fault)
    base = relaunch_figures(run("baseline", 0), plan, fault)
    return {**ours, "baseline": {**base, "goals": relaunch_goals(base, resume_goal_s)}}


def finish_relaunch(obj: dict[str, Any], peers: dict[str, Any], resume_goal_s: float = 2.0) -> dict[str, Any]:
    obj["peers"] = {"torchrun": {"ran": False, "why": TORCHRUN_WHY}, **peers}
    return {**obj, "goals": relaunch_goals(obj, resume_goal_s)}


def _relaunched(root: Path, settings: Settings, name: str, workload: Workload, calibration: int | None) -> dict:
    plan = _plan(root, settings, workload, calibration)

    def run(sub: str, every: int) -> Mapping[str, Any]:
        return trainyard_run(root / sub, plan["steps"], plan["fault_at"], "kill", "node-1", settings.hb,
                             plan["checkpoint_every"], settings.background, in_place=False, workload=workload,
                             snapshot_every=every)  # fmt: skip

    obj = relaunch_pair(run, plan, f"drill: node-1 SIGKILLed at step {plan['fault_at']}, relaunched")
    return finish_relaunch(obj, not_here(name, settings))


def relaunch(root: Path, settings: Settings) -> dict[str, Any]:
    return _relaunched(root, settings, "relaunch", DEFAULT, None)


def hf_relaunch(root: Path, settings: Settings) -> dict[str, Any]:
    return _relaunched(root, settings, "hf_relaunch", HF, FRAMEWORK_CALIBRATION_STEPS)


def lightning_relaunch(root: Path, settings: Settings) -> dict[str, Any]:
    return _relaunched(root, settings, "lightning_relaunch", LIGHTNING, FRAMEWORK_CALIBRATION_STEPS)


def kubernetes_relaunch(root: Path, settings: Settings) -> dict[str, Any]:
    from recovery_parts.k8s import kubernetes_relaunch as runs  # the fake cluster's helpers come from tests/integration

    return runs(root, settings)


def snapshot_cost(root: Path, settings: Settings) -> dict[str, Any]:
    """What a snapshot every step costs a step without a fault: the wall time between step events with snapshots
    over without, less 1, for the default configuration's model and ``big_model``'s, each pair one after the
    other (``snapshot_cost``, goal <= 0.05); half ``--config-train-s`` of training per run."""
    step_ms = settings.step_ms or calibrated_step_ms(root / "calibration", settings.hb)
    steps = max(20, round(settings.train_s / 2 / (step_ms / 1000)))
    out: dict[str, Any] = {}
    for name, workload, n in (
        ("default", DEFAULT, steps),
        ("big_model", Workload(args=BIG_MODEL), max(10, steps // 2)),
    ):
        off, on = (
            trainyard_run(root / f"{name}-{every}", n, [], "kill", [], settings.hb, n, settings.background,
                          workload=workload, snapshot_every=every)
            for every in (0, 1)
        )  # fmt: skip
        cost = on["wall_step_ms"] / off["wall_step_ms"] - 1 if on["wall_step_ms"] and off["wall_step_ms"] else None
        out[name] = {"snapshot_cost": None if cost is None else round(cost, 4), "steps": n,
                     "wall_step_ms": on["wall_step_ms"], "wall_step_ms_without": off["wall_step_ms"],
                     "step_ms": on["step_ms"], "step_ms_without": off["step_ms"]}  # fmt: skip
    costs = {name: obj["snapshot_cost"] for name, obj in out.items()}
    return {
        **out,
        "snapshot_cost": costs,
        "goals": {f"{name}_ok": None if c is None else c <= SNAPSHOT_COST_GOAL for name, c in costs.items()},
        "peers": not_here("snapshot_cost", settings),
    }


RUNNERS: dict[str, Callable[[Path, Settings], dict[str, Any]]] = {
    "two_ranks": two_ranks,
    "byo": byo,
    "preempt": preempt,
    "kubernetes": kubernetes,
    "big_model": big_model,
    "relaunch": relaunch,
    "hf_relaunch": hf_relaunch,
    "lightning_relaunch": lightning_relaunch,
    "kubernetes_relaunch": kubernetes_relaunch,
    "snapshot_cost": snapshot_cost,
}
