"""Heartbeat files are written by training code: the watch reads them bounded and checked, and never stops on them.

A FIFO or a link planted as a beat, an oversized or malformed beat: skipped with a warning (once, not at
every poll), reported as evidence, and the rank counts as one that never beat. Nothing raises out of
``read_heartbeats``, ``detect``, ``last_step``, the progress line or the Kubernetes trigger.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from trainyard.backends.base import AttemptStatus, NodeStatus
from trainyard.protocol import heartbeat
from trainyard.protocol.heartbeat import MAX_BYTES, read_heartbeats, scan, write_beat
from trainyard.recovery.watch import detect, last_step, silent_ranks

NODES = ["node-0", "node-1"]
RUNNING = AttemptStatus([NodeStatus(n, "running", host=n) for n in NODES])


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heartbeat, "_warned", {})


def beat(rank: int, node: str, step: int = 5, at: float | None = None, **fields: Any) -> dict[str, Any]:
    return {"rank": rank, "node": node, "host": node, "step": step, "time": time.time() if at is None else at,
            "status": "running", "metrics": {"loss": 2.5}, **fields}  # fmt: skip


def honest(hb: Path, rank: int, node: str, **fields: Any) -> None:
    (hb / node).mkdir(parents=True, exist_ok=True)
    write_beat(hb / node, rank, beat(rank, node, **fields))


def within(seconds: float, call: Any) -> Any:
    """``call()``'s answer, or a failed test if it has not answered within ``seconds`` (it may block forever)."""
    answer: list[Any] = []
    worker = threading.Thread(target=lambda: answer.append(call()), daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still blocked after {seconds} s"
    return answer[0]


def test_a_fifo_named_like_a_beat_blocks_nothing(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hb = tmp_path / "hb"
    honest(hb, 0, "node-0")
    (hb / "node-1").mkdir()
    fifos = [hb / "rank-1.json", hb / "node-1" / "rank-1.json"]
    for fifo in fifos:
        os.mkfifo(fifo)
    try:
        beats = within(5, lambda: read_heartbeats(hb))
        assert set(beats) == {"rank-0"} and beats["rank-0"]["folder"] == "node-0"
        # Rank 1 never beat: once the start-up grace is over it is a hang, and the refusal is evidence.
        found = within(5, lambda: detect(RUNNING, hb, 2, time.time() - 100, 10.0, 10.0))
        assert found is not None and found.trigger == "hang" and "no first heartbeat" in found.reason
        assert "node-1/rank-1.json refused" in found.reason and "not a regular file" in found.reason
    finally:
        for fifo in fifos:  # a reader still blocked on one (a regression) is let go
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    assert "heartbeat" in caplog.text and "skipped" in caplog.text


def test_a_link_to_dev_zero_is_refused_without_reading(tmp_path: Path) -> None:
    """Run where memory is capped at 1 GiB, so a reader that follows the link fails instead of taking the machine."""
    hb = tmp_path / "hb"
    honest(hb, 0, "node-0")
    (hb / "rank-1.json").symlink_to("/dev/zero")
    (hb / "node-0" / "rank-2.json").symlink_to("/dev/zero")
    script = "import sys, json; from pathlib import Path; from trainyard.protocol.heartbeat import read_heartbeats; "
    script += "print(json.dumps(sorted(read_heartbeats(Path(sys.argv[1])))))"
    cap = 1 << 30

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    done = subprocess.run([sys.executable, "-c", script, str(hb)], capture_output=True, text=True, timeout=60,
                          preexec_fn=limit)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == ["rank-0"]
    assert "rank-1.json skipped: a symbolic link" in done.stderr


MALFORMED = [
    ('{"step": 1}', "time 'None' is not a finite number"),
    ("[1, 2]", "not a JSON object"),
    ('"rank-1"', "not a JSON object"),
    ('{"step": 1, "time": "now", "status": "running"}', "time 'now' is not a finite number"),
    ('{"step": 1, "time": NaN, "status": "running"}', "time 'nan' is not a finite number"),
    ('{"step": 1, "time": Infinity, "status": "running"}', "time 'inf' is not a finite number"),
    ('{"step": -1, "time": 1.0, "status": "running"}', "step '-1' is not a whole number"),
    ('{"step": true, "time": 1.0, "status": "running"}', "step 'True' is not a whole number"),
    ('{"step": 1.5, "time": 1.0, "status": "running"}', "step '1.5' is not a whole number"),
    ('{"step": 1, "time": 1.0, "status": "sleeping"}', "status 'sleeping' is not one of"),
    ('{"step": 1, "time": 1.0, "status": "running", "rank": 0}', "rank '0' is not the file's rank 1"),
    ('{"step": 1, "time": 1.0, "status": "running", "node": ["node-1"]}', "node is not a string"),
    ('{"step": 1, "time": 1.0, "status": "running", "node": "node-0"}', "names node 'node-0', not 'node-1'"),
    ("{not json", "Expecting property name"),
    ('{"step": 1, "time": 1' + "0" * 400 + ', "status": "running"}', "is not a finite number"),
    ('{"step": 1' + "0" * 400 + ', "time": 1.0, "status": "running"}', "is not a whole number"),
    (" " * (MAX_BYTES + 1), f"larger than {MAX_BYTES} bytes"),
    # 3 KB of brackets: RecursionError, not a ValueError, out of the parser and once out of ``detect`` itself.
    ("[" * 3000, "nested deeper than the parser's recursion allows"),
    ('{"step": 1, "time": 1.0, "status": "running", "x": ' + "[" * 500 + "]" * 500 + "}", "deeper than 64 levels"),
]


@pytest.mark.parametrize(("text", "says"), MALFORMED, ids=[s for _, s in MALFORMED])
def test_a_malformed_beat_is_no_beat_and_never_raises(
    tmp_path: Path, text: str, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    hb = tmp_path / "hb"
    honest(hb, 0, "node-0", step=7)
    # The attempt folder itself (where beats lay before node folders, still read), or node-1's own folder for
    # a beat naming another node (a beat's node is checked against the folder it lies in).
    where = "node-1/rank-1.json" if "names node" in says else "rank-1.json"
    (hb / where).parent.mkdir(exist_ok=True)
    (hb / where).write_text(text)
    with caplog.at_level(logging.WARNING):
        # A rank writing only garbage is, once the grace is over, a rank that never beat: not silently healthy.
        found = detect(RUNNING, hb, 2, time.time() - 100, 10.0, 10.0)
        assert (
            found is not None
            and "no first heartbeat 10 s after the start from rank-1 though other ranks beat" in found.reason
        )
        assert f"{where} refused (" in found.reason and says in found.reason
        assert set(read_heartbeats(hb)) == {"rank-0"}
        assert last_step(hb) == 7  # the deferred driver's read
    assert caplog.text.count(says) == 1  # three reads, one warning: a bad file does not flood the log
    assert says in scan(hb).refused[where]


def test_the_trigger_and_the_progress_line_read_garbage_without_raising(tmp_path: Path) -> None:
    from trainyard.airflow.triggers import KubernetesAttemptTrigger
    from trainyard.recovery.deferred import AttemptWatch

    hb = tmp_path / "hb"
    honest(hb, 0, "node-0", step=7)
    (hb / "node-0" / "rank-0.alive").touch()  # rank 0 is well; the others wrote only garbage
    (hb / "node-1").mkdir()
    (hb / "node-1" / "rank-1.json").write_text('{"step": 1}')
    (hb / "rank-2.json").write_text("[]")
    watch = AttemptWatch(
        1, time.time() - 100, {"namespace": "ml", "name": "job"}, NODES, 3, str(hb), 20,
        heartbeat_timeout_s=10.0, startup_grace_s=10.0, progress_every_s=1.0,
    )  # fmt: skip
    trigger = KubernetesAttemptTrigger(watch)
    hung = asyncio.run(trigger.hang(RUNNING))
    assert hung is not None and "rank-1" in hung.reason and "rank-2" in hung.reason and hung.suspects == []
    pace = watch.progress_log(time.time())
    assert pace is not None
    pace.poll(time.time())
    line = pace.poll(time.time() + 5)
    assert line is not None and "step 7" in line


def test_the_folder_names_the_node_never_the_beat(tmp_path: Path) -> None:
    """A hung rank of node-0 whose beat says it is node-1's (host and all) makes node-0 the suspect."""
    hb = tmp_path / "hb"
    old = time.time() - 60
    honest(hb, 0, "node-0", at=old)
    (hb / "node-0" / "rank-0.alive").touch()
    os.utime(hb / "node-0" / "rank-0.alive", (old, old))
    lying = beat(1, "node-0", at=old, host="node-1")
    write_beat(hb / "node-0", 1, lying)
    found = detect(RUNNING, hb, 2, old - 10, 10.0, 10.0)
    assert found is not None and found.suspects == ["node-0"]


def test_a_pulse_is_only_lstated(tmp_path: Path) -> None:
    """A pulse that is a link to a file something else keeps fresh, or a FIFO, is no pulse (and is not opened)."""
    folder = tmp_path / "node-0"
    folder.mkdir()
    fresh = tmp_path / "fresh"
    fresh.touch()
    (folder / "rank-0.alive").symlink_to(fresh)
    os.mkfifo(folder / "rank-1.alive")
    (folder / "rank-2.alive").touch()
    folders = {f"rank-{r}": "node-0" for r in range(3)}
    got = within(5, lambda: silent_ranks(tmp_path, ["rank-0", "rank-1", "rank-2"], time.time(), 3.0, folders))
    assert got == ["rank-0", "rank-1"]


def test_after_a_regroup_each_rank_is_read_from_its_members_folder(tmp_path: Path) -> None:
    """node-1 died holding rank 1; node-2 holds it now. node-1's last beat is newer than node-2's first as
    rank 1, yet the group's rank 1 is node-2's; node-2's beat under its old number is not the group's."""
    hb = tmp_path / "hb"
    now = time.time()
    honest(hb, 0, "node-0", at=now)
    honest(hb, 1, "node-1", at=now - 1)  # the dead node's last beat
    honest(hb, 2, "node-2", at=now - 30)  # node-2's beat from before the regroup
    honest(hb, 1, "node-2", at=now - 2)  # node-2's first beat as rank 1
    members = ["node-0", "node-2"]
    beats = read_heartbeats(hb, lambda k: members[k] if k < len(members) else None)
    assert (beats["rank-1"]["folder"], beats["rank-1"]["time"]) == ("node-2", now - 2)
    assert read_heartbeats(hb)["rank-1"]["folder"] == "node-1"  # no owner known: the newest
    assert detect(RUNNING, hb, 2, now - 5, 10.0, 10.0, members) is None


def test_the_writer_keeps_a_beat_under_the_readers_cap(tmp_path: Path) -> None:
    metrics = {f"metric_{i}": float(i) for i in range(400)}
    write_beat(tmp_path, 0, beat(0, "node-0", metrics=metrics))
    assert read_heartbeats(tmp_path)["rank-0"]["metrics"] == {}  # the beat still counts, without its metrics
    with pytest.raises(ValueError, match="status 'warming' is not one of running, saving, regrouping, finished"):
        write_beat(tmp_path, 0, beat(0, "node-0", status="warming"))
