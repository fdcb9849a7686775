"""A script run as its author wrote it (issue 51): real torchrun agents on 2 local nodes start a tiny ``train.py``
that reads a file relative to its own folder and writes down its argv, folder and variables. The spec gives its
command line in order (a positional config file, ``--key=value``, booleans as ``True/False``, a literal flag), its
variables, and a resume flag that only a relaunched attempt resuming from a checkpoint gets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from waiting import wait_for

from trainyard.backends.local.launcher import LocalLauncher
from trainyard.checkpoint import registry
from trainyard.pipeline.run import Run, load_run, open_run
from trainyard.pipeline.train import _plan
from trainyard.recovery.state import Course

pytestmark = pytest.mark.integration

SCRIPT = """\
import json, os, pathlib, sys
config = open("configurator.py").read()  # relative to where it runs, as nanoGPT's train.py reads it
out = pathlib.Path(os.environ["ARGV_OUT"]) / f"a{os.environ['TRAINYARD_ATTEMPT']}-r{os.environ['RANK']}.json"
out.write_text(json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "mode": os.environ.get("WANDB_MODE"),
                           "config": config}))
"""

SPEC = """\
runs_root: file://{root}/runs
dataset: {{source: "file:///data/tokens", name: tokens, hot: "file://{root}/hot"}}
checkpoint: {{hot: "file://{root}/ckpt"}}
nodes: {{count: 2}}
pressure_test: {{enabled: false}}
training:
  entrypoint: repo/train.py
  args: [config/train_tiny.py, {{n_layer: 2, compile: false, bias: true}}, --always]
  args_form: "--key=value"
  booleans: True/False
  resume_args: [--init_from=resume, "--ckpt={{{{ resume_from }}}}"]
  env: {{WANDB_MODE: offline, ARGV_OUT: "{{{{ run_dir }}}}"}}
  max_steps: 10
  global_batch: 8
  micro_batch: 2
  checkpoint_every: 5
"""


def attempt(run: Run, number: int, resume_from: str) -> list[dict[str, str]]:
    """Launch the attempt's plan on real torchrun agents; what each rank wrote down."""
    launcher = LocalLauncher()
    handle = launcher.launch(_plan(run, number, Course(["node-0", "node-1"], 2, resume_from), 10))
    try:
        wait_for(lambda: launcher.poll(handle).state != "running", 120, "both nodes to end", every_s=0.2)
        assert launcher.poll(handle).state == "succeeded", [p.read_text()[-800:] for p in handle.logs.values()]
    finally:
        launcher.cancel(handle)
        launcher.close()
    return [json.loads((run.dir / f"a{number}-r{rank}.json").read_text()) for rank in (0, 1)]


def test_the_script_gets_its_command_line_folder_and_variables_and_its_resume_flag(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "train.py").write_text(SCRIPT)
    (repo / "configurator.py").write_text("# the script's own helper\n")
    spec = tmp_path / "pipeline.yaml"
    spec.write_text(SPEC.format(root=tmp_path))
    opened = open_run(spec, "nano", "manual__1", "2026-01-02")
    run = load_run(opened.dir / "spec.json")  # as every task reads it: the pinned spec
    written = ["config/train_tiny.py", "--n_layer=2", "--compile=False", "--bias=True", "--always"]

    first = attempt(run, 1, "none")  # a fresh start: no resume flag (the script would fail without a checkpoint)
    for rank in first:
        assert rank["argv"] == written
        assert rank["cwd"] == str(repo) and rank["config"].startswith("# the script's own")
        assert rank["mode"] == "offline"

    ckpt = run.checkpoint_root / "step_000005"  # the lineage's newest, as after a save and a fault
    ckpt.mkdir(parents=True)
    registry.promote(run.checkpoint_root, ckpt, run.ledger)  # as the watcher does: resume trusts the ledger, not LATEST
    relaunched = attempt(run, 2, "latest")  # what the controller gives an attempt after a fault
    for rank in relaunched:
        assert rank["argv"] == [*written, "--init_from=resume", f"--ckpt={ckpt}"]
        assert rank["cwd"] == str(repo)
