"""Files the orchestrator writes in folders training code can write too (issue 13, holes 2 and 10).

A pod or training process may plant a symbolic link where the orchestrator is
about to write (its pod log, the report, the ledger): the write must never
reach the link's target. A full disk must never lose a ledger event silently.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
from kubernetes import client as k8s

from trainyard.atomic import UnsafePath, open_append, open_regular, read_json, write_json_atomic
from trainyard.backends.base import LaunchPlan, NodeStatus
from trainyard.backends.kubernetes.launcher import KubernetesHandle, KubernetesLauncher
from trainyard.events import schema
from trainyard.events.fold import fold
from trainyard.events.ledger import Ledger, LedgerWriteError, safe_name
from trainyard.protocol.env import TrainEnv
from trainyard.report.summary import write_report
from trainyard.spec import KubernetesSpec
from trainyard.storage.hot import PINS, pin, touch

SECRET = "the worker's secret\n"


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    """A file outside every run folder that a pod would like the orchestrator to overwrite."""
    path = tmp_path / "outside" / "secret.txt"
    path.parent.mkdir()
    path.write_text(SECRET)
    return path


class _PodLogs:
    """The one CoreV1Api call the evidence needs: a pod's log, as raw bytes."""

    def read_namespaced_pod_log(self, name: str, namespace: str, **_: object) -> SimpleNamespace:
        return SimpleNamespace(data=b"step 3 loss 2.5\nKilled\n")


def test_a_pod_log_is_not_written_through_a_link_planted_in_the_attempt_folder(tmp_path: Path, secret: Path) -> None:
    log_dir = tmp_path / "run" / "attempt-1"
    log_dir.mkdir(parents=True)
    (log_dir / "ty-run-0.log").symlink_to(secret)  # planted by the pod before it exited
    launcher = KubernetesLauncher(k8s.ApiClient(), KubernetesSpec(image="trainer:1"))
    launcher.core = _PodLogs()
    plan = LaunchPlan(
        run_id="r", attempt=1, nodes=["n0"], procs_per_node=1, entrypoint="m", args=[], log_dir=log_dir,
        train_env=TrainEnv(data_dir=tmp_path, checkpoint_dir=tmp_path, max_steps=1),
    )  # fmt: skip
    pod = SimpleNamespace(
        metadata=SimpleNamespace(name="ty-run-0", namespace="ns"), status=SimpleNamespace(message=None, conditions=None)
    )
    handle = KubernetesHandle(plan=plan, namespace="ns", name="ty-run", podgroup=False)

    status = launcher._with_evidence(handle, 0, pod, NodeStatus(slot="n0", state="failed", exit_code=137, host="n0"))

    assert secret.read_text() == SECRET
    log = log_dir / "ty-run-0.log"
    assert status.log == str(log) and not log.is_symlink() and "Killed" in log.read_text()


def test_a_pod_log_is_not_written_into_an_attempt_folder_swapped_for_a_link(tmp_path: Path, secret: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "attempt-1").symlink_to(secret.parent)  # the whole folder, so a new name lands outside
    with pytest.raises(UnsafePath, match="attempt-1 is a symbolic link"):
        write_json_atomic(run / "attempt-1" / "secret.txt", {"x": 1})
    assert secret.read_text() == SECRET and sorted(p.name for p in secret.parent.iterdir()) == ["secret.txt"]


def test_the_report_replaces_a_planted_link_instead_of_writing_through_it(tmp_path: Path, secret: Path) -> None:
    run = tmp_path / "run"
    ledger = Ledger.in_dir(run)
    ledger.append("report", "stage_start")
    (run / "report.html").symlink_to(secret)
    (run / "summary.json").symlink_to(secret)
    (run / ".report.html.tmp").symlink_to(secret)  # the fixed temporary name the report used to write through

    write_report(run, fold(ledger.events()))

    assert secret.read_text() == SECRET
    assert not (run / "report.html").is_symlink() and "<html" in (run / "report.html").read_text()
    assert read_json(run / "summary.json")["state"] == "succeeded"


def test_a_ledger_append_never_writes_through_a_link(tmp_path: Path, secret: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").symlink_to(secret)
    with pytest.raises(UnsafePath, match="events.jsonl is a symbolic link"):
        Ledger.in_dir(run).append("train", "step", step=1)
    with pytest.raises(UnsafePath):
        list(Ledger.in_dir(run).events())  # and is not read through one either
    assert secret.read_text() == SECRET


def test_appends_refuse_hard_links_and_fifos(tmp_path: Path, secret: Path) -> None:
    os.link(secret, tmp_path / "linked.log")
    with pytest.raises(UnsafePath, match="hard link"):
        open_append(tmp_path / "linked.log")
    os.mkfifo(tmp_path / "fifo.log")
    with pytest.raises(UnsafePath):  # refused at once: opening a FIFO nobody reads would hang the worker
        open_append(tmp_path / "fifo.log")
    with pytest.raises(UnsafePath, match="not a regular file"):
        open_regular(tmp_path / "fifo.log")
    assert secret.read_text() == SECRET


def test_hot_tier_pins_and_touches_replace_planted_links(tmp_path: Path, secret: Path) -> None:
    dataset = tmp_path / "hot" / "tokens"
    (dataset / PINS).mkdir(parents=True)
    (dataset / PINS / safe_name("nightly/r1")).symlink_to(secret)
    (dataset / ".last_used").symlink_to(secret)
    pin(dataset, "nightly/r1")
    touch(dataset)
    assert secret.read_text() == SECRET
    assert (dataset / PINS / safe_name("nightly/r1")).read_text() == "nightly/r1"
    assert not (dataset / ".last_used").is_symlink()


# ---------------------------------------------------------------- hole 10: a full disk


def _short_writes(monkeypatch: pytest.MonkeyPatch, *behaviours: str) -> None:
    """``os.write`` as a filling disk does it: 'half' takes half the bytes, 'full' takes none (ENOSPC)."""
    real, queue = os.write, list(behaviours)

    def write(fd: int, data: bytes) -> int:
        if not queue:
            return real(fd, data)
        if queue.pop(0) == "half":
            return real(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", write)


@pytest.mark.parametrize(
    "disk", [("half",), ("half", "full"), ("full",)], ids=["short write", "short write then full", "no space"]
)
def test_an_append_the_disk_did_not_take_raises_and_the_next_event_is_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, disk: tuple[str, ...]
) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "step", step=1)
    monkeypatch.setitem(schema.KINDS, "step_lost", schema.Step)  # a kind of this test's own: its name is asserted
    _short_writes(monkeypatch, *disk)
    with pytest.raises(LedgerWriteError, match=f"ledger {tmp_path / 'events.jsonl'}: .*step_lost.*not recorded") as err:
        ledger.append("train", "step_lost", step=2)
    assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
    monkeypatch.undo()

    ledger.append("train", "step", step=3)  # space again: nothing after the torn line is swallowed
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        assert [e.get("step") for e in Ledger.in_dir(tmp_path).events()] == [1, 3]
    if disk[0] == "half":
        assert "not a ledger event; skipped" in caplog.text  # the torn half is skipped, with a warning


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "step", step=1)
    with ledger.path.open("ab") as fh:
        fh.write(b'{"event": "step", "st')
    with caplog.at_level(logging.WARNING, logger="trainyard.events.ledger"):
        assert [e["step"] for e in ledger.events()] == [1]
        assert [e["step"] for e in ledger.events()] == [1]
    assert caplog.text.count("without a newline") == 1  # once, not on every read
