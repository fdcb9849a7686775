"""The supervisor's pure parts: which ranks are silent, and how a plan becomes torchrun."""

from __future__ import annotations

from pathlib import Path

from trainyard.launch.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.launch.local import torchrun_argv
from trainyard.recovery.supervisor import stale_ranks
from trainyard.stages import _cli_args
from trainyard.train.contract import TrainEnv


def beat(t: float, status: str = "running") -> dict:
    return {"time": t, "status": status, "step": 3}


def test_a_rank_silent_past_the_timeout_is_stale() -> None:
    beats = {"rank-0": beat(100.0), "rank-1": beat(80.0)}
    assert stale_ranks(beats, expected=2, started=0.0, now=105.0, timeout_s=20.0) == ["rank-1"]
    assert stale_ranks(beats, expected=2, started=0.0, now=99.0, timeout_s=20.0) == []


def test_finished_ranks_are_never_stale() -> None:
    assert stale_ranks({"rank-0": beat(0.0, "finished")}, 1, started=0.0, now=1000.0, timeout_s=5.0) == []


def test_a_rank_that_never_beat_gets_the_startup_grace() -> None:
    assert stale_ranks({"rank-0": beat(99.0)}, 2, started=90.0, now=100.0, timeout_s=20.0) == []
    assert stale_ranks({"rank-0": beat(209.0)}, 2, started=90.0, now=210.0, timeout_s=20.0) == []
    assert stale_ranks({"rank-0": beat(219.0)}, 2, started=90.0, now=220.0, timeout_s=20.0) == ["rank-1"]


def test_attempt_state_from_node_states() -> None:
    ok, run, bad = NodeStatus("a", "succeeded", 0), NodeStatus("b", "running"), NodeStatus("c", "failed", 1)
    assert AttemptStatus([ok, ok]).state == "succeeded"
    assert AttemptStatus([ok, run]).state == "running"
    assert AttemptStatus([run, bad]).state == "failed"
    assert AttemptStatus([run, bad]).failed() == [bad]


def test_torchrun_argv_is_an_argument_list_per_node(tmp_path: Path) -> None:
    plan = LaunchPlan(
        run_id="r",
        attempt=2,
        nodes=["node-0", "node-1"],
        procs_per_node=1,
        entrypoint="trainyard.train",
        args=_cli_args({"lr": 0.1, "compile": True, "debug": False}),
        train_env=TrainEnv(data_dir=tmp_path, checkpoint_dir=tmp_path, max_steps=1),
        log_dir=tmp_path,
    )
    host, other = torchrun_argv(plan, 29500, 0), torchrun_argv(plan, 29500, 1)
    assert "--rdzv-conf=is_host=1" in host and "--rdzv-conf=is_host=0" in other
    assert "--nnodes=2" in host and "--rdzv-endpoint=127.0.0.1:29500" in host and "--rdzv-id=r-a2" in host
    assert host[-5:] == ["-m", "trainyard.train", "--lr", "0.1", "--compile"]
    script = LaunchPlan(**{**plan.__dict__, "entrypoint": "/opt/train.py", "args": []})
    assert torchrun_argv(script, 1, 0)[-1] == "/opt/train.py"
