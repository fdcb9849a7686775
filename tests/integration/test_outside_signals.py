"""The local launcher acts drills out from outside a node's processes (``LocalLauncher.signal_nodes``): what any
script gets, whatever it runs, since it need not act out trainyard's drills itself."""

from __future__ import annotations

import time
from pathlib import Path

import psutil
import pytest
from waiting import wait_for

from trainyard.backends.base import LaunchPlan, SignalsNodes, WakesOnExit
from trainyard.backends.local.launcher import LocalLauncher
from trainyard.protocol.env import TrainEnv

pytestmark = pytest.mark.integration


def launched(tmp_path: Path) -> tuple[LocalLauncher, object]:
    """Two nodes of one plain process each (an in-place launch: no torchrun agent), that sleep."""
    entry = tmp_path / "entry.py"
    entry.write_text("import time\nwhile True:\n    time.sleep(0.01)\n")
    plan = LaunchPlan(run_id="t", attempt=1, nodes=["node-0", "node-1"], procs_per_node=1, entrypoint=str(entry),
                      args=[], log_dir=tmp_path / "attempt-1",
                      train_env=TrainEnv(data_dir=tmp_path, checkpoint_dir=tmp_path / "ckpt", max_steps=1,
                                         store="127.0.0.1:1"))  # fmt: skip
    launcher = LocalLauncher()
    return launcher, launcher.launch(plan)


def states(handle, node: str) -> set[str]:
    return {psutil.Process(p.pid).status() for p in handle.ranks[node]}


def seen(check, what: str, within_s: float = 5.0) -> bool:
    return bool(wait_for(check, within_s, what, every_s=0.01))


def test_kill_hang_and_slow_reach_only_the_node_named(tmp_path: Path) -> None:
    launcher, handle = launched(tmp_path)
    assert isinstance(launcher, SignalsNodes)
    try:
        launcher.signal_nodes(handle, ["node-1"], "hang")
        assert seen(lambda: states(handle, "node-1") == {psutil.STATUS_STOPPED}, "node-1 stopped")
        assert states(handle, "node-0") != {psutil.STATUS_STOPPED}
        launcher.signal_nodes(handle, ["node-0"], "slow", factor=2.0)  # stopped and continued in turn
        assert seen(lambda: states(handle, "node-0") == {psutil.STATUS_STOPPED}, "node-0 stopped")
        assert seen(lambda: states(handle, "node-0") != {psutil.STATUS_STOPPED}, "node-0 continued")
        launcher.signal_nodes(handle, ["node-1"], "kill")
        assert seen(lambda: launcher.poll(handle).failed() != [], "node-1 failed")
        [dead] = launcher.poll(handle).failed()
        assert (dead.slot, dead.exit_code) == ("node-1", -9)
        with pytest.raises(ValueError, match="cannot be acted out from outside"):
            launcher.signal_nodes(handle, ["node-0"], "nan")
    finally:
        launcher.cancel(handle)  # the slow node's cycle stops first: cancel ends it, stopped or not
    assert all(p.poll() is not None for p in handle.processes())


def test_the_watch_wakes_when_a_node_ends_not_at_its_next_poll(tmp_path: Path) -> None:
    """``LocalLauncher.wait_exit`` (the relaunch path's wait between polls): no process ended, it waits its time
    out; a node killed meanwhile ends the wait with True, whichever process (a zygote's fork or not) it was."""
    launcher, handle = launched(tmp_path)
    assert isinstance(launcher, WakesOnExit)
    try:
        assert launcher.wait_exit(handle, 0.2) is False
        launcher.signal_nodes(handle, ["node-1"], "kill")
        woke = time.monotonic()
        assert launcher.wait_exit(handle, 30.0) is True
        assert time.monotonic() - woke < 30.0  # it woke on the exit, not at the end of its wait
        assert seen(lambda: launcher.poll(handle).failed() != [], "node-1 failed")
        assert launcher.wait_exit(handle, 0.2) is False  # the dead node no longer wakes it: node-0 runs on
    finally:
        launcher.cancel(handle)
    assert not handle.pidfds
