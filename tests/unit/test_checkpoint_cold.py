"""Publishing to the cold tier is atomic: a copy under a prefix of its own, then the pointer.

The S3 side of the same cases runs against an S3 server in tests/integration/test_s3_tiers.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from dcp_helpers import gate_passed, save_as_ranks

from trainyard.checkpoint.format import read_manifest, verify
from trainyard.checkpoint.validate import validate
from trainyard.errors import CheckpointInvalid, DataError
from trainyard.pipeline import lineage, stages
from trainyard.pipeline.run import Run, open_run
from trainyard.storage import LocalTier, local_path

SPEC = """\
dataset: {{source: "file://{root}/cold/tokens", name: tokens}}
nodes: {{count: 1}}
training: {{max_steps: 2, global_batch: 2, micro_batch: 1, checkpoint_every: 1}}
checkpoint: {{hot: "file://{root}/hot", cold: "{cold}"{extra}}}
runs_root: "file://{root}/runs"
"""


def make_run(root: Path, extra: str = "") -> Run:
    spec = root / "pipe.yaml"
    spec.write_text(SPEC.format(root=root, cold=f"file://{root}/cold/checkpoints", extra=extra))
    return open_run(spec, "pipe", "manual__1", "2026-01-01")


def copy_at(uri: str) -> Path:
    """The local folder of a published ``file://`` copy, checked the way the gate checks a checkpoint."""
    return Path(local_path(uri))


def test_republishing_a_step_at_a_smaller_world_size_leaves_no_stale_shards(tmp_path: Path) -> None:
    run = make_run(tmp_path)
    wide, narrow = save_as_ranks(tmp_path / "a", 10, ranks=2), save_as_ranks(tmp_path / "b", 10, ranks=1)
    assert validate(wide).valid and validate(narrow).valid
    stages.publish(run, gate_passed(run, wide))
    result = stages.publish(run, gate_passed(run, narrow))
    copy = copy_at(result.uri)
    assert verify(copy) == [], "the re-published copy mixes two saves"
    assert read_manifest(copy)["world_size"] == 1 and validate(copy).valid
    from trainyard.checkpoint import cold

    assert cold.published(LocalTier(copy.parent)) == copy.name


def test_an_interrupted_republish_leaves_the_published_copy_whole_and_pointed_to(tmp_path: Path, monkeypatch) -> None:
    run = make_run(tmp_path)
    first = stages.publish(run, gate_passed(run, save_as_ranks(tmp_path / "a", 10, ranks=2)))
    again = Path(gate_passed(run, save_as_ranks(tmp_path / "b", 10, ranks=1)))  # the same step, saved again
    uploaded: list[str] = []
    real = LocalTier.upload

    def dies_after_one(self, src, key, expect_sha256=None):
        if uploaded:
            raise OSError("No space left on device")
        uploaded.append(key)
        return real(self, src, key, expect_sha256)

    monkeypatch.setattr(LocalTier, "upload", dies_after_one)
    with pytest.raises(OSError, match="No space left"):
        stages.publish(run, str(again))
    monkeypatch.undo()
    old = copy_at(first.uri)
    assert verify(old) == [] and read_manifest(old)["world_size"] == 2, "the published copy was written over"
    from trainyard.checkpoint import cold

    tier = LocalTier(old.parent)
    assert cold.published(tier) == old.name
    retried = stages.publish(run, str(again))  # the retry completes, and only then does the pointer move
    assert cold.published(tier) == copy_at(retried.uri).name != old.name
    assert verify(old) == [] and verify(copy_at(retried.uri)) == []


def test_a_file_changed_after_validation_is_refused_and_the_pointer_stays(tmp_path: Path, monkeypatch) -> None:
    run = make_run(tmp_path)
    first = stages.publish(run, gate_passed(run, save_as_ranks(tmp_path / "a", 10, ranks=2)))
    again = Path(gate_passed(run, save_as_ranks(tmp_path / "b", 12, ranks=2)))
    shard = sorted(again.glob("*.distcp"))[-1]
    real = LocalTier.upload

    def after_validation(self, src, key, expect_sha256=None):  # a rank that lingers rewrites a byte
        if src == shard:
            data = bytearray(src.read_bytes())
            data[-1] ^= 0xFF
            src.write_bytes(bytes(data))
        return real(self, src, key, expect_sha256)

    monkeypatch.setattr(LocalTier, "upload", after_validation)
    with pytest.raises(CheckpointInvalid, match=r"\.distcp: changed since it was validated .* nothing was stored"):
        stages.publish(run, str(again))
    from trainyard.checkpoint import cold

    tier = LocalTier(copy_at(first.uri).parent)
    assert cold.published(tier) == copy_at(first.uri).name
    assert not any(p.name == shard.name for p in copy_at(first.uri).parent.rglob("*") if "000012" in str(p))


def test_a_pointer_that_names_no_copy_is_refused(tmp_path: Path) -> None:
    from trainyard.checkpoint import cold

    tier = LocalTier(tmp_path)
    assert cold.published(tier) is None
    for bad in (
        b'{"format": "trainyard.pointer", "path": "../other_pipeline/step_000010.0123456789abcdef"}',
        b"not json",
        b'{"format": "trainyard.pointer", "path": "step_000010"}',
        b"[" * 3000,  # once a RecursionError, not the DataError that says what to do
    ):
        tier.write_bytes(cold.POINTER, bad)
        with pytest.raises(DataError, match="does not name a checkpoint copy"):
            cold.published(tier)


def test_publish_uploads_only_what_the_manifest_lists(tmp_path: Path) -> None:
    from trainyard.checkpoint import cold

    ckpt = save_as_ranks(tmp_path / "a", 10, ranks=1)
    (ckpt / "late.bin").write_bytes(b"written after the manifest")
    tier = LocalTier(tmp_path / "cold")
    copy = cold.publish(ckpt, tier, "r1")
    assert not (tmp_path / "cold" / copy.name / "late.bin").exists()
    fetched = cold.download_copy(tier, copy.name, tmp_path / "fetched")
    assert fetched.name == "step_000010" and verify(fetched) == [] and validate(fetched).valid


def test_copies_tiered_during_training_get_prefixes_of_their_own_and_leave_the_pointer(tmp_path: Path) -> None:
    from trainyard.checkpoint import cold

    run = make_run(tmp_path, extra=", cold_every_steps: 10")
    tier_copy = lineage._to_cold(run)
    ckpt = save_as_ranks(tmp_path / "a", 10, ranks=2)
    tier_copy(ckpt)
    tier_copy(save_as_ranks(tmp_path / "b", 10, ranks=1))  # a re-save of the step after a rollback
    tier = LocalTier(local_path(run.cold_checkpoint_uri))
    copies = sorted({o.key.split("/")[0] for o in tier.list()})
    assert len(copies) == 2 and all(c.startswith("step_000010.") for c in copies)
    assert all(verify(Path(local_path(run.cold_checkpoint_uri)) / c) == [] for c in copies)
    assert cold.published(tier) is None  # only the gate-approved publish moves the pointer
