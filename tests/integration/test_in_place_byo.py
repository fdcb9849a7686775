"""In place for a script trainyard did not write the loop of: ``examples/byo_train.py`` trains through
``runtime.elastic_group``, so losing a node costs it a regroup, not a relaunch, exactly as the reference
workload. The node is killed by hand (SIGKILL of its process, as a person or the kernel would), not by a
drill: a script need not act out trainyard's drills."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_recovery import events
from waiting import WaitedTooLong, wait_for

from trainyard.backends.local.launcher import LocalLauncher
from trainyard.checkpoint.format import step_of
from trainyard.pipeline import stages
from trainyard.pipeline.results import TrainResult
from trainyard.pipeline.run import Run, open_run
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.figures import recovery_figures

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes: {{count: 3, min: 2}}
pressure_test: {{enabled: false}}
training:
  entrypoint: {script}
  args: {{}}
  max_steps: {steps}
  global_batch: 6
  micro_batch: 2
  checkpoint_every: 200
  heartbeat_timeout_s: 10
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
recovery: {{max_attempts: 2, backoff_s: 0.2, in_place: true, rejoin: false}}
"""


def kill_when(launcher: LocalLauncher, node: str, root: Path, step: int, timeout_s: float = 120.0) -> threading.Thread:
    """SIGKILL ``node``'s process once a checkpoint of ``step`` or later is in ``root`` (well under way)."""

    def due() -> bool:
        saved = [step_of(p) or 0 for p in root.glob("step_*")] if root.is_dir() else []
        return max(saved, default=0) >= step and bool(launcher.active) and node in launcher.active[0].procs

    def kill() -> None:
        with contextlib.suppress(WaitedTooLong):  # never due: the test's own assertions say what went wrong
            wait_for(due, timeout_s, f"a save of step {step}", every_s=0.02)
            os.kill(launcher.active[0].procs[node].pid, signal.SIGKILL)

    thread = threading.Thread(target=kill, daemon=True)
    thread.start()
    return thread


def train_killing_node_1(tmp_path: Path, script: Path, steps: int) -> tuple[Run, TrainResult]:
    """The train stage of ``script`` on 3 nodes, node-1 killed by hand once step 400 is saved."""
    write_synthetic_corpus(tmp_path / "cold", shards=2, tokens_per_shard=1024)
    spec = tmp_path / "byo.yaml"
    spec.write_text(SPEC.format(root=tmp_path, script=script, steps=steps))
    run = open_run(spec, "byo", f"byo-{time.monotonic_ns()}", "2026-12-03")
    stages.stage_dataset(run)
    launcher = LocalLauncher()
    killer = kill_when(launcher, "node-1", run.checkpoint_root, 400)
    result = stages.train(run, ["node-0", "node-1", "node-2"], launcher=launcher)
    killer.join(timeout=1)
    return run, result


def test_a_script_that_trains_through_the_elastic_group_regroups_in_place(tmp_path: Path) -> None:
    run, result = train_killing_node_1(tmp_path, ROOT / "examples" / "byo_train.py", 3000)
    assert result.attempts == 1 and result.last_step == 3000  # no relaunch
    [path] = events(run, "recovery_path")
    assert path["in_place"] is True
    [decision] = events(run, "decision")
    assert decision["action"] == "regroup" and decision["path"] == "in_place"
    assert decision["left_out"] == ["node-1"] and decision["new_nodes"] == ["node-0", "node-2"]
    [regrouped] = events(run, "regrouped")
    assert regrouped["generation"] == 2 and regrouped["world_size"] == 2
    [failure] = recovery_figures(run.ledger)["failures"]
    assert failure["path"] == "in_place" and failure["lost_steps"] <= 1
    assert stages.check_checkpoint(run, result.checkpoint, 3000).step == 3000


# The README's "Bring your own training script" loop: trainyard's helpers, torch's own world, no elastic group.
# AdamW, handed over bare beside its model: the runtime saves and resumes its moments. Rank 0 writes the moments
# it saved at each checkpoint and those it resumed with, and its first loss after a resume.
FIXED_WORLD = """
import json, pathlib
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from trainyard import runtime

ctx = runtime.context()
dist.init_process_group("gloo")  # env://: the launch's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
module = torch.nn.Linear(1, 1)
optimizer = torch.optim.AdamW(module.parameters(), lr=0.01)
state = {"model": module, "optimizer": optimizer}
start = runtime.load_latest(state, ctx=ctx)
out = pathlib.Path(ctx.checkpoint_dir) / "moments"

def record(name, value):
    if dist.get_rank() == 0:
        out.mkdir(exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(value))

def moments():
    kept = [optimizer.state.get(p, {}) for p in module.parameters()]
    return [[s[k].reshape(-1).tolist() for k in ("exp_avg", "exp_avg_sq")] if s else [] for s in kept]

if start:
    record(f"resumed-{start}", moments())
model = DDP(module)
checkpoints = runtime.Checkpointer(ctx)
for step in range(start + 1, ctx.max_steps + 1):
    x = torch.randn(32, 1, generator=torch.Generator().manual_seed(step * 101 + dist.get_rank()))
    loss = torch.nn.functional.mse_loss(model(x), 3 * x + 1)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    runtime.heartbeat(step, {"loss": loss.item()})
    if start and step == start + 1:
        record("first-loss", loss.item())
    if ctx.should_checkpoint(step):
        checkpoints.save(step, state, {"loss": loss.item()})
        record(f"saved-{step}", moments())
        record(f"loss-{step}", loss.item())
checkpoints.close()
runtime.finish(ctx.max_steps, {"loss": loss.item()})
del model
dist.destroy_process_group()
"""


def test_a_script_without_the_elastic_group_is_relaunched_and_the_run_says_why(tmp_path: Path) -> None:
    """It trains under the in-place launch as a fixed world; losing a node relaunches it from its checkpoint,
    and the decision and the run's recovery_path name the reason."""
    script = tmp_path / "fixed_world.py"
    script.write_text(FIXED_WORLD)
    run, result = train_killing_node_1(tmp_path, script, 2000)
    assert result.attempts == 2 and result.last_step == 2000
    first, then = events(run, "recovery_path")
    assert first["in_place"] is True and then["in_place"] is False
    assert "trainyard.runtime.elastic_group" in then["why_not"]
    [decision] = events(run, "decision")
    assert decision["action"] in ("retry", "scale_down") and "path" not in decision
    assert "relaunch, not in place: its ranks never formed a group" in decision["reason"]
    [resumed] = [e for e in run.ledger.events("train", "resumed") if e.get("step")]
    assert resumed["step"] >= 400
    # AdamW resumed with the moments it saved (a bare optimizer's state_dict() would have resumed none), and
    # its loss goes on from where the checkpoint left it.
    moments = run.checkpoint_root / "moments"
    saved = json.loads((moments / f"saved-{resumed['step']}.json").read_text())
    assert saved and all(saved) and json.loads((moments / f"resumed-{resumed['step']}.json").read_text()) == saved
    checkpoint_loss = json.loads((moments / f"loss-{resumed['step']}.json").read_text())
    assert json.loads((moments / "first-loss.json").read_text()) < 3 * checkpoint_loss + 1e-6
