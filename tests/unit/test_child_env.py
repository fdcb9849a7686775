"""The environment of the processes trainyard starts locally: an allow-list, never the worker's secrets."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.backends.base import LaunchPlan
from trainyard.backends.local.environ import child_env
from trainyard.backends.local.launcher import LocalLauncher, node_env, split_visible_devices, visible_devices
from trainyard.burnin.local import candidate_env
from trainyard.burnin.sealing import KEY_ENV
from trainyard.protocol.env import TrainEnv

WORKER = {
    # What an Airflow worker's environment holds (docker/docker-compose.yaml and a typical cloud VM).
    "AIRFLOW__CORE__FERNET_KEY": "fernet",
    "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:pw@db/airflow",
    "AIRFLOW__API_AUTH__JWT_SECRET": "jwt",
    "AIRFLOW__API__SECRET_KEY": "api",
    "AIRFLOW_CONN_TRAINYARD_COLD": '{"password": "s3"}',
    "AWS_SECRET_ACCESS_KEY": "aws",
    "AWS_ACCESS_KEY_ID": "id",
    "GOOGLE_APPLICATION_CREDENTIALS": "/secrets/gcp.json",
    "KUBECONFIG": "/opt/airflow/kube/config",
    "TRAINYARD_S3_SECRET_KEY": "s3",
    "TRAINYARD_BURNIN_DRILLS": "node-1=crash",
    # What a Python/torch process needs.
    "PATH": "/usr/bin",
    "HOME": "/home/airflow",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "PYTHONPATH": "/opt/inc",
    "TMPDIR": "/scratch",
    "CUDA_VISIBLE_DEVICES": "0,1",
    "NVIDIA_VISIBLE_DEVICES": "all",
    "OMP_NUM_THREADS": "4",
    "MKL_NUM_THREADS": "4",
    "TORCH_HOME": "/cache/torch",
    "NCCL_DEBUG": "INFO",
    "GLOO_SOCKET_IFNAME": "eth0",
}
PASSED = {
    k: v for k, v in WORKER.items() if not k.startswith(("AIRFLOW", "AWS_", "GOOGLE_", "KUBECONFIG", "TRAINYARD_"))
}


def plan() -> LaunchPlan:
    return LaunchPlan(
        run_id="r",
        attempt=1,
        nodes=["node-0"],
        procs_per_node=1,
        entrypoint="trainyard.workload",
        args=[],
        train_env=TrainEnv(Path("/data"), Path("/ckpt"), 5, run_id="r", events_dir=Path("/runs/r/events.d")),
        log_dir=Path("/runs/r"),
    )


def test_a_training_agent_gets_the_allow_list_and_the_plans_contract_only() -> None:
    env = node_env(plan(), "node-0", WORKER)
    assert env == {
        **PASSED,
        "GLOO_SOCKET_IFNAME": "lo",
        **plan().env,  # the contract: TrainEnv's variables
        "TRAINYARD_RUN_ID": "r",
        "TRAINYARD_EVENTS_DIR": "/runs/r/events.d",
        "TRAINYARD_NODE": "node-0",
        "TRAINYARD_HOST": "node-0",  # a local node is its own host
        "CUDA_VISIBLE_DEVICES": "",  # the spec gave the node no GPU: the worker's are hidden, not shared
    }


def test_a_node_sees_only_its_share_of_the_gpus() -> None:
    env = node_env(plan(), "node-1", WORKER, gpus="4,5,6,7")
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" and env["NCCL_DEBUG"] == "INFO"  # NCCL tuning crosses


@pytest.mark.parametrize(
    "worker,nodes,per_node,expected",
    [
        ({}, 2, 0, ["", ""]),
        ({}, 2, 4, ["0,1,2,3", "4,5,6,7"]),
        ({}, 3, 2, ["0,1", "2,3", "4,5"]),  # 2 of the 8 left idle
        # the worker's own list names physical ids (or UUIDs): a child's list must repeat them
        ({"CUDA_VISIBLE_DEVICES": "2,3,5,7"}, 2, 2, ["2,3", "5,7"]),
        ({"CUDA_VISIBLE_DEVICES": "GPU-a1, GPU-b2"}, 2, 1, ["GPU-a1", "GPU-b2"]),
    ],
)
def test_the_hosts_gpus_are_split_between_nodes_in_order(
    worker: dict[str, str], nodes: int, per_node: int, expected: list[str]
) -> None:
    assert split_visible_devices(visible_devices(worker, 8), nodes, per_node) == expected


@pytest.mark.parametrize("visible,host", [("0,1,2", 3), ("", 0), ("6", 1)])
def test_more_gpus_than_the_host_has_are_refused_naming_the_field_and_the_fix(visible: str, host: int) -> None:
    from trainyard.errors import SpecError

    with pytest.raises(SpecError) as refused:
        LocalLauncher(gpus_per_node=2).gpu_split(2, {**WORKER, "CUDA_VISIBLE_DEVICES": visible})
    [line] = refused.value.problems
    assert line.startswith(f"nodes.gpus_per_node: 2 node(s) x 2 GPU(s) = 4, but this host has {host} GPU(s) visible")
    assert "lower nodes.gpus_per_node" in line and "nodes.gpus_per_node: 0 to train on CPUs" in line


def test_a_burn_in_candidate_gets_the_allow_list_its_name_and_its_key_only() -> None:
    env = candidate_env("node-1", "ab" * 32, WORKER)
    assert env == {**PASSED, "TRAINYARD_NODE": "node-1", "OMP_NUM_THREADS": "1", KEY_ENV: "ab" * 32}


def test_the_launcher_cannot_pass_a_malformed_name() -> None:
    with pytest.raises(ValueError, match="'A-B'"):
        child_env({}, {"A-B": "x"})


def test_the_spec_may_pass_named_variables_to_training_but_never_airflows(tmp_path: Path) -> None:
    from dataclasses import replace

    from trainyard.errors import SpecError
    from trainyard.spec import spec_from_text

    env = node_env(replace(plan(), pass_env=("WANDB_API_KEY",)), "node-0", {**WORKER, "WANDB_API_KEY": "wb"})
    assert env["WANDB_API_KEY"] == "wb" and "AWS_SECRET_ACCESS_KEY" not in env
    base = (
        "dataset: {source: 'file:///c', name: t}\nnodes: {count: 1%s}\ntraining: {max_steps: 2, global_batch: 2,"
        " micro_batch: 2, checkpoint_every: 1, pass_env: [%s]}\n"
    )
    assert spec_from_text(base % ("", "WANDB_API_KEY"), "p.yaml").training.pass_env == ["WANDB_API_KEY"]
    for names, says in [
        ("AIRFLOW__CORE__FERNET_KEY", "may not be passed to training code"),
        ("TRAINYARD_EVENTS_DIR", "set by the launcher"),
        ("'A-B'", "an environment variable name"),
    ]:
        with pytest.raises(SpecError, match=says):
            spec_from_text(base % ("", names), "p.yaml")
    with pytest.raises(SpecError, match="training.pass_env: passes the worker's variables to local training"):
        spec_from_text(base % (", backend: kubernetes", "WANDB_API_KEY") + "kubernetes: {image: t}\n", "p.yaml")
