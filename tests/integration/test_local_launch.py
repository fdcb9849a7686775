"""The local launcher with real torchrun agents: 3 nodes, resume on fewer, cancel, kill, BYO script."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from waiting import wait_for

from trainyard.backends.base import LaunchPlan
from trainyard.backends.local.launcher import LocalLauncher
from trainyard.checkpoint.format import latest_valid, read_manifest, verify
from trainyard.events.ledger import Ledger
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.attempt import run_attempt

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--seq-len", "32", "--d-model", "32", "--n-heads", "2", "--lr", "0.01"]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    write_synthetic_corpus(folder, shards=2, tokens_per_shard=16_384)
    return folder


def plan(
    root: Path,
    data: Path,
    nodes: int,
    max_steps: int,
    resume: str = "none",
    attempt: int = 1,
    entrypoint: str = "trainyard.workload",
    args: list[str] = MODEL,
) -> LaunchPlan:
    return LaunchPlan(
        run_id=root.name,
        attempt=attempt,
        nodes=[f"node-{i}" for i in range(nodes)],
        procs_per_node=1,
        entrypoint=entrypoint,
        args=args,
        log_dir=root / f"attempt-{attempt}",
        train_env=TrainEnv(
            data_dir=data,
            checkpoint_dir=root / "ckpt",
            max_steps=max_steps,
            resume_from=resume,
            heartbeat_dir=root / f"hb-{attempt}",
            events_dir=Ledger.in_dir(root).events_dir,
            run_id=root.name,
            attempt=attempt,
            global_batch=12,
            micro_batch=2,
            checkpoint_every=4,
            progress_every_s=0,  # losses are compared step by step
        ),
    )


def supervise(p: LaunchPlan) -> None:
    run_attempt(LocalLauncher(), p, Path(p.env["TRAINYARD_HEARTBEAT_DIR"]), 60.0, Ledger.in_dir(p.log_dir.parent), 0.2)


def losses(root: Path) -> dict[int, float]:
    return {e["step"]: e["loss"] for e in Ledger.in_dir(root).events("train", "step")}


def test_three_nodes_converge_and_resume_on_two(tmp_path: Path, data: Path) -> None:
    whole = tmp_path / "whole"
    supervise(plan(whole, data, nodes=3, max_steps=12))
    reference = losses(whole)
    assert sorted(reference) == list(range(1, 13)) and reference[12] < reference[1]
    assert len(read_heartbeats(whole / "hb-1")) == 3

    # What three nodes had saved by step 8 is the whole run's first two checkpoints (the learning rate and the
    # data order depend on the step only): one 3-node launch fewer than training a separate run to step 8.
    split = tmp_path / "split"
    for name in ("step_000004", "step_000008"):
        shutil.copytree(whole / "ckpt" / name, split / "ckpt" / name)
    supervise(plan(split, data, nodes=2, max_steps=12, resume="latest", attempt=2))
    resumed = losses(split)
    assert sorted(resumed) == list(range(9, 13))  # resumed from the three nodes' step 8, not from scratch
    # The data order and the global batch do not depend on the world size: the curve continues.
    for step in range(9, 13):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-4), step
    final = latest_valid(split / "ckpt")
    assert verify(final) == [] and read_manifest(final)["world_size"] == 2 and read_manifest(final)["step"] == 12


def _tree(pid: int) -> list[int]:
    try:
        return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _wait_for_step(hb: Path, step: int, timeout: float = 60, nodes: int = 2) -> None:
    def there() -> bool:
        beats = read_heartbeats(hb)
        return len(beats) == nodes and min(b["step"] for b in beats.values()) >= step

    wait_for(there, timeout, f"{nodes} node(s)' heartbeats at step {step} in {hb}", every_s=0.1)


def test_cancel_leaves_no_process_behind(tmp_path: Path, data: Path) -> None:
    launcher = LocalLauncher()
    handle = launcher.launch(plan(tmp_path, data, nodes=2, max_steps=100_000))
    _wait_for_step(tmp_path / "hb-1", 2)
    pids = [pid for proc in handle.procs.values() for pid in _tree(proc.pid)]
    assert len(pids) >= 4  # two agents and their workers
    # Each agent is a fork of the zygote, and so is its worker: of the agent's own fork server, so the node's
    # process tree holds it as a torchrun worker's would be.
    assert launcher.zygote is not None
    for proc in handle.procs.values():
        agent = psutil.Process(proc.pid)
        assert agent.ppid() == launcher.zygote.proc.pid and "trainyard.backends.local.zygote" in agent.cmdline()
        [worker] = [w for server in agent.children() for w in server.children()]
        assert worker.cmdline() == agent.cmdline()  # a fork, not a new interpreter
    groups = {os.getpgid(proc.pid) for proc in handle.procs.values()}
    launcher.cancel_all()
    assert _alive(pids) == [] and launcher.active == []
    for group in groups:  # nothing is left in the agents' process groups either (once the zygote reaped them)
        wait_for(lambda: not _group_alive(group), 10, f"process group {group} to empty")  # noqa: B023


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False


def test_a_launcher_let_go_takes_its_zygote_with_it(tmp_path: Path, data: Path) -> None:
    # A process that makes one launcher after another (a test worker, a long-lived task process) must not keep a
    # zygote (torch imported, ~270 MB) alive per launcher: half the suite once held 8 GB of them.
    import gc

    launcher = LocalLauncher()
    handle = launcher.launch(plan(tmp_path, data, nodes=1, max_steps=100_000))
    _wait_for_step(tmp_path / "hb-1", 1, nodes=1)
    assert launcher.zygote is not None
    zygote = psutil.Process(launcher.zygote.proc.pid)
    launcher.cancel_all()
    del launcher, handle
    gc.collect()
    _, alive = psutil.wait_procs([zygote], timeout=30)
    assert alive == [], "the zygote outlived its launcher"


def test_killing_the_launching_process_takes_the_nodes_with_it(tmp_path: Path, data: Path) -> None:
    p = plan(tmp_path, data, nodes=2, max_steps=100_000)
    script = textwrap.dedent("""
        import json, sys, time, pickle
        from trainyard.backends.local.launcher import LocalLauncher
        handle = LocalLauncher().launch(pickle.loads(bytes.fromhex(sys.argv[1])))
        print(json.dumps([p.pid for p in handle.procs.values()]), flush=True)
        time.sleep(600)
    """)
    import pickle

    parent = subprocess.Popen([sys.executable, "-c", script, pickle.dumps(p).hex()], stdout=subprocess.PIPE, text=True)
    agents = json.loads(parent.stdout.readline())
    _wait_for_step(tmp_path / "hb-1", 1)
    pids = [pid for agent in agents for pid in _tree(agent)]
    parent.send_signal(signal.SIGKILL)  # like an Airflow worker killed outright: no finally runs
    parent.wait()
    wait_for(lambda: _alive(pids) == [], 30, "the nodes to end with the process that launched them", every_s=0.2)


def test_a_user_script_is_a_first_class_entrypoint(tmp_path: Path, data: Path) -> None:
    script = str(ROOT / "examples" / "byo_train.py")
    launcher = LocalLauncher()
    handle = launcher.launch(plan(tmp_path / "tree", data, nodes=1, max_steps=100_000, entrypoint=script, args=[]))
    _wait_for_step(tmp_path / "tree" / "hb-1", 1, nodes=1)
    # The agent is torch's code, forked from the zygote; the user's script is a fork too, of the agent's fork server
    # (the zygote imported its framework: training.framework auto read torch from it).
    agent = psutil.Process(handle.procs["node-0"].pid)
    [worker] = [w for server in agent.children() for w in server.children()]
    assert worker.cmdline() == agent.cmdline() and "--script" in agent.cmdline()  # a fork, not a new interpreter
    launcher.cancel_all()

    supervise(plan(tmp_path, data, nodes=2, max_steps=8, entrypoint=script, args=[]))
    run = losses(tmp_path)
    assert sorted(run) == list(range(1, 9)) and run[8] < run[1]
    assert [p.name for p in sorted((tmp_path / "ckpt").glob("step_*"))] == ["step_000004", "step_000008"]
    assert verify(tmp_path / "ckpt" / "step_000008") == []
    supervise(plan(tmp_path, data, nodes=2, max_steps=12, resume="latest", attempt=2, entrypoint=script, args=[]))
    resumed = [e for e in Ledger.in_dir(tmp_path).events("train", "resumed")]
    assert resumed and resumed[-1]["step"] == 8


def test_training_processes_never_see_the_workers_secrets(
    tmp_path: Path, data: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What an Airflow worker holds: the Fernet key, the database URL, the JWT secret, cloud credentials.
    secrets = {
        "AIRFLOW__CORE__FERNET_KEY": "fernet-secret",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:pw@db/a",
        "AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret",
        "AIRFLOW_CONN_TRAINYARD_COLD": '{"password": "s3-secret"}',
        "AWS_SECRET_ACCESS_KEY": "aws-secret",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # a tuning variable does pass
    script = tmp_path / "dump_env.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, pathlib
        out = pathlib.Path(os.environ["TRAINYARD_CHECKPOINT_DIR"]) / f"env-{os.environ['RANK']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(dict(os.environ)))
    """)
    )
    launcher = LocalLauncher()
    handle = launcher.launch(plan(tmp_path, data, nodes=2, max_steps=1, entrypoint=str(script), args=[]))
    wait_for(lambda: launcher.poll(handle).state != "running", 120, "both nodes to end", every_s=0.2)
    launcher.cancel(handle)
    dumps = [json.loads(p.read_text()) for p in sorted((tmp_path / "ckpt").glob("env-*.json"))]
    assert len(dumps) == 2, [p.read_text()[-500:] for p in handle.logs.values()]
    for env in dumps:
        assert not set(secrets) & set(env), sorted(set(secrets) & set(env))
        assert not [k for k, v in env.items() if v in secrets.values() or k.startswith(("AIRFLOW", "AWS_"))]
        assert env["TRAINYARD_RUN_ID"] == tmp_path.name and env["TRAINYARD_NODE"] in ("node-0", "node-1")
        assert env["OMP_NUM_THREADS"] == "2" and env["PATH"] == os.environ["PATH"]


def test_each_node_gets_its_own_gpus_through_torchrun(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,7")  # the worker's GPUs: ids a child must repeat
    script = tmp_path / "dump_gpus.py"
    script.write_text(
        textwrap.dedent("""
        import json, os, pathlib
        out = pathlib.Path(os.environ["TRAINYARD_CHECKPOINT_DIR"]) / f"gpus-{os.environ['TRAINYARD_NODE']}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps([os.environ["CUDA_VISIBLE_DEVICES"], os.environ["LOCAL_RANK"]]))
    """)
    )
    launcher = LocalLauncher(gpus_per_node=1)
    handle = launcher.launch(plan(tmp_path, data, nodes=2, max_steps=1, entrypoint=str(script), args=[]))
    wait_for(lambda: launcher.poll(handle).state != "running", 120, "both nodes to end", every_s=0.2)
    launcher.cancel(handle)
    seen = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "ckpt").glob("gpus-*.json")}
    assert seen == {"gpus-node-0": ["3", "0"], "gpus-node-1": ["7", "0"]}, [
        p.read_text()[-500:] for p in handle.logs.values()
    ]


def test_a_spec_asking_for_more_gpus_than_the_host_has_starts_nothing(
    data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainyard.errors import SpecError

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    launcher = LocalLauncher(gpus_per_node=1)
    with pytest.raises(SpecError, match=r"nodes.gpus_per_node: 2 node\(s\) x 1 GPU\(s\) = 2, but this host has 1"):
        launcher.launch(plan(tmp_path, data, nodes=2, max_steps=1))
    assert not launcher.active and not (tmp_path / "attempt-1").exists()
