#!/usr/bin/env bash
# trainyard on this machine's GPUs, in one go (issue 14, "Real GPUs"):
#
#   1. the demo pipeline on GPU: dags/pipelines/nightly_pretrain.yaml with its nodes given GPUs
#      (nodes.gpus_per_node, one rank per GPU: NCCL, bf16), run stage by stage without Airflow
#      (stage, check, burn-in, train, checkpoint gate, publish, report);
#   2. the burn-in's bf16 matmul probe (burnin/gpu.py gpu_checks) as a fraction of the
#      device's dense bf16 peak (gpu.py PEAK_BF16_TFLOPS, by device name);
#   3. one recovery drill: a training node SIGKILLed mid-run, which recovery must replace or
#      scale down, after which the run must succeed;
#   4. the in-place kill drill (issue 30, "GPUs"): 2 nodes x 1 GPU (nodes.gpus_per_node: 1) of the
#      reference workload with recovery.in_place, node-1 SIGKILLed mid-run: the survivor's NCCL
#      generation must be aborted (runtime/collectives.py) and regrouped in place, not relaunched,
#      without waiting out the collective timeout. Needs 2 CUDA devices; with fewer its object says
#      so ("skipped") and the other checks still count.
#   5. the relaunch drill from in-memory snapshots (issue 53): the same nodes with recovery.in_place
#      false, node-1 SIGKILLed at step 30: the relaunch must resume from the snapshot of a CUDA model
#      kept in host shared memory (the ledger's `resumed` with source "snapshot" at step 29, not the
#      checkpoint), losing at most one step; its object carries the fault's cost split (detection,
#      restart, restore, replay) so the first GPU machine shows where a GPU relaunch's seconds go
#      (CUDA and NCCL start-up are in `restart_total_s`: standby processes with CUDA contexts are not
#      built yet).
#
#     bench/gpu_check.sh            # PYTHON=/path/to/python to choose the interpreter (default: the
#                                   # project's .venv, made by `make venv`; else python3 on the PATH)
#
# Prints one JSON line last. Without a usable CUDA device it prints {"skipped": true, "reason":
# ...} and exits 0, so it can run anywhere; on a GPU machine it exits 1 if a check failed.
# Everything it writes is under a fresh temporary TRAINYARD_HOME, removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/include${PYTHONPATH:+:$PYTHONPATH}"
export TRAINYARD_HOME
TRAINYARD_HOME=$(mktemp -d "${TMPDIR:-/tmp}/trainyard-gpu-check.XXXXXX")
trap 'rm -rf "$TRAINYARD_HOME"' EXIT

PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || command -v python3 || echo python3)}
if ! "$PYTHON" -c 'import torch, yaml, trainyard' 2>/dev/null; then
  # Runs anywhere, as without a GPU: a machine without the project's Python says so and exits 0.
  printf '{"bench": "gpu_check", "skipped": true, "reason": "%s cannot import torch, yaml and trainyard: run make venv, or set PYTHON"}\n' "$PYTHON"
  exit 0
fi

exec 3>&1 # the JSON line goes to the real stdout; the stages' chatter to stderr
"$PYTHON" - "$PWD" <<'PY' >&2
import json
import os
import sys
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(sys.argv[1])
out = os.fdopen(3, "w")


def done(result: dict, code: int = 0) -> None:
    print(json.dumps({"bench": "gpu_check", **result}), file=out, flush=True)
    sys.exit(code)


if not torch.cuda.is_available():
    build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
    done({"skipped": True, "reason": f"no CUDA device visible (torch {torch.__version__}, {build})"})

from trainyard import stages  # noqa: E402
from trainyard.burnin.gpu import gpu_checks, peak_bf16_tflops  # noqa: E402
from trainyard.cli import main as trainyard  # noqa: E402
from trainyard.pipeline.drill import run_drill  # noqa: E402
from trainyard.pipeline.run import open_run  # noqa: E402
from trainyard.spec import Drill  # noqa: E402

DATE = "2026-11-28"

gpus = torch.cuda.device_count()
name = torch.cuda.get_device_name(0)
result: dict = {"device": name, "gpus": gpus, "torch": torch.__version__, "cuda": torch.version.cuda}
problems: list[str] = []

# ---- the spec variant: 2 nodes splitting the GPUs (1 node and a spare on a 1-GPU machine)
count = 2 if gpus >= 2 else 1
per_node = gpus // count
spec = yaml.safe_load((ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml").read_text())
spec.update(schedule=None)
spec["nodes"] = {"count": count, "min": 1, "spare": 2 - count, "procs_per_node": per_node, "gpus_per_node": per_node}
ranks = count * per_node
spec["training"].update(global_batch=8 * ranks, micro_batch=4, max_steps=60, checkpoint_every=20)
spec_path = Path(os.environ["TRAINYARD_HOME"]) / "specs" / "gpu_pretrain.yaml"
spec_path.parent.mkdir(parents=True)
spec_path.write_text(yaml.safe_dump(spec, sort_keys=False))
result["spec"] = {"nodes": count, "gpus_per_node": per_node, "global_batch": 8 * ranks}
if trainyard(["demo-data", "--date", DATE]) != 0:
    done({**result, "ok": False, "problems": ["trainyard demo-data failed"]}, 1)

# ---- 1. the demo pipeline
began = time.monotonic()
try:
    run = open_run(spec_path, "gpu_pretrain", f"gpu_check__{time.time_ns()}", DATE)
    stages.stage_dataset(run)
    stages.check_dataset(run)
    chosen = stages.burn_in(run)
    trained = stages.train(run, chosen["healthy"], spares=chosen.get("spare", []))
    checked = stages.check_checkpoint(run, trained["checkpoint"], trained["target_step"])
    stages.publish(run, checked["checkpoint"])
    stages.report(run)
    last = ([{}] + list(run.ledger.events("train", "step")))[-1]
    result["pipeline"] = {
        "ok": True, "seconds": round(time.monotonic() - began, 1), "last_step": trained["last_step"],
        "loss": last.get("loss"), "tokens_per_s": last.get("tokens_per_s"),
    }  # fmt: skip
    logs = "".join(p.read_text(errors="replace") for p in run.dir.glob("attempt-*/*.log"))
    if "(nccl, bf16 autocast)" not in logs:  # the workload's first line says where it trains
        problems.append("pipeline: the workload did not train on CUDA with NCCL and bf16")
except Exception as exc:  # one line in the JSON, the traceback on stderr
    import traceback

    traceback.print_exc()
    result["pipeline"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    problems.append("pipeline failed")

# ---- 2. the burn-in's bf16 probe against the device's peak
probe = gpu_checks(budget_s=6.0)
peak = peak_bf16_tflops(name)
result["bf16_matmul"] = {
    "tflops": round(probe["bf16_tflops"], 1), "peak_tflops": peak,
    "fraction_of_peak": round(probe["bf16_tflops"] / peak, 3) if peak else None,
    **({} if peak else {"note": f"no peak known for {name!r}: add it to trainyard.burnin.gpu.PEAK_BF16_TFLOPS"}),
    **{k: probe[k] for k in ("temperature_c", "ecc_uncorrected", "throttle", "health_source") if k in probe},
}  # fmt: skip

# ---- 3. one recovery drill: a training node killed mid-run
began = time.monotonic()
try:
    # With 2 nodes node-1 trains for sure; with 1 node and a spare, either may: strike every node.
    report = run_drill(spec_path, Drill(fault="kill", step=30, node="node-1" if count == 2 else None), DATE)
    result["drill"] = {
        "ok": report.ok, "actions": report.actions, "end": report.end, "seconds": round(time.monotonic() - began, 1),
        **{k: report.figures.get(k) for k in ("detection_s", "resume_delay_s", "lost_steps")},
    }  # fmt: skip
    if not report.ok:
        want = report.expected
        problems.append(f"drill: expected {want.action}, run {want.end} ({want.reason}); got actions {report.actions},"
                        f" run {report.end}")  # fmt: skip
except Exception as exc:
    import traceback

    traceback.print_exc()
    result["drill"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    problems.append("drill failed")

# ---- 4. the in-place kill drill: 2 nodes x 1 GPU, node-1 killed, the survivor regroups in place on NCCL
if gpus < 2:
    result["in_place_drill"] = {"ok": False, "skipped": True, "reason": f"needs 2 CUDA devices, found {gpus}"}
else:
    from trainyard.events.fold import fold  # noqa: E402
    from trainyard.events.ledger import Ledger  # noqa: E402

    drilled = {**spec, "nodes": {"count": 2, "min": 1, "spare": 0, "procs_per_node": 1, "gpus_per_node": 1}}
    drilled["training"] = {**spec["training"], "global_batch": 16}
    drilled["recovery"] = {**spec.get("recovery", {}), "in_place": True}
    heartbeat_timeout_s = float(drilled["training"].get("heartbeat_timeout_s", 60.0))
    timeout_s = 2 * heartbeat_timeout_s + 5  # the collective timeout pipeline/train.py gives in-place ranks
    drilled_path = spec_path.with_name("gpu_in_place.yaml")
    drilled_path.write_text(yaml.safe_dump(drilled, sort_keys=False))
    began = time.monotonic()
    try:
        report = run_drill(drilled_path, Drill(fault="kill", step=30, node="node-1"), DATE)
        train = fold(list(Ledger.in_dir(report.run_dir).events("train"))).train
        logs = "".join(p.read_text(errors="replace") for p in report.run_dir.glob("attempt-*/*.log"))
        failure = (report.figures.get("failures") or [{}])[0]
        resume = report.figures.get("resume_delay_s")
        waited = "Watchdog caught collective operation timeout" in logs or (resume or 0) >= timeout_s
        result["in_place_drill"] = {
            "ok": False, "end": report.end, "path": failure.get("path"), "why_not": train.why_not or None,
            "seconds": round(time.monotonic() - began, 1), "collective_timeout_s": timeout_s,
            "detection_s": report.figures.get("detection_s"), "resume_delay_s": resume,
            "lost_steps": report.figures.get("lost_steps"), "waited_out_timeout": waited,
            "nccl_group_aborted": "generation 1's nccl group" in logs,  # elastic.Membership.on_fault's line
            "aborted_by_hang_watch": "aborting this generation's communicators" in logs,
        }  # fmt: skip
        why = [
            f"run {report.end}" if report.end != "succeeded" else "",
            f"recovered by {failure.get('path')} ({train.why_not or 'no reason recorded'})"
            if failure.get("path") != "in_place" else "",
            "a survivor waited out the collective timeout" if waited else "",
            "the survivor's NCCL group was not aborted" if "generation 1's nccl group" not in logs else "",
        ]  # fmt: skip
        if why := [w for w in why if w]:
            problems.append("in_place_drill: " + "; ".join(why))
        else:
            result["in_place_drill"]["ok"] = True
    except Exception as exc:
        import traceback

        traceback.print_exc()
        result["in_place_drill"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
        problems.append("in_place_drill failed")

# ---- 5. the relaunch drill: in place off, node-1 killed, resumed from the in-memory snapshot of a CUDA model
from trainyard.events.ledger import Ledger  # noqa: E402

relaunched = {**spec, "recovery": {**spec.get("recovery", {}), "in_place": False}}
relaunched_path = spec_path.with_name("gpu_relaunch.yaml")
relaunched_path.write_text(yaml.safe_dump(relaunched, sort_keys=False))
began = time.monotonic()
try:
    report = run_drill(relaunched_path, Drill(fault="kill", step=30, node="node-1" if count == 2 else None), DATE)
    resumed = list(Ledger.in_dir(report.run_dir).events("train", "resumed"))
    last = resumed[-1] if resumed else {}
    lost = report.figures.get("lost_steps")
    result["relaunch_drill"] = {
        "ok": False, "end": report.end, "seconds": round(time.monotonic() - began, 1),
        "resumed_from": last.get("source"), "resumed_step": last.get("step"), "why": last.get("why"),
        **{k: report.figures.get(k) for k in ("detection_s", "resume_delay_s", "lost_steps", "restart_total_s",
                                              "restore_total_s", "replay_total_s")},
    }  # fmt: skip
    why = [
        f"run {report.end}" if report.end != "succeeded" else "",
        f"resumed from {last.get('source')} at step {last.get('step')}, not a snapshot" if last.get("source") != "snapshot" else "",
        f"{lost} steps lost" if lost is None or lost > 1 else "",
    ]  # fmt: skip
    if why := [w for w in why if w]:
        problems.append("relaunch_drill: " + "; ".join(why))
    else:
        result["relaunch_drill"]["ok"] = True
except Exception as exc:
    import traceback

    traceback.print_exc()
    result["relaunch_drill"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    problems.append("relaunch_drill failed")

done({**result, "ok": not problems, "problems": problems}, 0 if not problems else 1)
PY
