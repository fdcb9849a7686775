"""In-place recovery, worker side: three plain processes lose one and carry on as two.

The test is the supervisor: it hosts the coordination store, publishes
generation 1 with three nodes, and when a survivor reports the fault of the
node a drill killed, publishes generation 2 with the two survivors (a joiner
comes in generation 3 in the second test). No torchrun, no Airflow: the model
and corpus are tiny so each test takes a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path

import forks
import pytest
from waiting import wait_for

from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import Generation, node_keys
from trainyard.protocol.sealing import new_secret
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery import storehost

pytestmark = pytest.mark.integration

MODEL_ARGS = ["--seq-len", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2"]
GLOBAL_BATCH = 12  # 3 nodes x micro 2 x accumulation 2; 2 nodes x micro 2 x 3, or x micro 3 x 2
MAX_STEPS = 12
KILL_AT = 6
KILL_AT2 = 9
WAIT_S = 60.0
COLLECTIVE_TIMEOUT_S = 20
# What "at once" means in these tests: well before the collective timeout, which is what a survivor blocked in a
# group that stays alive (or a rendezvous waiting for a node that left) would wait. A bound waited for, not a
# figure asserted: how fast it is on a quiet machine is bench/recovery.py's to measure.
AT_ONCE_S = COLLECTIVE_TIMEOUT_S / 2


def _start(
    node: str, port: int, key: str, root: Path, drills: list[dict[str, object]], **overrides: str
) -> forks.Process:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "TRAINYARD_STORE": f"127.0.0.1:{port}",
        "TRAINYARD_NODE": node,
        "TRAINYARD_STORE_KEY": key,  # its own key only: what it writes is believed as its node's, no other
        "TRAINYARD_DATA_DIR": str(root / "data"),
        "TRAINYARD_CHECKPOINT_DIR": str(root / "ckpt"),
        "TRAINYARD_HEARTBEAT_DIR": str(root / "hb" / node),
        "TRAINYARD_MAX_STEPS": str(MAX_STEPS),
        "TRAINYARD_GLOBAL_BATCH": str(GLOBAL_BATCH),
        "TRAINYARD_CHECKPOINT_EVERY": "2",
        "TRAINYARD_CHECKPOINT_ASYNC": "1",  # a save in flight at the fault: its group goes to the graveyard
        "TRAINYARD_COLLECTIVE_TIMEOUT_S": str(COLLECTIVE_TIMEOUT_S),
        "TRAINYARD_DRILLS": json.dumps(drills),
        **overrides,
    }
    cmd = [sys.executable, "-m", "trainyard.workload", *MODEL_ARGS]
    return forks.start(cmd, env, root / f"{node}.log")  # a fork of the zygote, as the launcher starts a node


def _wait_for(
    what: str, check: Callable[[], object], procs: dict[str, forks.Process], root: Path, timeout_s: float = WAIT_S
) -> None:
    def logs() -> str:
        return "\n".join(f"--- {n}\n{(root / f'{n}.log').read_text()[-2000:]}" for n in procs)

    wait_for(check, timeout_s, what, context=logs)


def _exit_cleanly(procs: dict[str, forks.Process], nodes: list[str], root: Path) -> None:
    for node in nodes:
        assert procs[node].wait(timeout=WAIT_S) == 0, (root / f"{node}.log").read_text()[-3000:]


def _kill_left(procs: dict[str, forks.Process]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


def _finished(root: Path, node: str) -> tuple[int, str]:
    """The step and parameter digest a node logged when it finished."""
    text = (root / f"{node}.log").read_text()
    found = re.search(r"finished at step (\d+) in generation \d+, params (\w+)", text)
    assert found, f"{node} did not finish:\n{text[-3000:]}"
    return int(found.group(1)), found.group(2)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    write_synthetic_corpus(tmp_path / "data", shards=2, tokens_per_shard=4096)
    return tmp_path


def _formed(root: Path, node: str, g: int) -> tuple[int, str]:
    """The step a node continued from in generation ``g`` and its parameter digest then."""
    text = (root / f"{node}.log").read_text()
    found = re.search(rf"generation {g}, rank \d+ of \d+, micro batch \d+, from step (\d+), params (\w+)", text)
    assert found, f"{node} did not form generation {g}:\n{text[-3000:]}"
    return int(found.group(1)), found.group(2)


def test_survivors_regroup_in_place_and_a_joiner_gets_the_state(root: Path) -> None:
    store, port = storehost.serve()
    nodes = ["node-0", "node-1", "node-2"]
    keys = node_keys(new_secret(), [*nodes, "node-3"])  # an attempt's secret, as the train task draws it
    coord = Coordinator(storehost.attempt_store(store, 1), keys)  # TRAINYARD_ATTEMPT is unset: attempt 1
    coord.publish(Generation(1, nodes, micro_batch=2))
    drills = [
        {"fault": "kill", "step": KILL_AT, "node": "node-1"},
        {"fault": "kill", "step": KILL_AT2, "node": "node-2"},
    ]
    # node-3 is a warm spare: listed in no generation yet, it waits for one that lists it.
    procs = {n: _start(n, port, keys[n], root, drills) for n in [*nodes, "node-3"]}
    try:
        _wait_for("the survivors' fault reports", lambda: {"node-0", "node-2"} <= set(coord.faults(1)), procs, root)
        assert procs["node-1"].wait(timeout=WAIT_S) == -9
        coord.publish(Generation(2, ["node-0", "node-2"], micro_batch=2))  # global batch 12 kept: accumulation 3
        assert coord.wait_ready(2, ["node-0", "node-2"], timeout_s=WAIT_S)
        # Both continue from the last step the whole world completed: node-1 died before step KILL_AT.
        assert coord.ready_steps(2) == {"node-0": KILL_AT - 1, "node-2": KILL_AT - 1}

        _wait_for("node-0's second fault report", lambda: "node-0" in coord.faults(2), procs, root)
        assert procs["node-2"].wait(timeout=WAIT_S) == -9
        coord.publish(Generation(3, ["node-0", "node-3"], micro_batch=3, joiners=["node-3"]))
        assert coord.wait_ready(3, ["node-0", "node-3"], timeout_s=WAIT_S)
        assert coord.ready_steps(3) == {"node-0": KILL_AT2 - 1, "node-3": KILL_AT2 - 1}  # the joiner got step 8
        _exit_cleanly(procs, ["node-0", "node-3"], root)
    finally:
        _kill_left(procs)
    # Survivors hold the same parameters when they regroup, the joiner receives them, and all end equal.
    assert _formed(root, "node-0", 2) == _formed(root, "node-2", 2)
    assert _formed(root, "node-0", 2)[0] == KILL_AT - 1
    assert _formed(root, "node-0", 3) == _formed(root, "node-3", 3)
    assert _formed(root, "node-0", 3)[0] == KILL_AT2 - 1
    done = {node: _finished(root, node) for node in ("node-0", "node-3")}
    assert done["node-0"] == done["node-3"] and done["node-0"][0] == MAX_STEPS
    assert (root / "ckpt" / f"step_{MAX_STEPS:06d}" / ".metadata").is_file()  # saves work in every generation


def test_every_survivor_fails_at_once_not_after_the_collective_timeout(root: Path) -> None:
    """In a world of four, node-3 never talks to the killed node-1 in the ring: it learns of the fault only
    when a neighbour's broken group closes its sockets. Anything that keeps that group alive (the DDP
    wrapper, the failed call's frames) leaves node-3 blocked for the whole collective timeout (20 s here)."""
    store, port = storehost.serve()
    nodes = ["node-0", "node-1", "node-2", "node-3"]
    keys = node_keys(new_secret(), nodes)
    coord = Coordinator(storehost.attempt_store(store, 1), keys)
    coord.publish(Generation(1, nodes, micro_batch=1))  # global batch 12: accumulation 3
    drills = [{"fault": "kill", "step": KILL_AT, "node": "node-1"}]
    procs = {n: _start(n, port, keys[n], root, drills) for n in nodes}
    survivors = ["node-0", "node-2", "node-3"]
    try:
        _wait_for("a survivor's fault report", lambda: set(coord.faults(1)) & set(survivors), procs, root)
        _wait_for(
            f"every survivor's fault report, within {AT_ONCE_S:g} s of the first",
            lambda: set(survivors) <= set(coord.faults(1)),
            procs,
            root,
            timeout_s=AT_ONCE_S,
        )
        coord.publish(Generation(2, survivors, micro_batch=2))  # accumulation 2
        assert coord.wait_ready(2, survivors, timeout_s=WAIT_S)
        _exit_cleanly(procs, survivors, root)
    finally:
        _kill_left(procs)
    assert len({_finished(root, node) for node in survivors}) == 1


def test_a_generation_superseded_before_it_formed_is_given_up_for_the_newer_one(root: Path) -> None:
    """Growth meets a notice: the supervisor publishes generation 2 listing node-2, which will never form it (it
    was given notice while 2 was published, and left). The members leave 1 at a step boundary and wait to form
    2; once the supervisor publishes 3 without node-2, they form 3 at once, not after the collective timeout
    (20 s here) in the rendezvous of 2, and train on to the end from the step they had reached."""
    store, port = storehost.serve()
    nodes = ["node-0", "node-1"]
    keys = node_keys(new_secret(), [*nodes, "node-2"])
    coord = Coordinator(storehost.attempt_store(store, 1), keys)
    coord.publish(Generation(1, nodes, micro_batch=2))  # global batch 12: accumulation 3
    steps = {"TRAINYARD_MAX_STEPS": "400", "TRAINYARD_CHECKPOINT_EVERY": "100"}
    procs = {n: _start(n, port, keys[n], root, [], **steps) for n in nodes}
    try:
        assert coord.wait_ready(1, nodes, timeout_s=WAIT_S)
        coord.publish(Generation(2, [*nodes, "node-2"], micro_batch=2))
        _wait_for("both to leave generation 1", lambda: all(
            "the world grows to generation 2" in (root / f"{n}.log").read_text() for n in nodes), procs, root)  # fmt: skip
        # Both members arrived to form 2 and wait there for node-2 (ranks 0 and 1 of generation 2).
        _wait_for("both to wait to form generation 2", lambda: coord.store.check(["g2/arrived/0", "g2/arrived/1"]),
                  procs, root)  # fmt: skip
        coord.publish(Generation(3, nodes, micro_batch=2))
        formed = coord.wait_ready(3, nodes, timeout_s=AT_ONCE_S)
        assert formed, f"generation 3 did not form within {AT_ONCE_S:g} s of its publication"
        _exit_cleanly(procs, nodes, root)
    finally:
        _kill_left(procs)
    assert not coord.ready(2)  # nobody formed 2
    assert _formed(root, "node-0", 3) == _formed(root, "node-1", 3)
    assert _formed(root, "node-0", 3)[0] > 0  # they went on from where they were, not from the start
    assert _finished(root, "node-0") == _finished(root, "node-1") and _finished(root, "node-0")[0] == 400
