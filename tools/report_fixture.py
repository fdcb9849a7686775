"""Make the report fixture run (tests/fixtures/runs/): one real run of the stages on a tiny spec, trimmed.

The run trains 2 nodes, loses node-1 at step 10 (relaunched on node-0 alone), and its final checkpoint is
damaged before the gate, so ``check_checkpoint`` fails with a long error and ``publish`` never runs: every
section of the report has something to show. Run ``python tools/report_fixture.py`` to regenerate it.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from trainyard.errors import CheckpointInvalid
from trainyard.pipeline import stages
from trainyard.pipeline.run import open_run
from trainyard.protocol.shards import write_synthetic_corpus

DAG_ID = "report_fixture"
RUN_ID = "manual__2026-12-01T02:00:00+00:00"
FIXTURE = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "runs"
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes: {{count: 2, min: 1}}
pressure_test: {{duration_s: 1, matmul_size: 64, membw_mb: 4, disk_mb: 4, collective_sizes_kb: [16]}}
training:
  args: {{seq-len: 32, d-model: 32, n-heads: 2, lr: 0.01}}
  max_steps: 30   # the trigger's Param makes it 24: the report shows the override
  global_batch: 8
  micro_batch: 2
  checkpoint_every: 8
  progress_every_s: 0.3   # a few steps per event: the charts show each event's min-max band
  heartbeat_timeout_s: 20
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
recovery: {{max_attempts: 3, backoff_s: 0.2, in_place: false}}
drills: [{{fault: kill, node: node-1, step: 10}}]
"""


def main() -> int:
    root = Path(tempfile.mkdtemp(prefix="trainyard-fixture-"))
    write_synthetic_corpus(root / "cold", shards=2, tokens_per_shard=16_384)
    spec = root / f"{DAG_ID}.yaml"
    spec.write_text(SPEC.format(root=root))
    run = open_run(spec, DAG_ID, RUN_ID, "2026-12-01", params={"max_steps": 24})
    stages.stage_dataset(run)
    stages.check_dataset(run)
    chosen = stages.burn_in(run)
    trained = stages.train(run, chosen.healthy, spares=chosen.spare)
    manifest = Path(str(trained.checkpoint)) / "manifest.json"
    victim = next(p for p in sorted(manifest.parent.iterdir()) if p.name != "manifest.json" and p.is_file())
    victim.write_bytes(victim.read_bytes()[:-8] + b"damaged!")  # the gate's hash check must catch it
    try:
        stages.check_checkpoint(run, trained.checkpoint, trained.target_step)
    except CheckpointInvalid as exc:
        print("gate failed as meant:", exc)
    stages.report(run)
    print(run.dir)
    if "--keep" not in sys.argv:
        return 0
    target = FIXTURE / DAG_ID / run.dir.name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(run.dir, target, symlinks=True)
    print("copied to", target)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
