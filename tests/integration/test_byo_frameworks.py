"""The training scripts teams already have, under real ``airflow dags test`` runs on 2 local nodes: a Hugging Face
``Trainer`` (a tiny random GPT-2, nothing downloaded), a Lightning ``Trainer`` and a plain torchrun DDP script
that imports nothing of trainyard. Each loses node-1 to a ``kill`` drill mid-run and is relaunched: the adapters from their in-memory
snapshot of the step before the fault, the plain script from a checkpoint it wrote in its own format (which
trainyard adopted into its lineage); each finishes, passes the gate on its adopted checkpoint and is published.

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
    "torch": Path(__file__).parent / "scripts" / "plain_ddp.py",
}
DATE = "2026-11-24"


# steps, a save every, the kill's step. The adapters act the kill out themselves, exactly at its step; the plain
# script's is the supervisor's, from outside once its own saves show the step, so it trains longer and slower.
SHAPES = {"hf": (12, 4, 6), "lightning": (12, 4, 6), "torch": (120, 10, 30)}


def spec(kind: str) -> str:
    """The shipped nightly spec with the user's script: 2 nodes (1 may go), node-1 killed mid-run."""
    steps, every, kill = SHAPES[kind]
    spec = copy.deepcopy(BASE)
    spec.pop("schedule")
    spec["pressure_test"] = {"enabled": False}
    spec["training"] = {
        "entrypoint": str(SCRIPTS[kind]), "args": {}, "max_steps": steps, "checkpoint_every": every,
        "global_batch": 8, "micro_batch": 2, "heartbeat_timeout_s": 60,
    }  # fmt: skip
    spec["recovery"]["backoff_s"] = 0.5
    spec["drills"] = [{"fault": "kill", "step": kill, "node": "node-1"}]
    return yaml.safe_dump(spec, sort_keys=False)


def resumed_event(ledger: Ledger, run: Path) -> int:
    """The adapters resume from their in-memory snapshot, newer than the checkpoint (adopted from the framework's
    save) trainyard chose, and say so."""
    [resumed] = ledger.events("train", "resumed")
    assert resumed["source"] == "snapshot", resumed
    assert resumed["why"] == f"the snapshot of step {resumed['step']} is newer than the checkpoint of step 4", resumed
    assert not Path(resumed["path"]).exists(), resumed  # node memory, dropped with the train stage
    return int(resumed["step"])


def resumed_in_log(ledger: Ledger, run: Path) -> int:
    """The plain script says in its own log the step it starts at (after the newest of its own files)."""
    log = (run / "attempt-2" / "node-0.log").read_text()
    return int(log.split("starting at step ")[1].split()[0]) - 1


RESUMED = {"hf": resumed_event, "lightning": resumed_event, "torch": resumed_in_log}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    home = tmp_path_factory.mktemp("byo")
    dags = home / "dags"
    (dags / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", dags / "pipelines.py")
    for kind in SCRIPTS:
        (dags / "pipelines" / f"byo_{kind}.yaml").write_text(spec(kind))
    env = airflow_env(home, dags)
    subprocess.run(["trainyard", "demo-data", "--date", DATE], env=env, check=True, capture_output=True, timeout=120)
    return env


@pytest.mark.parametrize("kind", list(SCRIPTS))
def test_a_users_script_recovers_from_its_own_checkpoint_and_is_published(env: dict[str, str], kind: str) -> None:
    dag_id = f"byo_{kind}"
    done = airflow(env, "dags", "test", dag_id, DATE)
    out = done.stdout + done.stderr
    states = {t: s for t, (s, _) in task_states(env, dag_id, DATE).items()}
    assert run_state(env, dag_id, DATE) == "success", (states, out[-4000:])
    ledger = Ledger.in_dir(run_folder(env, dag_id, DATE))
    [fired] = ledger.events("train", "drill_fired")  # once: by the adapter, or from outside
    assert fired["fault"] == "kill" and fired["node"] == "node-1"
    [decision] = ledger.events("train", "decision")
    assert decision["action"] == "scale_down", decision
    # The adapters set the accumulation from TRAINYARD_GLOBAL_BATCH (batch_followed); the plain script keeps its own.
    kept = "global batch 8 kept" if kind != "torch" else "global batch changes from"
    assert kept in decision["reason"], decision["reason"]
    first, second = ledger.events("train", "attempt_start")
    assert first["resume_from"] == "none" and second["resume_from"] == "latest"
    steps, every, kill = SHAPES[kind]
    resumed = RESUMED[kind](ledger, run_folder(env, dag_id, DATE))
    if kind == "torch":  # from its own save of the kill's step or the last before it
        assert kill // every * every <= resumed < steps
    else:  # the adapters act the kill out at the start of its step: the step before was trained and snapshotted
        assert resumed == kill - 1
    [checked] = ledger.events("check_checkpoint", "checkpoint_checked")
    # The adapters report the loss, so the metric gate holds it to the spec; a script that reports none is
    # gated on its checkpoint alone, and the gate says so.
    notes = " ".join(checked.get("notes") or [])
    assert ("loss expectations not checked" in notes) if kind == "torch" else not notes, checked
    [gate] = ledger.events("check_checkpoint", "stage_end")
    assert gate["result"]["step"] == steps, gate
    if kind != "torch":  # the gate and publish take the adopted checkpoint of the last step, never a snapshot
        assert read_manifest(Path(checked["path"]))["framework"] == kind, checked
    assert states["publish"] == "success", states
