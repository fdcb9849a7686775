"""Promotion, quarantine and retention never lose the last valid checkpoint, even when killed midway."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_checkpoint_validation import flip_byte, save
from waiting import wait_for

from trainyard.checkpoint import registry
from trainyard.checkpoint.format import list_checkpoints, verify
from trainyard.checkpoint.validate import validate
from trainyard.events.ledger import Ledger


def judge(path: Path, after: int | None):
    return validate(path, after_step=after)


def test_the_watcher_and_the_inspector_it_starts_yield_the_cpu_to_training(tmp_path: Path) -> None:
    """On the local backend the watcher shares the ranks' cores: its judging (hashes, the tensors' inspector,
    the cold copy) runs at a lower CPU priority than the process that trains or supervises."""
    import threading

    from trainyard.checkpoint.validate import inspector

    root, ledger = tmp_path / "ckpt", Ledger.in_dir(tmp_path)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[tuple[int, int]] = []

    def judging(path: Path, after: int | None):
        result = validate(path, after_step=after)
        server = inspector().proc
        assert server is not None
        seen.append((os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
                     os.getpriority(os.PRIO_PROCESS, server.pid)))  # fmt: skip
        return result

    with registry.Watcher(root, judging, ledger, keep=2, poll_s=0.05):
        save(root, 10)
        wait_for(lambda: seen, 30, "the watcher to judge the checkpoint")
    thread, server = seen[0]
    assert thread == min(19, mine + registry.BACKGROUND_NICE)
    assert server >= thread  # inherited from the thread that started it, and its own nice +10 on top
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller's thread is untouched


def test_watcher_promotes_quarantines_and_retains(tmp_path: Path) -> None:
    root, ledger = tmp_path / "ckpt", Ledger.in_dir(tmp_path)
    uploaded: list[str] = []
    # The test drives the sweeps itself: a background sweep between saving step 20 and corrupting
    # it would (rightly) find it valid. The background loop is exercised by the integration tests.
    with registry.Watcher(root, judge, ledger, keep=2, on_valid=lambda p: uploaded.append(p.name), poll_s=3600) as w:
        save(root, 10)
        w.sweep()
        flip_byte(save(root, 20))
        w.sweep()
        save(root, 30)
        save(root, 40)
    assert registry.latest(root) == root / "step_000040"
    assert [p.name for p in list_checkpoints(root)] == ["step_000030", "step_000040"]  # keep=2; 10 retired
    [quarantined] = (root / registry.QUARANTINE).iterdir()
    assert quarantined.name.startswith("step_000020-")
    assert "sha256 mismatch" in json.loads((quarantined / registry.REASONS).read_text())["problems"][0]
    assert uploaded == ["step_000010", "step_000030", "step_000040"]
    events = [e["event"] for e in ledger.events("train")]
    assert (
        events.count("checkpoint_validated") == 4
        and "checkpoint_quarantined" in events
        and "checkpoint_retired" in events
    )


def test_the_pointer_target_is_never_retired_or_quarantined(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    old = save(root, 10)
    registry.promote(root, old)
    save(root, 20)  # newer, but never promoted (say it was never validated)
    assert registry.retain(root, keep=1, valid={"step_000010", "step_000020"}, pinned=set()) == []
    with pytest.raises(ValueError, match="latest valid checkpoint; it cannot be quarantined"):
        registry.quarantine(root, old, ["bit rot"])
    assert old.exists()


def test_promote_only_moves_forward_and_reset_starts_a_lineage(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    a, b = save(root, 10), save(root, 20)
    assert registry.promote(root, b) and not registry.promote(root, a)
    assert registry.latest(root) == b
    registry.reset(root, a)
    assert registry.latest(root) == a
    registry.reset(root, None)
    assert registry.latest(root) is None and a.exists() and b.exists()


KILLER = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from trainyard.checkpoint import registry
    calls = [0]
    def dying(real):
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == int(sys.argv[2]):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return wrapper
    # Every rename, and every unlink or rmdir retention makes through a folder descriptor (the
    # temporary-file clean-ups of atomic writes call unlink without one and are not counted).
    os.replace, os.rename = dying(os.replace), dying(os.rename)  # quarantine renames by held folders
    real_unlink, real_rmdir = os.unlink, os.rmdir
    os.unlink = lambda p, *, dir_fd=None: (dying(real_unlink) if dir_fd is not None else real_unlink)(p, dir_fd=dir_fd)
    os.rmdir = lambda p, *, dir_fd=None: (dying(real_rmdir) if dir_fd is not None else real_rmdir)(p, dir_fd=dir_fd)
    root = Path(sys.argv[1])
    registry.promote(root, root / "step_000010")
    registry.quarantine(root, root / "step_000020", ["corrupt"])
    registry.promote(root, root / "step_000030")
    registry.retain(root, 1, {"step_000010", "step_000030"}, set())
    print("done")
""")


@pytest.mark.parametrize("kill_at", range(1, 9))
def test_killed_midway_never_loses_the_last_valid_checkpoint(tmp_path: Path, kill_at: int) -> None:
    root = tmp_path / "ckpt"
    save(root, 10)
    flip_byte(save(root, 20))
    save(root, 30)
    done = subprocess.run([sys.executable, "-c", KILLER, str(root), str(kill_at)], capture_output=True, text=True)
    # Seven renames or deletions happen in all (four renames, then retiring step 10 unlinks its two files
    # and its manifest): each of them is a place to die; the eighth run finishes.
    assert done.returncode == (-9 if kill_at <= 7 else 0), done.stderr
    valid = [c for c in list_checkpoints(root) if not verify(c)]
    assert valid, "every valid checkpoint is gone"
    target = registry.latest(root)
    if target is not None:  # the pointer, if any, names a whole, valid checkpoint
        assert verify(target) == []
    assert verify(root / "step_000030") == []  # the newest valid checkpoint is never touched
    if done.returncode == 0:
        assert registry.latest(root) == root / "step_000030"
        assert [c.name for c in list_checkpoints(root)] == ["step_000030"]


def test_retention_deletes_only_what_the_manifest_lists(tmp_path: Path) -> None:
    root, ledger = tmp_path / "ckpt", Ledger.in_dir(tmp_path)
    old, new = save(root, 10), save(root, 20)
    (old / "notes.txt").write_text("a user's file, written after the save")
    (old / "sub").mkdir()
    (old / "sub" / "mine.bin").write_bytes(b"also theirs")
    registry.promote(root, new)
    assert registry.retain(root, keep=1, valid={old.name, new.name}, pinned=set(), ledger=ledger) == [old]
    assert (old / "notes.txt").read_text() == "a user's file, written after the save"
    assert (old / "sub" / "mine.bin").read_bytes() == b"also theirs"
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt", "sub"]  # tensors, metadata and manifest went
    assert list_checkpoints(root) == [new] and verify(new) == []
    [retired] = ledger.events("train", "checkpoint_retired")
    assert retired["kept"] == ["notes.txt", "sub"]


def test_retention_removes_a_clean_checkpoint_whole_and_never_follows_a_link(tmp_path: Path) -> None:
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    outside.mkdir()
    (outside / ".metadata").write_bytes(b"someone else's")
    clean, linked, new = save(root, 10), save(root, 20), save(root, 30)
    listed = json.loads((linked / "manifest.json").read_text())["files"]
    assert ".metadata" in listed
    (linked / ".metadata").unlink()
    (linked / ".metadata").symlink_to(outside / ".metadata")  # listed name, now a link out of the folder
    registry.promote(root, new)
    registry.retain(root, keep=1, valid={clean.name, linked.name, new.name}, pinned=set())
    assert not clean.exists()
    assert (outside / ".metadata").read_bytes() == b"someone else's"
    assert [p.name for p in linked.iterdir()] == [".metadata"] and (linked / ".metadata").is_symlink()


# ---------------------------------------------------------------- LATEST is written by pods too (issue 29, hole 4)


def plant(how: str, root: Path, other: Path, tmp_path: Path) -> None:
    latest, good = root / registry.LATEST, {"path": "step_000010", "step": 10}
    if how == "absolute":
        latest.write_text(json.dumps({"path": str(other / "step_000040"), "step": 40}))
    elif how == "dot-dot":
        latest.write_text(json.dumps({"path": "../other/step_000040", "step": 40}))
    elif how == "a link":  # to a good pointer: a link is refused whatever it leads to
        (tmp_path / "elsewhere.json").write_text(json.dumps(good))
        latest.symlink_to(tmp_path / "elsewhere.json")
    elif how == "a FIFO":  # nobody writes it: a blocking read would wait forever
        os.mkfifo(latest)
    elif how == "a folder link":
        (root / "step_000040").symlink_to(other / "step_000040", target_is_directory=True)
        latest.write_text(json.dumps({"path": "step_000040", "step": 40}))
    elif how == "oversized":
        latest.write_text(json.dumps({**good, "pad": "x" * 100_000}))
    elif how == "nested":
        latest.write_text("[" * 1020)
    elif how == "a newline":
        latest.write_text(json.dumps({"path": "step_000010\n"}))
    elif how == "not an object":
        latest.write_text(json.dumps("step_000010"))


@pytest.mark.parametrize(
    "how",
    ["absolute", "dot-dot", "a link", "a FIFO", "a folder link", "oversized", "nested", "a newline", "not an object"],
)
def test_a_pointer_a_pod_planted_is_no_pointer_and_one_warning(
    tmp_path: Path, how: str, caplog: pytest.LogCaptureFixture
) -> None:
    root, other = tmp_path / "ckpt" / "p", tmp_path / "ckpt" / "other"
    (root / "step_000010").mkdir(parents=True)
    (other / "step_000040").mkdir(parents=True)
    plant(how, root, other, tmp_path)
    with caplog.at_level(logging.WARNING, logger=registry.__name__):
        assert registry.latest(root) is None
        assert registry.latest(root) is None  # asked again (every progress line): no second warning
    assert len([r for r in caplog.records if "checkpoint pointer" in r.getMessage()]) == 1
    # The next promotion replaces it by a rename, never writing through it.
    assert registry.promote(root, root / "step_000010") and registry.latest(root) == root / "step_000010"
    if how == "a link":
        assert json.loads((tmp_path / "elsewhere.json").read_text()) == {"path": "step_000010", "step": 10}


def test_in_root_takes_only_a_real_step_folder_directly_in_the_root(tmp_path: Path) -> None:
    root, other = tmp_path / "p", tmp_path / "other"
    (root / "step_000010").mkdir(parents=True)
    (other / "step_000010").mkdir(parents=True)
    (root / "step_000020").symlink_to(other / "step_000010", target_is_directory=True)
    (root / "step_000030").write_text("a file")
    assert registry.in_root(root, root / "step_000010") == root / "step_000010"
    assert registry.in_root(root, str(root / "step_000010")) == root / "step_000010"
    for path in (
        other / "step_000010",
        root / ".." / "other" / "step_000010",
        root / "step_000020",  # a link
        root / "step_000030",  # not a folder
        root / "step_000040",  # not there
        root / "sub" / "step_000010",
        root / "step_000010.tmp",
    ):
        assert registry.in_root(root, path) is None, path


def test_set_aside_moves_what_lies_beyond_a_lineages_start_and_deletes_nothing(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    ten, twenty, _ = save(root, 10), save(root, 20), save(root, 30)
    [thirty] = registry.set_aside(root, twenty)
    assert list_checkpoints(root) == [ten, twenty]
    assert thirty.parent == root / "superseded" and thirty.name.startswith("step_000030-") and verify(thirty) == []
    alias = tmp_path / "alias"
    alias.symlink_to(root, target_is_directory=True)
    assert registry.set_aside(root, alias / "step_000020") == []  # the start spelled another way stays
    assert len(registry.set_aside(root, tmp_path / "shared" / "step_000050")) == 2  # another root's: all go
    assert list_checkpoints(root) == [] and len(list((root / "superseded").iterdir())) == 3
