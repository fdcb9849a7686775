"""Each rank hashes what it writes; committing a checkpoint reads none of it back (issue 33).

Two real ranks (forked processes on gloo) save a blocking and a background checkpoint with
``sha256_file`` broken in both: a commit that read a file back would fail. The manifests that result
are the ones the validator checks, and a byte flipped afterwards in either rank's file, or in DCP's
``.metadata``, is caught.
"""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from trainyard.checkpoint import format as ckpt_format
from trainyard.runtime.dcpwriter import HashingWriter

pytestmark = pytest.mark.integration


def _rank(rank: int, root: Path) -> None:
    import torch.distributed as dist

    from trainyard.runtime.checkpoints import Checkpointer, save_checkpoint
    from trainyard.runtime.process import RunContext

    def no_reading_back(path: object) -> str:
        raise AssertionError(f"the commit read {path} back")

    ckpt_format.sha256_file = no_reading_back  # type: ignore[assignment]  # this forked rank only
    dist.init_process_group("gloo", init_method=f"file://{root / 'store'}", rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)
        state = {"w": torch.randn(256, 64), "b": torch.randn(64), "rank_bytes": torch.full((1000,), float(rank))}
        ctx = RunContext(data_dir=root, checkpoint_dir=root / "ckpt", max_steps=20, events_dir=root / "events.d")
        save_checkpoint(10, state, {"loss": 1.0}, ctx=ctx)
        background = Checkpointer(RunContext(**{**vars(ctx), "checkpoint_async": True}))
        background.save(20, state, {"loss": 0.9})
        background.close()
    finally:
        dist.destroy_process_group()


def test_ranks_hash_on_write_and_a_flipped_byte_in_any_file_is_caught(tmp_path: Path) -> None:
    fork = multiprocessing.get_context("fork")
    ranks = [fork.Process(target=_rank, args=(r, tmp_path)) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
    assert [p.exitcode for p in ranks] == [0, 0]  # neither commit read a file back
    for step in (10, 20):
        path = ckpt_format.step_dir(tmp_path / "ckpt", step)
        manifest = ckpt_format.read_manifest(path)
        assert set(manifest["files"]) == {".metadata", "__0_0.distcp", "__1_0.distcp"}, manifest["files"]
        assert ckpt_format.verify(path) == []
    path = ckpt_format.step_dir(tmp_path / "ckpt", 20)
    for name in ("__1_0.distcp", "__0_0.distcp", ".metadata"):
        data = bytearray((path / name).read_bytes())
        data[len(data) // 2] ^= 0x01
        (path / name).write_bytes(bytes(data))
        assert ckpt_format.verify(path) == [f"{name}: sha256 mismatch (contents changed after the save)"]
        data[len(data) // 2] ^= 0x01
        (path / name).write_bytes(bytes(data))


def test_a_file_written_out_of_order_is_hashed_from_disk(tmp_path: Path) -> None:
    """A stream that was seeked inside has no write-time digest: the manifest reads that file instead."""
    writer = HashingWriter(tmp_path)
    with writer.fs.create_stream(tmp_path / "seeked.bin", "wb") as stream:
        stream.write(b"a" * 100)
        stream.seek(10)
        stream.write(b"b")
    with writer.fs.create_stream(tmp_path / "plain.bin", "wb") as stream:
        stream.write(b"c" * 100)
    assert set(writer.fs.digests) == {"plain.bin"}
    manifest = ckpt_format.write_manifest(
        tmp_path, step=1, world_size=1, global_batch=1, micro_batch=1, metrics={}, run_id="t", hashed=writer.fs.digests
    )
    assert manifest["files"]["seeked.bin"]["sha256"] == ckpt_format.sha256_file(tmp_path / "seeked.bin")
    assert ckpt_format.verify(tmp_path) == [] and os.path.getsize(tmp_path / "seeked.bin") == 100
