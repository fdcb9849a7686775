"""The supervisor's pure parts: which ranks are silent, and how a plan becomes torchrun."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.backends.local.launcher import torchrun_argv
from trainyard.events.ledger import Ledger
from trainyard.protocol.env import TrainEnv
from trainyard.recovery.observations import Checkpoints, Context
from trainyard.recovery.state import Course
from trainyard.recovery.supervisor import Hooks, supervise
from trainyard.recovery.watch import beatless, group_beats, stale_ranks
from trainyard.spec import RecoverySpec
from trainyard.spec.args import command_line


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
        entrypoint="trainyard.workload",
        args=command_line({"lr": 0.1, "compile": True}, "--key value", "flag", lambda _, text: text),
        train_env=TrainEnv(data_dir=tmp_path, checkpoint_dir=tmp_path, max_steps=1),
        log_dir=tmp_path,
    )
    host, other = torchrun_argv(plan, 29500, 0), torchrun_argv(plan, 29500, 1)
    assert "--node-rank=0" in host and "--node-rank=1" in other and "--rdzv-backend=static" in host
    assert "--nnodes=2" in host and "--master-port=29500" in host and "--master-addr=127.0.0.1" in other
    assert host[-5:] == ["-m", "trainyard.workload", "--lr", "0.1", "--compile"]
    script = LaunchPlan(**{**plan.__dict__, "entrypoint": "/opt/train.py", "args": []})
    assert torchrun_argv(script, 1, 0)[-1] == "/opt/train.py"


class ScriptedLauncher:
    """A launcher whose attempts end as scripted (attempt number -> status); records what the driver asked."""

    reattaches = True

    def __init__(self, outcomes: dict[int, AttemptStatus]) -> None:
        self.outcomes = outcomes
        self.launched: list[int] = []
        self.attached: list[int] = []
        self.cancelled: list[int] = []
        self.excluded: list[str] = []

    def launch(self, plan: LaunchPlan) -> int:
        self.launched.append(plan.attempt)
        return plan.attempt

    def attach(self, plan: LaunchPlan) -> int:
        self.attached.append(plan.attempt)
        return plan.attempt

    def poll(self, handle: int) -> AttemptStatus:
        return self.outcomes[handle]

    def cancel(self, handle: int, grace_s: float | None = None) -> None:
        self.cancelled.append(handle)

    def exclude(self, nodes: list[str]) -> list[str]:
        self.excluded += nodes
        return nodes

    def cancel_all(self) -> None:
        pass


def drive(tmp_path: Path, launcher: ScriptedLauncher, ledger: Ledger):
    def plan_for(attempt: int, course: Course) -> LaunchPlan:
        train_env = TrainEnv(
            tmp_path / "data", tmp_path / "ckpt", 12, resume_from=course.resume_from,
            heartbeat_dir=tmp_path / f"attempt-{attempt}" / "hb", micro_batch=course.micro_batch,
        )  # fmt: skip
        return LaunchPlan(
            "r", attempt, list(course.nodes), 1, "train.py", [], train_env, tmp_path / f"attempt-{attempt}"
        )

    ctx = Context(RecoverySpec(backoff_s=0), ["n0", "n1", "n2"], [], 2, 12, 2, 1, reattach=launcher.reattaches)
    hooks = Hooks(plan_for, rollback_to=lambda step: "none", checkpoints=Checkpoints)
    return supervise(launcher, ledger, ctx, hooks, heartbeat_timeout_s=600, poll_s=0.01)


def test_the_blocking_driver_carries_out_a_scale_down_and_finishes(tmp_path: Path) -> None:
    lost = AttemptStatus([NodeStatus("n0", "running"), NodeStatus("n1", "failed", -9), NodeStatus("n2", "running")])
    done = AttemptStatus([NodeStatus("n0", "succeeded", 0), NodeStatus("n2", "succeeded", 0)])
    launcher, ledger = ScriptedLauncher({1: lost, 2: done}), Ledger.in_dir(tmp_path)
    ledger.append("train", "resume_point", resume_from="none", start_step=0)
    result = drive(tmp_path, launcher, ledger)
    assert result.attempt == 2 and launcher.launched == [1, 2] and launcher.cancelled == [1, 2]
    assert launcher.excluded == ["n1"]
    assert [e["nodes"] for e in ledger.events("train", "attempt_start")] == [["n0", "n1", "n2"], ["n0", "n2"]]
    assert [e["nodes"] for e in ledger.events("train", "nodes_marked")] == [["n1"]]
    assert [e["state"] for e in ledger.events("train", "attempt_end")] == ["failed", "succeeded"]


def test_a_retried_blocking_task_watches_the_attempt_its_predecessor_left_running(tmp_path: Path) -> None:
    """Pods outlive the task process: a retry re-attaches instead of launching a second Job beside them."""
    done = AttemptStatus([NodeStatus(n, "succeeded", 0) for n in ("n0", "n1", "n2")])
    launcher, ledger = ScriptedLauncher({1: done}), Ledger.in_dir(tmp_path)
    ledger.append("train", "resume_point", resume_from="none", start_step=0)
    ledger.append("train", "attempt_start", attempt=1, nodes=["n0", "n1", "n2"], micro_batch=2, resume_from="none")
    result = drive(tmp_path, launcher, ledger)
    assert result.attempt == 1 and launcher.launched == [] and launcher.attached == [1]


def test_after_a_regroup_only_the_current_groups_beats_count() -> None:
    """Rank 1 was node-1 (dead) and is node-2 now; rank-2 is node-2's beat under its old number."""
    beats = {
        "rank-0": {"node": "node-0", "time": 10.0},
        "rank-1": {"node": "node-1", "time": 1.0},  # the dead node's last beat
        "rank-2": {"node": "node-2", "time": 2.0},  # the survivor's beat from before the regroup
        "rank-x": {"node": "node-0", "time": 10.0},
    }
    assert group_beats(beats, ["node-0", "node-2"]) == {"rank-0": beats["rank-0"]}
    beats["rank-1"] = {"node": "node-2", "time": 11.0}  # node-2 beats as rank 1 now
    assert group_beats(beats, ["node-0", "node-2"]) == {"rank-0": beats["rank-0"], "rank-1": beats["rank-1"]}


@pytest.mark.parametrize(
    ("beats", "now", "stale", "quiet"),
    [
        ({}, 100.0, [], False),  # within the grace: nothing to say
        ({}, 1000.0, [], True),  # no rank ever beat: no hang, hang detection is off
        ({"rank-0": beat(990.0)}, 1000.0, ["rank-1"], False),  # the script beats: a rank that never did is hung
        ({"rank-0": beat(200.0), "rank-1": beat(990.0)}, 1000.0, ["rank-0"], False),  # beat once, then stopped
        ({"rank-0": beat(995.0), "rank-1": beat(990.0)}, 1000.0, [], False),  # both beat: alive
    ],
)
def test_hang_detection_needs_a_first_heartbeat(beats: dict, now: float, stale: list[str], quiet: bool) -> None:
    assert stale_ranks(beats, expected=2, started=0.0, now=now, timeout_s=20.0, grace_s=120.0) == stale
    assert beatless(beats, started=0.0, now=now, timeout_s=20.0, grace_s=120.0) is quiet


def test_an_attempt_of_a_script_that_beat_before_is_hung_without_a_beat_not_quiet() -> None:
    """An earlier attempt beat: an attempt stuck before its loop (a rendezvous that never forms) is a hang."""
    assert stale_ranks({}, 2, started=0.0, now=1000.0, timeout_s=20.0, grace_s=120.0, beats_known=True) == [
        "rank-0",
        "rank-1",
    ]
    assert stale_ranks({}, 2, started=0.0, now=100.0, timeout_s=20.0, grace_s=120.0, beats_known=True) == []
