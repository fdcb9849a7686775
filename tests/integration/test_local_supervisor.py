"""The local launcher under the supervisor: crashes and hangs end the whole attempt."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest

from trainyard.backends.base import LaunchPlan
from trainyard.backends.local.launcher import LocalHandle, LocalLauncher
from trainyard.errors import LineageBusy, TrainingFailed
from trainyard.events.ledger import Ledger
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.heartbeat import write_beat
from trainyard.recovery.attempt import run_attempt

pytestmark = pytest.mark.integration


class Recording(LocalLauncher):
    """Keeps every process of the attempt so the test can prove none survives."""

    def __init__(self) -> None:
        super().__init__()
        self.pids: list[int] = []

    def poll(self, handle: LocalHandle):
        for proc in handle.procs.values():
            try:
                self.pids += [p.pid for p in psutil.Process(proc.pid).children(recursive=True)] + [proc.pid]
            except psutil.NoSuchProcess:
                pass
        return super().poll(handle)


def plan_for(tmp_path: Path, script: str) -> LaunchPlan:
    entry = tmp_path / "entry.py"
    entry.write_text(script)
    return LaunchPlan(
        run_id="t",
        attempt=1,
        nodes=["node-0", "node-1"],
        procs_per_node=1,
        entrypoint=str(entry),
        args=[],
        train_env=TrainEnv(data_dir=tmp_path, checkpoint_dir=tmp_path / "ckpt", max_steps=1),
        log_dir=tmp_path / "attempt-1",
    )


def alive(pids: list[int]) -> list[int]:
    return [p for p in set(pids) if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_a_crashed_node_fails_the_attempt_and_ends_the_others(tmp_path: Path) -> None:
    script = "import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(120)\n"
    launcher, ledger = Recording(), Ledger.in_dir(tmp_path)
    with pytest.raises(TrainingFailed, match=r"\(crash\): node-\d exited 1") as err:
        run_attempt(launcher, plan_for(tmp_path, script), tmp_path / "hb", 60.0, ledger, poll_s=0.2)
    assert err.value.kind == "crash"
    assert launcher.pids and alive(launcher.pids) == []
    [end] = ledger.events("train", "attempt_end")
    assert end["state"] == "failed" and end["trigger"] == "crash"


def test_a_silent_rank_of_a_script_that_beats_is_a_hang_and_every_process_ends(tmp_path: Path) -> None:
    """rank-0 beat once and stopped, rank-1 never beat: the script beats, so both are hung (one that never beats
    at all is not: test_byo_supervision.py)."""
    launcher = Recording()
    node0 = tmp_path / "hb" / "node-0"
    node0.mkdir(parents=True)
    write_beat(node0, 0, {"rank": 0, "step": 1, "time": time.time(), "status": "running"})
    with pytest.raises(
        TrainingFailed,
        match=r"\(hang\): no progress for 3 s from rank-0; no first heartbeat 3 s after the start from rank-1 though"
        r" other ranks beat \(each rank must call trainyard.runtime.heartbeat\(step, metrics\)",
    ) as err:
        run_attempt(
            launcher,
            plan_for(tmp_path, "import time\ntime.sleep(120)\n"),
            tmp_path / "hb",
            3.0,
            Ledger.in_dir(tmp_path),
            poll_s=0.2,
            startup_grace_s=3.0,
        )
    assert err.value.kind == "hang"
    assert launcher.pids and alive(launcher.pids) == []


def test_a_clean_exit_succeeds(tmp_path: Path) -> None:
    result = run_attempt(
        LocalLauncher(), plan_for(tmp_path, "print('ok')\n"), tmp_path / "hb", 30.0, Ledger.in_dir(tmp_path), poll_s=0.2
    )
    assert result.attempt == 1
    assert "ok" in (tmp_path / "attempt-1" / "node-0.log").read_text()


def test_a_lost_lineage_lease_ends_the_attempt_and_every_process(tmp_path: Path) -> None:
    from trainyard.checkpoint.lease import hold

    root, ledger = tmp_path / "ckpt", Ledger.in_dir(tmp_path)
    clock = [0.0]
    held = hold(root, "p", "run-1", ledger, ttl_s=4.0, clock=lambda: clock[0])
    clock[0] = 5.0  # lapsed (a stalled worker), and another run took the lineage over
    hold(root, "p", "run-2", Ledger.in_dir(tmp_path / "run-2"), ttl_s=4.0, clock=lambda: clock[0])
    launcher = Recording()
    with pytest.raises(LineageBusy, match="run run-1 lost its claim"):
        run_attempt(
            launcher,
            plan_for(tmp_path, "import time\ntime.sleep(120)\n"),
            tmp_path / "hb",
            60.0,
            ledger,
            poll_s=0.2,
            keep_alive=held.keep,
        )
    assert launcher.pids and alive(launcher.pids) == []
