"""A peer that dies after its generation began fails the survivor's first save at once, as a lost peer.

The background saves write over a process group of their own (``Checkpointer``). Making a group is no
collective that fails when a peer dies: each rank waits on the store for every other's address. Made at the
first save, a peer killed between the generation's start and that save held the survivor there until the
group's timeout, silent, and the supervisor took it for hung (seen in CI: in-place heals on Kubernetes ended
in a relaunch). ``guard`` now makes it as the generation begins. Real processes, a real gloo group, the store
served by the test as the supervisor's is (a rank's death does not take it down).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from trainyard.backends.local.launcher import free_port

pytestmark = pytest.mark.integration

TIMEOUT_S = 20  # the collective timeout: the survivor must not wait it out

SCRIPT = textwrap.dedent(
    """
    import datetime, os, sys, time
    import torch, torch.distributed as dist
    from trainyard import runtime
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    ctx = runtime.context()
    state = {"w": torch.nn.Linear(4, 4)}
    group = runtime.elastic_group(ctx, state, wrap=lambda: state["w"])
    checkpoints = runtime.Checkpointer(ctx)
    began = time.monotonic()
    try:
        while group.form():
            with group.guard(checkpoints):
                if rank == 0:  # killed after the generation began, before its first save
                    os._exit(9)
                time.sleep(1.0)
                checkpoints.save(1, state, {"loss": 1.0})
                checkpoints.wait()
    except Exception as exc:
        print(f"FAILED after {time.monotonic() - began:.1f}s: {type(exc).__name__}: {exc}", flush=True)
        os._exit(1)
    os._exit(0)
    """
)


def test_a_peer_lost_before_the_first_save_fails_the_survivors_save_at_once(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(SCRIPT)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "data").mkdir()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {
        **os.environ,
        "PORT": str(port),
        "GLOO_SOCKET_IFNAME": "lo",
        "TRAINYARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "TRAINYARD_DATA_DIR": str(tmp_path / "data"),
        "TRAINYARD_CHECKPOINT_ASYNC": "1",
        "TRAINYARD_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S),
        "TRAINYARD_MAX_STEPS": "1",
    }
    peer = subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": "0"})
    survivor = subprocess.run([sys.executable, str(script)], env={**env, "RANK": "1"},
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    peer.wait(timeout=60)
    del store
    assert peer.returncode == 9
    assert survivor.returncode == 1, survivor.stdout + survivor.stderr
    [failed] = [line for line in survivor.stdout.splitlines() if line.startswith("FAILED")]
    # A lost peer's error (gloo: the connection closed), which an in-place group heals; not the store's wait.
    assert "wait timeout" not in failed and "timed out" not in failed.lower(), failed


GROWN = textwrap.dedent(
    """
    import datetime, os, sys
    import torch, torch.distributed as dist
    from trainyard import runtime
    from trainyard.runtime.group import ElasticGroup
    rank = int(os.environ["RANK"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60))
    ctx = runtime.context()
    state = {"w": torch.nn.Linear(4, 4)}
    checkpoints = runtime.Checkpointer(ctx)
    group = ElasticGroup(ctx, state, wrap=lambda: state["w"])
    for generation, step in ((1, 1), (2, 2)):  # the second as a grown world's: a new default group, all groups new
        prefix = dist.PrefixStore(f"g{generation}/pg", store)
        dist.init_process_group("gloo", store=prefix, rank=rank, world_size=2)
        with group.guard(checkpoints):
            checkpoints.save(step, state, {"loss": 1.0})
        dist.destroy_process_group()  # every group of the generation, as a world that grows leaves its group
    print("SAVED", flush=True)
    """
)


def test_a_generation_after_one_that_ended_well_saves_over_a_group_of_its_own_world(tmp_path: Path) -> None:
    """The saves' group of a generation that ended well (a world that grows) is gone with it; the next one's
    saves make their own, with every member, rather than use the destroyed one."""
    script = tmp_path / "rank.py"
    script.write_text(GROWN)
    (tmp_path / "ckpt").mkdir()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    env = {**os.environ, "PORT": str(port), "GLOO_SOCKET_IFNAME": "lo", "TRAINYARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
           "TRAINYARD_DATA_DIR": str(tmp_path), "TRAINYARD_CHECKPOINT_ASYNC": "1", "TRAINYARD_MAX_STEPS": "2"}  # fmt: skip
    ranks = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in (0, 1)]  # fmt: skip
    outputs = [r.communicate(timeout=60) for r in ranks]
    del store
    for r, (out, err) in zip(ranks, outputs, strict=True):
        assert r.returncode == 0 and "SAVED" in out, err[-3000:]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == [
        "step_000001", "step_000002"
    ]  # fmt: skip
