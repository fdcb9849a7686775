"""The local launcher's in-place launch with two ranks per node, with real processes.

A script that forms its own group from torchrun's environment (env://, not trainyard's elastic group)
trains as a fixed world under it; and the node is the unit: killed, started again and cancelled whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import textwrap
from pathlib import Path

import psutil
import pytest
from waiting import WaitedTooLong, wait_for

from trainyard.backends.base import LaunchPlan
from trainyard.backends.local.launcher import WORLD_NAMES, LocalHandle, LocalLauncher
from trainyard.protocol.coordstore import node_keys
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.sealing import new_secret

pytestmark = pytest.mark.integration

FIXED_WORLD = """\
import json, os, sys
from pathlib import Path
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
total = torch.tensor([float(dist.get_rank())])
dist.all_reduce(total)
seen = {name: os.environ[name] for name in json.loads(sys.argv[2])}
seen.update(sum=total.item(), rank=dist.get_rank(), world=dist.get_world_size(), node=os.environ["TRAINYARD_NODE"])
(Path(sys.argv[1]) / f"rank-{dist.get_rank()}.json").write_text(json.dumps(seen))
dist.destroy_process_group()
"""


def in_place_plan(root: Path, script: str, nodes: int, args: list[str]) -> LaunchPlan:
    (root / "train.py").write_text(textwrap.dedent(script))
    names = [f"node-{i}" for i in range(nodes)]
    return LaunchPlan(
        run_id=root.name,
        attempt=1,
        nodes=names,
        procs_per_node=2,
        entrypoint=str(root / "train.py"),
        args=args,
        log_dir=root / "attempt-1",
        train_env=TrainEnv(
            data_dir=root,
            checkpoint_dir=root / "ckpt",
            max_steps=1,
            heartbeat_dir=root / "hb",
            run_id=root.name,
            attempt=1,
            global_batch=4,
            micro_batch=1,
            store="127.0.0.1:9",  # in place: the launch of a store, which these scripts never reach
        ),
        store_keys=node_keys(new_secret(), names),
    )


def states_once(launcher: LocalLauncher, handle: LocalHandle, done: str, timeout_s: float = 60.0) -> dict[str, str]:
    """The nodes' states once every one is ``done``; at the bound, the states then (for the assert to show)."""
    states: dict[str, str] = {}

    def all_done() -> bool:
        states.clear()
        states.update({n.node: n.state for n in launcher.poll(handle).nodes})
        return bool(states) and all(state == done for state in states.values())

    with contextlib.suppress(WaitedTooLong):
        wait_for(all_done, timeout_s, f"every node {done}", every_s=0.1)
    return states


def test_a_script_that_forms_its_own_group_trains_as_a_fixed_world_under_an_in_place_launch(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    launcher = LocalLauncher()
    handle = launcher.launch(in_place_plan(tmp_path, FIXED_WORLD, 3, [str(out), json.dumps(WORLD_NAMES)]))
    try:
        assert states_once(launcher, handle, "succeeded") == dict.fromkeys(["node-0", "node-1", "node-2"], "succeeded")
    finally:
        launcher.cancel(handle)
    seen = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(6)]
    for rank, world in enumerate(seen):
        assert world["rank"] == rank and world["world"] == 6 and world["sum"] == 15.0
        assert world["node"] == f"node-{rank // 2}"  # each node's two ranks are its own, in order
        assert world["LOCAL_RANK"] == str(rank % 2) and world["LOCAL_WORLD_SIZE"] == "2"
        assert world["GROUP_RANK"] == str(rank // 2) and world["MASTER_ADDR"] == "127.0.0.1"
    assert len({world["MASTER_PORT"] for world in seen}) == 1


def test_a_node_is_killed_started_again_and_cancelled_with_all_its_ranks(tmp_path: Path) -> None:
    launcher = LocalLauncher()
    handle = launcher.launch(in_place_plan(tmp_path, "import time\ntime.sleep(120)\n", 2, []))
    try:
        assert states_once(launcher, handle, "running", timeout_s=5) == {"node-0": "running", "node-1": "running"}
        first = [proc.pid for proc in handle.ranks["node-1"]]
        assert len(first) == 2 and len(handle.processes()) == 4
        launcher.kill_nodes(handle, ["node-1"])
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in first)
        status = {n.node: (n.state, n.exit_code) for n in launcher.poll(handle).nodes}
        assert status == {"node-0": ("running", None), "node-1": ("failed", -9)}
        launcher.add_nodes(handle, ["node-1"])  # a node started again brings both its ranks
        again = [proc.pid for proc in handle.ranks["node-1"]]
        assert len(again) == 2 and not set(again) & set(first)
        assert {n.node: n.state for n in launcher.poll(handle).nodes} == {"node-0": "running", "node-1": "running"}
        os.kill(handle.ranks["node-0"][1].pid, signal.SIGKILL)  # one rank of node-0 lost (a fork: no Popen.kill)
        handle.ranks["node-0"][1].wait(timeout=5)
        assert {n.node: n.state for n in launcher.poll(handle).nodes}["node-0"] == "failed"
    finally:
        launcher.cancel(handle, grace_s=2)
    assert all(proc.poll() is not None for proc in handle.processes())
