"""Issue 31: a torchrun script that makes no trainyard calls at all (``scripts/plain_ddp.py``: plain DDP, its own
``torch.save`` checkpoints, its own batch size) under the blocking supervisor on 2 local nodes.

It writes no heartbeats, so it is never called hung, and the run says once that hang detection is off; a ``kill``
drill is acted out from outside (the supervisor SIGKILLs node-1's processes once the script's own checkpoints
show the step: the only progress it reports); the run scales down and the script resumes from its own
checkpoint. The gate is not asserted: adopting its checkpoints is another change."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_recovery import events

from trainyard.pipeline import stages
from trainyard.pipeline.run import open_run
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.figures import recovery_figures
from trainyard.report.summary import format_summary, summarize

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).resolve().parent / "scripts" / "plain_ddp.py"
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes: {{count: 2, min: 1}}
pressure_test: {{enabled: false}}
training:
  entrypoint: {script}
  args: {{}}
  max_steps: 120
  global_batch: 2
  micro_batch: 1
  checkpoint_every: 10
  heartbeat_timeout_s: 1
  startup_grace_s: 2
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
recovery: {{max_attempts: 3, backoff_s: 0.2, in_place: false}}
drills: [{{fault: kill, node: node-1, step: 30}}]
"""


def test_a_script_without_trainyard_calls_is_supervised_and_drilled_from_outside(tmp_path: Path) -> None:
    write_synthetic_corpus(tmp_path / "cold", shards=1, tokens_per_shard=1024)
    spec = tmp_path / "byo.yaml"
    spec.write_text(SPEC.format(root=tmp_path, script=SCRIPT))
    run = open_run(spec, "byo", f"byo-{time.monotonic_ns()}", "2026-12-03")
    stages.stage_dataset(run)
    result = stages.train(run, ["node-0", "node-1"])

    # Trained for far longer than the 1 s timeout and the 2 s grace without a beat: never called hung.
    assert [e["kind"] for e in events(run, "failure_classified")] == ["node_lost"]
    [off] = events(run, "hang_detection_off")  # once a run, not once an attempt
    assert "writes no heartbeats" in off["reason"] and "trainyard.runtime.heartbeat(step, metrics)" in off["fix"]

    # The kill was acted out from outside, by the script's own checkpoints' step.
    [fired] = events(run, "drill_fired")
    assert (fired["fault"], fired["node"], fired["attempt"]) == ("kill", "node-1", 1) and fired["step"] >= 30
    assert events(run, "drill_refused") == []
    [end, _] = events(run, "attempt_end")
    assert end["trigger"] == "crash" and "node-1 exited" in end["reason"]

    # Scaled down; the decision does not claim a global batch the script never read.
    [decision] = events(run, "decision")
    assert decision["action"] == "scale_down" and decision["new_nodes"] == ["node-0"]
    assert "global batch changes from 2 to 1" in decision["reason"] and "kept" not in decision["reason"]
    assert result.attempts == 2

    # The script resumed from its own checkpoint at or after the drill's step.
    log = (run.dir / "attempt-2" / "node-0.log").read_text()
    started = int(log.split("starting at step ")[1].split()[0])
    assert started > 30, log[-2000:]

    summary = summarize(run.ledger)
    assert summary["nodes_used"] == ["node-0"]
    # It printed no step: the figures that count steps are unknown, with why, never 0 (issue 51).
    assert summary["steps_trained"] is None and "reports no steps" in summary["steps_trained_why"]
    assert summary["recovery"]["productive_s"] is None and "reports no steps" in summary["recovery"]["productive_why"]
    text = format_summary(summary)
    assert "lost steps unknown (the script reports no steps" in text
    assert "steps trained:    unknown (the script reports no steps" in text
    assert "hang detection:   off: the training script writes no heartbeats" in text


def test_a_script_that_prints_its_steps_gets_figures_from_its_log(tmp_path: Path) -> None:
    """Issue 51: the same script printing nanoGPT's ``iter N: loss X`` line. The supervisor reads the nodes' logs
    (no heartbeats): the ledger gets ``step`` events marked ``source: log``, and the figures are numbers."""
    write_synthetic_corpus(tmp_path / "cold", shards=1, tokens_per_shard=1024)
    spec = tmp_path / "byo.yaml"
    text = SPEC.format(root=tmp_path, script=SCRIPT).replace("args: {}", "args: {print-steps: true}")
    spec.write_text(text.replace("max_steps: 120", "max_steps: 80"))
    run = open_run(spec, "byo", f"byo-log-{time.monotonic_ns()}", "2026-12-03")
    stages.stage_dataset(run)
    stages.train(run, ["node-0", "node-1"])

    logged = [e for e in events(run, "step") if e.get("source") == "log"]
    assert {e["attempt"] for e in logged} == {1, 2}, logged
    assert logged[-1]["step"] == 80 and all(e["node"] == "node-0" for e in logged)
    assert all(isinstance(e.get("loss"), float) for e in logged)
    [start2] = [e for e in events(run, "attempt_start") if e["attempt"] == 2]
    assert isinstance(start2["resume_step"], int)  # the orchestrator's checkpoint, the resumed step's word

    summary = summarize(run.ledger)
    assert summary["steps_trained"] == 80 and summary["last_step"] == 80
    figures = summary["recovery"]
    assert isinstance(figures["lost_steps"], int) and figures["lost_steps"] >= 0
    assert figures["resume_delay_s"] > 0 and figures["productive_s"] > 0
    after = recovery_figures(run.ledger)  # the stage's wall time is known once it ended: ETTR too
    assert 0 < after["ettr"] <= 1 and after["failures"][0]["resumed_by"] == "orchestrator"
    # A script that never said it reads the batch settings: unknown, not "does not read".
    [decision] = events(run, "decision")
    assert "global batch unknown" in decision["reason"] and "does not read" not in decision["reason"]
    text = format_summary(summary)
    assert "steps trained:    80 (step" in text and "lost steps unknown" not in text
    assert "recovery path:    relaunch: recovery.in_place is false" in text


def test_a_log_silent_past_log_silence_s_is_a_hang_and_the_run_recovers(tmp_path: Path) -> None:
    """Issue 51: hang detection for a script that writes no heartbeats, from its log. It stalls at step 35 (its
    processes alive, silent); with ``training.log_silence_s: 2`` the attempt is called hung, no node blamed (the
    logs cannot say which stalled the others), and relaunched from the script's own checkpoint."""
    write_synthetic_corpus(tmp_path / "cold", shards=1, tokens_per_shard=1024)
    spec = tmp_path / "byo.yaml"
    text = SPEC.format(root=tmp_path, script=SCRIPT).replace("args: {}", "args: {print-steps: true, stall-at: 35}")
    text = text.replace("max_steps: 120", "max_steps: 50").replace("  startup_grace_s: 2\n", "  log_silence_s: 2\n")
    text = text.replace("nodes: {count: 2, min: 1}", "nodes: {count: 1}")  # no node is blamed: one is enough
    spec.write_text(text.replace("drills: [{fault: kill, node: node-1, step: 30}]\n", ""))
    run = open_run(spec, "byo", f"byo-silent-{time.monotonic_ns()}", "2026-12-03")
    stages.stage_dataset(run)
    result = stages.train(run, ["node-0"])

    [hang] = events(run, "failure_classified")
    assert hang["kind"] == "hang" and hang["culprits"] == [], hang
    assert "showed no new step for" in hang["evidence"] and "iter 34" in hang["evidence"], hang["evidence"]
    assert result.attempts == 2
    log = (run.dir / "attempt-2" / "node-0.log").read_text()
    assert int(log.split("starting at step ")[1].split()[0]) == 31, log[-2000:]  # after its save of step 30
    assert summarize(run.ledger)["steps_trained"] == 50


def test_trainyard_drill_acts_out_a_kill_for_a_script_without_trainyard_calls(tmp_path: Path) -> None:
    """The CLI rehearsal of a fault, for a script that does not act drills out: the kill comes from outside.
    (A fault only the process can act out is said not acted out, with why: ``tests/unit/test_outside_drills``.)"""
    write_synthetic_corpus(tmp_path / "cold", shards=1, tokens_per_shard=1024)
    spec = tmp_path / "byo.yaml"
    spec.write_text(SPEC.format(root=tmp_path, script=SCRIPT).split("drills:")[0])
    done = subprocess.run(
        [str(Path(sys.executable).parent / "trainyard"), "drill", str(spec), "--fault", "kill", "--node", "node-1",
         "--step", "30", "--date", "2026-12-03"],
        env={**os.environ, "TRAINYARD_HOME": str(tmp_path / "home")}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert "expected: scale_down, run succeeded -> OK" in done.stdout, done.stdout
