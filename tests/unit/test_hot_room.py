"""Hot-tier capacity: LRU eviction that respects pins, and a clear error when full."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.storage import LocalTier
from trainyard.storage.hot import PIN_TTL_S, STAGED_MANIFEST, HotRoom, make_room, pin, staged_datasets, unpin
from trainyard.storage.staging import stage


def staged(root: Path, name: str, size: int, used_at: float) -> Path:
    src = root.parent / "cold" / name
    src.mkdir(parents=True)
    (src / "s.tok").write_bytes(b"x" * size)
    folder = root / name
    stage(LocalTier(src), folder)
    os.utime(folder / ".last_used", (used_at, used_at))
    return folder


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "hot"
    now = time.time()
    # Sizes dwarf the few hundred bytes of each staged manifest.
    staged(root, "old", 40_000, now - 300)
    staged(root, "mid", 30_000, now - 200)
    staged(root, "new", 20_000, now - 100)
    return root


def names(root: Path) -> list[str]:
    return [d.path.name for d in staged_datasets(root)]


def test_datasets_are_listed_least_recently_used_first(root: Path) -> None:
    assert names(root) == ["old", "mid", "new"]


def test_eviction_takes_the_least_recently_used_first_and_only_what_is_needed(root: Path, tmp_path: Path) -> None:
    ledger = Ledger.in_dir(tmp_path / "run")
    evicted = make_room(HotRoom(root, 100_000, "me"), root / "incoming", 35_000, ledger)
    assert [d.path.name for d in evicted] == ["old"]  # ~9 kB free + ~40 kB freed >= 35 kB
    assert names(root) == ["mid", "new"]
    assert [e["path"] for e in ledger.events("stage_dataset", "evicted")] == [str(root / "old")]
    assert not any(p.name.startswith(".evicting") for p in root.iterdir())


def test_pinned_datasets_are_skipped(root: Path) -> None:
    pin(root / "old", "nightly/run-1")
    evicted = make_room(HotRoom(root, 100_000, "me"), root / "incoming", 45_000, None)
    assert [d.path.name for d in evicted] == ["mid", "new"]
    assert names(root) == ["old"]


def test_an_expired_pin_no_longer_protects(root: Path) -> None:
    pin(root / "old", "crashed/run")
    stale = time.time() - PIN_TTL_S - 10
    pin_file = next((root / "old" / ".pins").iterdir())
    os.utime(pin_file, (stale, stale))
    assert [d.path.name for d in make_room(HotRoom(root, 100_000, "me"), root / "x", 35_000, None)] == ["old"]


def test_unpin_releases(root: Path) -> None:
    pin(root / "old", "a/b")
    unpin(root / "old", "a/b")
    assert staged_datasets(root)[0].pinned_by == ()


def test_no_room_fails_before_anything_is_evicted(root: Path) -> None:
    pin(root / "mid", "nightly/run-2")
    with pytest.raises(
        DataError,
        # the manifests' own bytes count too (a few hundred bytes each): hence the free digits
        match=r"is full: staging needs 80.0 kB more, \d.\d kB of 100.0 kB is free and evicting every unpinned dataset frees only 6\d.\d kB; 1 dataset\(s\) \(3\d.\d kB\) are pinned",
    ):
        make_room(HotRoom(root, 100_000, "me"), root / "incoming", 80_000, None)
    assert names(root) == ["old", "mid", "new"]


def test_stage_makes_room_and_pins_its_own_dataset(root: Path, tmp_path: Path) -> None:
    src = tmp_path / "cold" / "incoming"
    src.mkdir(parents=True)
    (src / "s.tok").write_bytes(b"y" * 55_000)
    stage(LocalTier(src), root / "incoming", room=HotRoom(root, 100_000, "p/run-3"))
    assert names(root) == ["new", "incoming"]  # old and mid went, oldest first
    assert [d.pinned_by for d in staged_datasets(root) if d.path.name == "incoming"] == [("p/run-3",)]


def test_unbounded_capacity_never_evicts(root: Path) -> None:
    assert make_room(HotRoom(root, None, "me"), root / "x", 10**12, None) == []


def test_eviction_leaves_files_trainyard_did_not_stage(root: Path) -> None:
    # dataset.hot pointed at a folder a person also keeps files in.
    notes = root / "old" / "notes.txt"
    notes.write_text("mine")
    (root / "old" / "drafts").mkdir()
    (root / "old" / "drafts" / "plan.md").write_text("also mine")
    assert [d.path.name for d in make_room(HotRoom(root, 100_000, "me"), root / "incoming", 35_000, None)] == ["old"]
    assert notes.read_text() == "mine" and (root / "old" / "drafts" / "plan.md").read_text() == "also mine"
    assert sorted(p.name for p in (root / "old").iterdir()) == [
        "drafts",
        "notes.txt",
    ]  # staged files and bookkeeping gone
    assert names(root) == ["mid", "new"]


def test_an_emptied_dataset_folder_goes_entirely(root: Path) -> None:
    make_room(HotRoom(root, 100_000, "me"), root / "incoming", 35_000, None)
    assert not (root / "old").exists()


def test_a_folder_without_a_trainyard_manifest_is_never_evicted(root: Path) -> None:
    user = root / "scratch"
    user.mkdir()
    (user / "big.bin").write_bytes(b"z" * 50_000)
    make_room(HotRoom(root, 100_000, "me"), root / "incoming", 80_000, None)
    assert (user / "big.bin").stat().st_size == 50_000


def test_a_manifest_listing_paths_outside_its_folder_deletes_nothing_there(root: Path, tmp_path: Path) -> None:
    # The hot tier is writable by training code: a rewritten manifest must not steer deletion.
    outside = tmp_path / "home" / "user.txt"
    outside.parent.mkdir()
    outside.write_text("keep")
    (root / "old" / "link").symlink_to(outside.parent)
    manifest = json.loads((root / "old" / STAGED_MANIFEST).read_text())
    manifest["files"].update({"../../home/user.txt": {"size": 4}, "link/user.txt": {"size": 4}})
    (root / "old" / STAGED_MANIFEST).write_text(json.dumps(manifest))
    make_room(HotRoom(root, 100_000, "me"), root / "incoming", 35_000, None)
    assert outside.read_text() == "keep"


def test_a_nested_pinned_night_survives_eviction_of_its_parent(tmp_path: Path) -> None:
    # dataset.name `tokens` (every night) beside `tokens/{{ ds }}` (one night): the night is inside the parent.
    root, now = tmp_path / "hot", time.time()
    parent = staged(root, "tokens", 30_000, now - 300)  # its source holds the night as well
    night = root / "tokens" / "2026-11-30"
    src = tmp_path / "cold" / "tokens" / "2026-11-30"
    src.mkdir(parents=True)
    (src / "s.tok").write_bytes(b"n" * 20_000)
    stage(LocalTier(tmp_path / "cold" / "tokens"), parent)  # the parent re-staged: it now lists 2026-11-30/s.tok
    stage(LocalTier(src), night, room=HotRoom(root, None, "nightly/run-1"))  # pinned: a run trains on it
    os.utime(parent / ".last_used", (now - 300, now - 300))
    assert "2026-11-30/s.tok" in json.loads((parent / STAGED_MANIFEST).read_text())["files"]
    with pytest.raises(DataError, match="evicting every unpinned dataset frees only 0 B"):
        make_room(HotRoom(root, 60_000, "me"), root / "incoming", 25_000, None)  # the parent holds a pinned night
    assert (night / "s.tok").read_bytes() == b"n" * 20_000 and (night / STAGED_MANIFEST).exists()
    assert (parent / "s.tok").exists()
    unpin(night, "nightly/run-1")
    assert [d.path for d in make_room(HotRoom(root, 60_000, "me"), root / "incoming", 30_000, None)] == [parent]
    assert not (parent / "s.tok").exists()  # now the parent went: its own files only ...
    assert (night / "s.tok").read_bytes() == b"n" * 20_000  # ... the night's files belong to the night too
