"""Promotion, quarantine and retention never lose the last valid checkpoint, even when killed midway."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from test_checkpoint_validation import flip_byte, save

from trainyard.checkpoint import registry
from trainyard.checkpoint.format import list_checkpoints, verify
from trainyard.checkpoint.validate import validate
from trainyard.ledger import Ledger


def judge(path: Path, after: int | None):
    return validate(path, after_step=after)


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
    assert events.count("checkpoint_validated") == 4 and "checkpoint_quarantined" in events and "checkpoint_retired" in events


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
    os.replace = dying(os.replace)
    shutil.rmtree = dying(shutil.rmtree)
    registry.os.replace, registry.shutil.rmtree = os.replace, shutil.rmtree
    root = Path(sys.argv[1])
    registry.promote(root, root / "step_000010")
    registry.quarantine(root, root / "step_000020", ["corrupt"])
    registry.promote(root, root / "step_000030")
    registry.retain(root, 1, {"step_000010", "step_000030"}, set())
    print("done")
""")


@pytest.mark.parametrize("kill_at", [1, 2, 3, 4, 5, 6])
def test_killed_midway_never_loses_the_last_valid_checkpoint(tmp_path: Path, kill_at: int) -> None:
    root = tmp_path / "ckpt"
    save(root, 10)
    flip_byte(save(root, 20))
    save(root, 30)
    done = subprocess.run([sys.executable, "-c", KILLER, str(root), str(kill_at)], capture_output=True, text=True)
    # Five renames or deletions happen in all: each of them is a place to die; the sixth run finishes.
    assert done.returncode == (-9 if kill_at <= 5 else 0), done.stderr
    valid = [c for c in list_checkpoints(root) if not verify(c)]
    assert valid, "every valid checkpoint is gone"
    target = registry.latest(root)
    if target is not None:  # the pointer, if any, names a whole, valid checkpoint
        assert verify(target) == []
    assert verify(root / "step_000030") == []  # the newest valid checkpoint is never touched
    if done.returncode == 0:
        assert registry.latest(root) == root / "step_000030"
        assert [c.name for c in list_checkpoints(root)] == ["step_000030"]

