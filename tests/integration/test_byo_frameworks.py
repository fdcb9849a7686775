"""The training scripts teams already have, under real ``airflow dags test`` runs on 2 local nodes: a Hugging Face
``Trainer`` (a tiny random GPT-2, nothing downloaded), a Lightning ``Trainer`` and a plain torchrun DDP script
that imports nothing of trainyard. Each loses node-1 to a ``kill`` drill mid-run, is relaunched from a checkpoint
it wrote in its own format (which trainyard adopted into its lineage), finishes, passes the gate and is published.

One DAG run each, about a minute apiece on 2 cores (framework imports in every process, two attempts).
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from airflow_helpers import ROOT, airflow, airflow_env, run_folder, run_state, task_states

from trainyard.checkpoint.format import read_manifest
from trainyard.events.ledger import Ledger

pytestmark = pytest.mark.integration

BASE = yaml.safe_load((ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml").read_text())
SCRIPTS = {
    "hf": ROOT / "examples" / "byo_hf.py",
    "lightning": ROOT / "examples" / "byo_lightning.py",
    "torch": Path(__file__).parent / "user_scripts" / "plain_ddp.py",
}
DATE = "2026-11-24"


def spec(script: Path) -> str:
    """The shipped nightly spec with the user's script: 2 nodes (1 may go), 12 steps, a save every 4, node-1
    killed at step 6."""
    spec = copy.deepcopy(BASE)
    spec.pop("schedule")
    spec["pressure_test"] = {"enabled": False}
    spec["training"] = {
        "entrypoint": str(script), "args": {}, "max_steps": 12, "checkpoint_every": 4,
        "global_batch": 8, "micro_batch": 2, "heartbeat_timeout_s": 60,
    }  # fmt: skip
    spec["recovery"]["backoff_s"] = 0.5
    spec["drills"] = [{"fault": "kill", "step": 6, "node": "node-1"}]
    return yaml.safe_dump(spec, sort_keys=False)


def resumed_event(ledger: Ledger, run: Path) -> int:
    """The adapters name the checkpoint they resume from (one trainyard adopted from the framework's save)."""
    [resumed] = ledger.events("train", "resumed")
    manifest = read_manifest(Path(resumed["path"]))
    assert manifest["framework"] in ("hf", "lightning") and manifest["step"] == resumed["step"], manifest
    return int(resumed["step"])


def resumed_in_log(ledger: Ledger, run: Path) -> int:
    """The plain script says in its own log which of its files it resumed from."""
    [line] = [x for log in run.glob("**/attempt-2*/**/*.log") for x in log.read_text().splitlines() if "resumed" in x]
    return int(line.rsplit(" ", 1)[1])


RESUMED = {"hf": resumed_event, "lightning": resumed_event, "torch": resumed_in_log}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("byo")
    dags = home / "dags"
    (dags / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", dags / "pipelines.py")
    for kind, script in SCRIPTS.items():
        (dags / "pipelines" / f"byo_{kind}.yaml").write_text(spec(script))
    env = airflow_env(home, dags)
    subprocess.run(["trainyard", "demo-data", "--date", DATE], env=env, check=True, capture_output=True, timeout=120)
    return env


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_a_users_script_recovers_from_its_own_checkpoint_and_is_published(env: dict[str, str], kind: str) -> None:
    dag_id = f"byo_{kind}"
    done = airflow(env, "dags", "test", dag_id, DATE)
    out = done.stdout + done.stderr
    states = {t: s for t, (s, _) in task_states(env, dag_id, DATE).items()}
    (Path(env["AIRFLOW_HOME"]) / f"{dag_id}.out").write_text(out)
    assert run_state(env, dag_id, DATE) == "success", (states, out[-4000:])
    ledger = Ledger.in_dir(run_folder(env, dag_id, DATE))
    [fired] = ledger.events("train", "drill_fired")
    assert fired["fault"] == "kill" and fired["node"] == "node-1"
    [decision] = ledger.events("train", "decision")
    assert decision["action"] in ("retry", "scale_down"), decision
    first, second = ledger.events("train", "attempt_start")
    assert first["resume_from"] == "none" and second["resume_from"] == "latest"
    assert 4 <= RESUMED[kind](ledger, run_folder(env, dag_id, DATE)) < 6  # from its own save of step 4
    [gate] = ledger.events("check_checkpoint", "stage_end")
    assert gate["result"]["step"] == 12, gate
    assert states["publish"] == "success", states
