"""Recovery from a lost node: trainyard in place and relaunched, torchrun's elastic restart, and the peers.

    python bench/recovery.py [--train-s-per-fault 180] [--steps N --kill-at K --checkpoint-every E] [--sync]
                             [--configs two_ranks,byo,preempt,kubernetes,big_model,relaunch,hf_relaunch,
                                        lightning_relaunch,kubernetes_relaunch,snapshot_cost|none]
                             [--config-train-s 60]
                             [--configs-only] [--peers torchft,nvrx|none] [--keep DIR]

The same workload on 3 local nodes, node-1 SIGKILLed (agent and worker) at
step ``--kill-at``, about 3 minutes of training with the fault half way. A step
costs 0.24 s on one 2-core machine and 0.43 s on another, so the step counts are
sized here: a short run without a fault (``calibration``) measures this machine's
step, then the runs get ``--train-s-per-fault`` seconds of training per fault, a
save every sixth of it, the fault just before the middle save (``sizing`` in the
JSON says what was measured and chosen; ``--steps``, ``--kill-at``,
``--checkpoint-every`` and ``--per-minute-steps`` override):
- trainyard: the train stage with ``recovery.in_place: true`` (supervisor, classify, decide: the two
  survivors regroup in place on the supervisor's store; node-1, started again, rejoins at a step
  boundary), and again with ``in_place: false`` (the relaunch path: scale down to 2, resume from the
  checkpoint) under ``relaunch``; shorter in-place runs kill node-0 (``node0_resume_delay_s``) and
  hang node-2 (``hang_detection_s``, ``hang_resume_delay_s``); a run of ``--per-minute-steps`` with a
  warm spare kills node-1, node-2 and node-0 in turn, about one fault per minute of training
  (``ettr_fault_per_min``, ``fault_per_min``: the spare joins at the first); the runs themselves are
  ``recovery_parts.runs.trainyard_run``;
- torchrun: ``--nnodes=1:3 --max-restarts=3`` agents started by hand, which
  re-rendezvous the survivors and restart their workers from the latest checkpoint.
  Its survivors' agents sometimes never complete that re-rendezvous (seen here
  with blocking and with background saves), so it gets ``--torchrun-grace``
  seconds after the fault to resume; if it does not, its figures are null and
  ``torchrun_resumed`` is false. It gets ``--torchrun-limit`` seconds in all
  (3x trainyard's run plus the grace): one that resumed and then stalled is
  stopped, ``torchrun_finished`` false and its ETTR null; its agents' logs
  (``torchrun-node-N.log``) are printed to stderr then.
Then the peers (``--peers``, default ``torchft,nvrx``; ``none`` skips them), one
after another, on the same model, data, global batch and fault, each under the
torchrun baseline's total limit and with its grace as a stall bound (no new
step that long after the fault): torchft 0.2.0 (a replica group per node, a
Lighthouse hosted in this process) and NVIDIA's nvidia-resiliency-ext 0.4.1
in-process restart (``bench/peers/``). A peer whose package is missing reports
``{"ran": false, "why": ...}``.
All write the same ledger (the workload's step, drill and resume events), so
the figures come from the same events. A second trainyard run hangs node-2
instead, for ``hang_detection_s``. Prints one JSON line last: each peer's
figures under its own key, ``best_peer`` (the highest ETTR of torchrun and the
peers that finished) with ``ettr_vs_best_peer``, and ``best_resume_peer`` with
``resume_delay_vs_best_peer``.

Then the configurations (issue 30; ``--configs``, default all, ``none`` skips them; ``recovery_parts.configs``
says what each runs): ``two_ranks`` (3 nodes x 2 ranks, node-1 killed), ``byo`` and ``preempt``
(``examples/byo_train.py``: node-1 SIGKILLed, or given notice by SIGTERM), ``kubernetes`` (the fake
cluster: a pod killed, and ``kubernetes.node_lost``: a host lost), ``big_model`` (~50x the reference
workload's default size, in place and ``big_model.relaunch``, with its checkpoint's bytes and save cost), the
relaunch path with in-memory snapshots beside its ``baseline`` without them (issue 53: ``relaunch``,
``hf_relaunch``, ``lightning_relaunch``, ``kubernetes_relaunch``; where ``relaunch`` runs, it replaces the default
configuration's own relaunch run under that key) and ``snapshot_cost`` (a step with snapshots over one without).
Each is one short run of its own (``--config-train-s`` of training, default 60 s, the fault half way:
one fault per ``train_s_per_fault``, start-up included, not per 3 minutes), sized to its own step time,
and reports ``resume_delay_s``, ``lost_steps``, ``ettr``, ``path``, ``step_ms``, ``wall_s``, what was
measured, which goals it met (``goals``; the ETTR goal is the one for its fault rate) and which peer ran
on it (``peers``: only ``big_model`` runs them; the others say why not). ``--configs-only`` skips the
default configuration and torchrun: a short run, e.g. ``--configs-only --config-train-s 20 --peers none``.

Goals (issue 17): first step at most 2 s after a killed node (node-0 too), at most one step lost, a hang
resumed within the heartbeat timeout + 3 s; ETTR >= 0.95 with one fault per 3 minutes of training
(``train_s_per_fault`` states this run's rate) and >= 0.85 with one a minute; resume delay and ETTR at
least as good as the best peer's (``resume_delay_vs_best_peer`` <= 1, ``ettr_vs_best_peer`` >= 1).
The kill lands at the worst moment for a relaunch, just before a checkpoint is due, so the relaunch path
loses ``--checkpoint-every`` minus one steps. Checkpoints are saved in the background unless ``--sync``;
``save_blocked_s`` is training's mean wait per save. With in-place recovery the on-disk checkpoint is for
whole-job restarts and publishing, so the default saves every ~30 s of training (each save and its
validation cost 1-3 s of CPU on these 2 cores); the peers save none. ``--smoke``: one in-place run of a few
steps with node-1 killed, nothing else (its figures mean nothing; CI runs it to see the bench still works).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection, Iterator
from pathlib import Path

from bounds import add_smoke, emit
from peers.host import PEERS, peer_run  # bench/peers: this script's folder is first on sys.path
from peers.versus import versus_best_peer
from recovery_parts.configs import CONFIGS, print_lines, run_configs
from recovery_parts.runs import ARGS, calibrated_step_ms, fault_plan, trainyard_run

from trainyard.backends.local.launcher import process_tree, signal_all
from trainyard.events.ledger import Ledger
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.figures import recovery_figures

SMOKE_STEPS, SMOKE_AT, SMOKE_EVERY = 16, 8, 4  # --smoke: long enough to save, lose node-1, heal in place


def sizing(root: Path, args: argparse.Namespace) -> dict:
    """Fill in the step counts not given: ``--train-s-per-fault`` of training per fault at this machine's step
    time, measured by a short run without a fault (the same workload, 3 nodes, no save)."""
    measured = None
    if None in (args.steps, args.kill_at, args.checkpoint_every, args.per_minute_steps):
        measured = calibrated_step_ms(root, args.heartbeat_timeout)
        # A save every sixth of the time per fault, the fault at the third save's step: 6 saves per fault.
        plan = fault_plan(measured, args.train_s_per_fault)
        args.checkpoint_every = args.checkpoint_every or plan["checkpoint_every"]
        args.steps = args.steps or 6 * args.checkpoint_every
        args.kill_at = args.kill_at or 3 * args.checkpoint_every
        args.per_minute_steps = args.per_minute_steps or args.steps
    return {"step_ms_measured": measured, "train_s_per_fault_asked": args.train_s_per_fault, "steps": args.steps,
            "kill_at": args.kill_at, "checkpoint_every": args.checkpoint_every,
            "per_minute_steps": args.per_minute_steps}  # fmt: skip


def torchrun_run(root: Path, steps: int, at: int, every: int, background: bool, grace_s: float, limit_s: float) -> dict:
    """torchrun's figures; ``resumed``/``finished`` false where it did not resume within ``grace_s`` of the
    fault or did not finish within ``limit_s`` in all (its agents' logs, kept under ``root``, say why)."""
    data = root / "data"
    write_synthetic_corpus(data, shards=2, tokens_per_shard=16_384)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ledger = root / "events.jsonl"
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "OMP_NUM_THREADS": "1",
        "TRAINYARD_DATA_DIR": str(data),
        "TRAINYARD_CHECKPOINT_DIR": str(root / "ckpt"),
        "TRAINYARD_HEARTBEAT_DIR": str(root / "hb"),
        "TRAINYARD_EVENTS_DIR": str(Ledger(ledger).events_dir),
        "TRAINYARD_RESUME_FROM": "latest",
        "TRAINYARD_MAX_STEPS": str(steps),
        "TRAINYARD_GLOBAL_BATCH": "12",
        "TRAINYARD_MICRO_BATCH": "2",
        "TRAINYARD_CHECKPOINT_EVERY": str(every),
        "TRAINYARD_CHECKPOINT_ASYNC": str(int(background)),
        "TRAINYARD_PROGRESS_EVERY_S": "0",
        "TRAINYARD_DRILLS": json.dumps([{"fault": "kill", "node": "node-1", "step": at}]),
    }
    Ledger(ledger).append("train", "stage_start")
    started = time.monotonic()
    logs = [(root / f"torchrun-node-{i}.log").open("wb") for i in range(3)]
    agents = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=1:3",
                "--nproc-per-node=1",
                "--max-restarts=3",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=bench",
                f"--rdzv-conf=is_host={int(i == 0)}",
                "--local-addr=127.0.0.1",
                "-m",
                "trainyard.workload",
                *ARGS,
            ],
            env={**env, "TRAINYARD_NODE": f"node-{i}"},
            stdout=logs[i],
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        for i in range(3)
    ]
    for log in logs:
        log.close()  # the agents hold their own copies
    stopped = ""
    try:
        while any(agents[i].poll() is None for i in (0, 2)):
            fired = list(Ledger(ledger).events("train", "drill_fired"))
            if fired and time.time() - fired[0]["ts"] > grace_s and not resumed_after(ledger, fired[0]["ts"]):
                stopped = f"no resume {grace_s:.0f} s after the fault"
                break
            if time.monotonic() - started > limit_s:
                stopped = f"not finished within {limit_s:.0f} s"
                break
            time.sleep(1)
    finally:
        for agent in agents:  # with its workers, which torchrun starts in sessions of their own
            signal_all(process_tree(agent.pid), signal.SIGKILL)
    if stopped:
        print(f"torchrun: {stopped}; stopped. Its agents' last words:", file=sys.stderr)
        for i in range(3):
            tail = (root / f"torchrun-node-{i}.log").read_text(errors="replace").splitlines()[-15:]
            print(f"--- node-{i}\n" + "\n".join(tail), file=sys.stderr)
    Ledger(ledger).append("train", "stage_end", seconds=round(time.monotonic() - started, 3))
    events = list(Ledger(ledger).events("train"))
    fault = next((e for e in events if e["event"] == "drill_fired"), None)
    after = [e for e in events if fault and e["ts"] > fault["ts"]]
    resumed = next((e for e in after if e["event"] == "resumed"), None)
    first = next((e for e in after if resumed and e["event"] == "step" and e["ts"] > resumed["ts"]), None)
    if fault is None or resumed is None or first is None:
        return {"resume_delay_s": None, "lost_steps": None, "ettr": None, "restart_detected_s": None,
                "resumed": False, "finished": False, "stopped": stopped}  # fmt: skip
    before = max(e["step"] for e in events if e["event"] == "step" and e["ts"] <= fault["ts"])
    return {
        "resume_delay_s": round(first["ts"] - fault["ts"], 3),
        "lost_steps": before - resumed["step"],
        # ETTR: the same definition on the same events, for a run that finished
        "ettr": None if stopped else recovery_figures(Ledger(ledger))["ettr"],
        "restart_detected_s": round(resumed["ts"] - fault["ts"], 3),
        "resumed": True,
        "finished": not stopped,
        "stopped": stopped,
    }


@contextlib.contextmanager
def _workdir(keep: Path | None) -> Iterator[str]:
    """Where the runs go: ``keep`` (made, kept: the node logs say what went wrong) or a folder removed after."""
    if keep is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield tmp
    else:
        keep.mkdir(parents=True, exist_ok=True)
        yield str(keep)


def resumed_after(ledger: Path, ts: float) -> bool:
    return any(e["ts"] > ts for e in Ledger(ledger).events("train", "resumed"))


def _names(parser: argparse.ArgumentParser, flag: str, value: str, known: Collection[str]) -> list[str]:
    """The comma-separated names of ``flag`` ('none': none), each one of ``known``."""
    names = [] if value == "none" else [n.strip() for n in value.split(",") if n.strip()]
    if unknown := sorted(set(names) - set(known)):
        parser.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)} or 'none'")
    return names


def main() -> None:
    parser = argparse.ArgumentParser()
    # ~3 minutes of training with the fault half way (one fault per 3 minutes); a save every ~30 s. The step
    # counts are sized to this machine (``sizing``) unless given.
    parser.add_argument("--train-s-per-fault", type=float, default=180.0, help="seconds of training per fault")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--per-minute-steps", type=int, help="the run with a fault every ~minute (3 in all)")
    parser.add_argument("--heartbeat-timeout", type=float, default=10.0)
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--sync", action="store_true", help="blocking checkpoint saves")
    parser.add_argument("--torchrun-grace", type=float, default=300.0, help="seconds torchrun gets to resume")
    parser.add_argument(
        "--torchrun-limit", type=float, help="seconds torchrun gets in all (default: 3x trainyard's run, + the grace)"
    )
    parser.add_argument("--keep", type=Path, help="keep every run's folder (ledgers, node logs) under this one")
    parser.add_argument(
        "--peers", default=",".join(PEERS), help=f"comma-separated, of {', '.join(PEERS)}; 'none': skip them"
    )
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}; 'none': skip them"
    )
    parser.add_argument("--config-train-s", type=float, default=60.0, help="seconds of training per configuration")
    parser.add_argument(
        "--configs-only", action="store_true", help="skip the default configuration (and torchrun): a short run"
    )
    add_smoke(parser, f"one train stage of {SMOKE_STEPS} steps, node-1 killed at {SMOKE_AT}: no peers, no configs")
    args = parser.parse_args()
    if args.smoke:
        with _workdir(args.keep) as tmp:
            ours = trainyard_run(Path(tmp) / "smoke", SMOKE_STEPS, SMOKE_AT, "kill", "node-1", args.heartbeat_timeout,
                                 SMOKE_EVERY, not args.sync)  # fmt: skip
        emit({"bench": "recovery", "smoke": True, **ours})
        return
    peers, configs = _names(parser, "--peers", args.peers, PEERS), _names(parser, "--configs", args.configs, CONFIGS)
    if args.configs_only:
        with _workdir(args.keep) as tmp:
            per_config = run_configs(args, Path(tmp) / "configs", configs, peers, None, {})
        print_lines(per_config)
        print(
            json.dumps({"bench": "recovery", "configs_only": True, "config_train_s": args.config_train_s, **per_config})
        )
        return
    with _workdir(args.keep) as tmp:
        sized = sizing(Path(tmp) / "calibration", args)
        print(f"sizing: {json.dumps(sized)}", file=sys.stderr)
        saves = (args.checkpoint_every, not args.sync)
        ours = trainyard_run(Path(tmp) / "kill", args.steps, args.kill_at, "kill", "node-1",
                             args.heartbeat_timeout, *saves)  # fmt: skip
        # The same fault on the relaunch path (recovery.in_place: false), and in place: node 0 (no special
        # node: the store is the supervisor's) and a hang, on shorter runs (their figures are delays).
        # (the ``relaunch`` configuration, where it runs, measures this path with and without snapshots)
        relaunch = None if "relaunch" in configs else trainyard_run(
            Path(tmp) / "relaunch", args.steps, args.kill_at, "kill", "node-1", args.heartbeat_timeout, *saves,
            in_place=False)  # fmt: skip
        node0 = trainyard_run(Path(tmp) / "node0", args.steps // 3, args.kill_at // 3, "kill", "node-0",
                              args.heartbeat_timeout, *saves)  # fmt: skip
        # A fault about every minute of training, on node-1, node-2 then node-0, with a warm spare (node-3)
        # started with the attempt: it joins at the first fault; each killed node is started again and
        # rejoins at a step boundary (recovery.rejoin), so every fault meets 3 nodes.
        every_min = args.per_minute_steps // 4
        per_min = trainyard_run(Path(tmp) / "per-minute", args.per_minute_steps, [every_min * k for k in (1, 2, 3)],
                                "kill", ["node-1", "node-2", "node-0"], args.heartbeat_timeout, *saves,
                                spares=1)  # fmt: skip
        hang = trainyard_run(Path(tmp) / "hang", args.steps // 3, args.kill_at // 3, "hang", "node-2",
                             args.heartbeat_timeout, *saves)  # fmt: skip
        print(
            f"trainyard: {json.dumps(ours)}\nrelaunch: {json.dumps(relaunch)}\nnode-0: {json.dumps(node0)}"
            f"\nhang: {json.dumps(hang)}\nper minute: {json.dumps(per_min)}",
            file=sys.stderr,
        )  # fmt: skip  (kept if the baseline fails)
        limit = args.torchrun_limit or 3 * ours["wall_s"] + args.torchrun_grace
        theirs = torchrun_run(Path(tmp) / "torchrun", args.steps, args.kill_at, *saves, args.torchrun_grace, limit)
        others: dict[str, dict] = {}
        for peer in peers:  # one at a time: 3 nodes each on 2 cores
            try:
                others[peer] = peer_run(peer, Path(tmp) / peer, args.steps, args.kill_at, ARGS, limit,
                                        args.torchrun_grace)  # fmt: skip
            except Exception as exc:  # one peer's failure must not lose the others' figures, or ours
                others[peer] = {"ran": False, "why": f"{type(exc).__name__}: {exc}"}
            print(f"{peer}: {json.dumps(others[peer])}", file=sys.stderr)
        if "torchft" in others and others["torchft"].get("step_ms") and ours["step_ms"]:
            # torchft's cost without a fault: its per-step quorum and commit RPCs, against our plain DDP step
            others["torchft"]["step_overhead"] = round(others["torchft"]["step_ms"] / ours["step_ms"], 3)
        per_config = run_configs(args, Path(tmp) / "configs", configs, peers, sized["step_ms_measured"], ours)
    print(f"one fault in {ours['wall_s']:.0f} s of training")
    print(
        f"trainyard: detection {ours['detection_s']} s, resume delay {ours['resume_delay_s']} s,"
        f" lost steps {ours['lost_steps']}, ETTR {ours['ettr']} (productive {ours['productive_s']} s)"
    )
    print(
        f"checkpoints every {args.checkpoint_every} steps, {'blocking' if args.sync else 'in the background'}:"
        f" training waited {ours['save_blocked_s']} s per save"
    )
    if relaunch is not None:
        print(
            f"relaunch path: resume delay {relaunch['resume_delay_s']} s, lost steps {relaunch['lost_steps']},"
            f" ETTR {relaunch['ettr']}"
        )
    print(f"node-0 killed: resume delay {node0['resume_delay_s']} s")
    print(
        f"a fault every {per_min['wall_s'] / len(per_min['failures']):.0f} s ({len(per_min['failures'])} faults):"
        f" ETTR {per_min['ettr']}, worst resume delay {per_min['resume_delay_s']} s, lost steps"
        f" {per_min['lost_steps']}, world {per_min['world_path']}"
    )
    print(
        f"hang: detected {hang['detection_s']} s after the fault (heartbeat timeout {args.heartbeat_timeout} s),"
        f" resumed {hang['resume_delay_s']} s after it"
    )
    print(
        f"torchrun --max-restarts=3: resume delay {theirs['resume_delay_s']} s, lost steps {theirs['lost_steps']},"
        f" ETTR {theirs['ettr']}"
    )
    for peer, figures in others.items():
        if figures.get("ran"):
            print(
                f"{peer}: resume delay {figures['resume_delay_s']} s, lost steps {figures['lost_steps']},"
                f" ETTR {figures['ettr']}, step {figures['step_ms']} ms (trainyard {ours['step_ms']} ms)"
            )
        else:
            print(f"{peer}: not run ({figures['why']})")
    print_lines(per_config)
    print(
        json.dumps(
            {
                "bench": "recovery",
                "detection_s": ours["detection_s"],
                "hang_detection_s": hang["detection_s"],
                "hang_resume_delay_s": hang["resume_delay_s"],
                "resume_delay_s": ours["resume_delay_s"],
                "node0_resume_delay_s": node0["resume_delay_s"],
                "path": {"kill": ours["path"], "node0": node0["path"], "hang": hang["path"]},
                "ettr_fault_per_min": per_min["ettr"],
                "fault_per_min": {
                    "faults": len(per_min["failures"]),
                    "train_s_per_fault": round(per_min["wall_s"] / max(1, len(per_min["failures"])), 1),
                    **{
                        k: per_min[k]
                        for k in ("resume_delay_s", "lost_steps", "path", "world_path", "spares_joined", "spares_idle")
                    },
                },
                "resume_delay_ratio_vs_torchrun": round(ours["resume_delay_s"] / theirs["resume_delay_s"], 3)
                if theirs["resumed"]
                else None,
                "torchrun_resumed": theirs["resumed"],
                "torchrun_finished": theirs["finished"],
                "lost_steps": ours["lost_steps"],
                "ettr": ours["ettr"],
                "torchrun_resume_delay_s": theirs["resume_delay_s"],
                "torchrun_ettr": theirs["ettr"],
                "steps": args.steps,
                "sizing": sized,
                "train_s_per_fault": ours["wall_s"],
                "checkpoint_every": args.checkpoint_every,
                "checkpoint_async": not args.sync,
                "save_blocked_s": ours["save_blocked_s"],
                "step_ms": ours["step_ms"],
                **(
                    {
                        "relaunch": {
                            k: relaunch[k] for k in ("resume_delay_s", "lost_steps", "ettr", "detection_s", "path")
                        }
                    }
                    if relaunch is not None
                    else {}
                ),  # else the relaunch configuration's object, below
                **others,
                **versus_best_peer(ours, {"torchrun": theirs, **others}),
                "config_train_s": args.config_train_s,  # asked of each configuration; each says what it got
                **per_config,
            }
        )
    )


if __name__ == "__main__":
    main()
