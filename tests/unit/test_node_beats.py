"""One writer per node: the node's beat and pulse on the shared volume, its ranks' in a local folder.

The runtime (``runtime.progress.write_heartbeat``) keeps each rank's beat and pulse in the node's local
folder, and the node's local rank 0 writes ``node.json`` and touches ``node.alive`` in the node folder;
the orchestrator's readers see the node's ranks as before (``scan``), each judged by the node's pulse.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from trainyard.backends.base import AttemptStatus, NodeStatus
from trainyard.protocol.heartbeat import (
    NODE_BEAT,
    NODE_PULSE,
    local_folder,
    node_beat,
    publish_pulse,
    read_local_beats,
    scan,
    write_beat,
    write_node_beat,
)
from trainyard.recovery.watch import detect, last_step
from trainyard.runtime import progress
from trainyard.runtime.process import RunContext

NODES = ["node-0", "node-1"]
RUNNING = AttemptStatus([NodeStatus(n, "running", host=n) for n in NODES])


def beat(rank: int, node: str, step: int = 5, at: float | None = None, status: str = "running") -> dict[str, Any]:
    return {"rank": rank, "node": node, "host": node, "step": step, "time": at or time.time(), "status": status,
            "metrics": {"loss": 2.0}}  # fmt: skip


def aged(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


def test_the_node_beat_carries_the_writers_step_and_the_oldest_working_rank() -> None:
    now = time.time()
    mine = beat(0, "node-0", step=12, at=now)
    behind = beat(1, "node-0", step=11, at=now - 40)  # stopped: the node's time is its
    done = beat(2, "node-0", step=12, at=now - 60, status="finished")  # finished ranks are never stale
    composed = node_beat(mine, [behind, done])
    assert (composed["step"], composed["time"], composed["status"], composed["ranks"]) == (12, now - 40, "running",
                                                                                           [0, 1, 2])  # fmt: skip
    # "finished" only when every rank is; until then the node is as old as its oldest rank at work.
    last = node_beat(beat(0, "node-0", step=20, at=now, status="finished"), [behind])
    assert (last["status"], last["time"]) == ("running", now - 40)
    all_done = node_beat(beat(0, "node-0", 20, now, "finished"), [beat(1, "node-0", 20, now - 1, "finished")])
    assert (all_done["status"], all_done["time"]) == ("finished", now)


def test_scan_gives_each_listed_rank_the_nodes_beat_and_pulse(tmp_path: Path) -> None:
    hb = tmp_path / "hb"
    for node, ranks in (("node-0", [0, 1]), ("node-1", [2, 3])):
        (hb / node).mkdir(parents=True)
        write_node_beat(hb / node, {**beat(ranks[0], node, step=7), "ranks": ranks})
    found = scan(hb).beats
    assert sorted(found) == ["rank-0", "rank-1", "rank-2", "rank-3"]
    assert {r: (b["folder"], b["pulse"], b["step"]) for r, b in found.items()}["rank-3"] == ("node-1", NODE_PULSE, 7)
    assert last_step(hb) == 7


@pytest.mark.parametrize(
    "ranks", [[], "0,1", [0, 0], [True], [-1], [10**7], list(range(300))], ids=lambda r: str(r)[:12]
)
def test_a_node_beat_with_a_bad_rank_list_is_refused(tmp_path: Path, ranks: Any) -> None:
    folder = tmp_path / "node-0"
    folder.mkdir()
    (folder / NODE_BEAT).write_text(json.dumps({**beat(0, "node-0"), "ranks": ranks}))
    found = scan(tmp_path)
    assert found.beats == {} and "node-0/node.json" in found.refused


def test_a_frozen_rank_stops_its_nodes_pulse_and_makes_that_node_the_suspect(tmp_path: Path) -> None:
    """Both nodes stopped stepping (node-1's rank 3 froze; the others wait in the collective): only node-1's
    pulse stopped, because one of its local pulses did."""
    hb, old = tmp_path / "hb", time.time() - 60
    locals_ = {}
    for node, ranks in (("node-0", [0, 1]), ("node-1", [2, 3])):
        (hb / node).mkdir(parents=True)
        write_node_beat(hb / node, {**beat(ranks[0], node, step=9, at=old), "ranks": ranks})
        here = locals_[node] = tmp_path / f"local-{node}"
        here.mkdir()
        for local in (0, 1):
            (here / f"rank-{local}.alive").touch()
    aged(locals_["node-1"] / "rank-1.alive", 30)  # rank 3 froze
    for node, here in locals_.items():  # what local rank 0's pulse thread does each second
        publish_pulse(hb / node / NODE_PULSE, here)
    assert time.time() - (hb / "node-1" / NODE_PULSE).stat().st_mtime > 29  # as old as rank 3's
    found = detect(RUNNING, hb, 4, old - 10, 10.0, 10.0)
    assert found is not None and found.trigger == "hang" and found.suspects == ["node-1"], found


def test_the_runtime_writes_one_file_per_node_and_rank_zero_of_the_node_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two local ranks of one node, as two calls with their LOCAL_RANK: the shared folder holds only the node's
    beat and pulse; the node's beat lists both ranks once local rank 1 has beaten."""
    folder = tmp_path / "hb" / "node-0"
    ctx = RunContext(tmp_path / "data", tmp_path / "ckpt", 10, heartbeat_dir=folder, node="node-0", host="node-0",
                     attempt=1, run_id="r")  # fmt: skip
    monkeypatch.setattr(progress, "_pulse", object())  # no pulse thread in a unit test
    monkeypatch.setattr(progress, "_pulse_path", None)
    monkeypatch.setattr(progress, "_node_pulse", None)
    monkeypatch.setattr(progress, "rank", lambda: int(os.environ["RANK"]))
    for local in (1, 0):
        monkeypatch.setenv("LOCAL_RANK", str(local))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(4 + local))
        progress.write_heartbeat(ctx, 3, {"loss": 1.5}, "running")
    assert sorted(p.name for p in folder.iterdir()) == [NODE_BEAT]
    assert json.loads((folder / NODE_BEAT).read_text())["ranks"] == [4, 5]
    here = local_folder(folder)
    assert [b["rank"] for b in read_local_beats(here, skip=0)] == [5]
    assert sorted(scan(tmp_path / "hb").beats) == ["rank-4", "rank-5"]
    write_beat(here, 1, beat(5, "node-0", step=3, status="finished"))
    monkeypatch.setenv("LOCAL_RANK", "0")
    progress.write_heartbeat(ctx, 3, {"loss": 1.5}, "finished")
    assert json.loads((folder / NODE_BEAT).read_text())["status"] == "finished"
