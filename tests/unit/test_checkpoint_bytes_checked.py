"""What is validated is what the manifest lists (issue 49, item 6), and its reasons print as one line (item 13).

A rank can serve different bytes to different opens of one file (or swap it by rename between them): the
check that interprets a file must hash the very bytes it interprets.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint_untrusted import rewrite_manifest
from test_checkpoint_validation import save, tensor_file

from trainyard.checkpoint import readonce
from trainyard.checkpoint import validate as validation
from trainyard.checkpoint.validate import validate


def test_a_file_swapped_after_the_inspector_loaded_it_is_not_valid(tmp_path: Path, monkeypatch) -> None:
    """The inspector sees finite weights; the file is then swapped (by rename) for one with a NaN that the
    manifest lists. Hashed on a second read, the NaN file would pass and be published."""
    path = save(tmp_path, 10)
    data = tensor_file(path)
    good = data.read_bytes()
    assert good.count(struct.pack("<f", 27.0)) == 1
    bad = good.replace(struct.pack("<f", 27.0), struct.pack("<f", float("nan")))
    data.write_bytes(bad)
    rewrite_manifest(path)  # the manifest lists the NaN bytes
    data.write_bytes(good)  # what the inspector is served
    send, receive = validation.Inspector._send, validation.Inspector._receive
    answers: list[list[str]] = []

    def send_then_swap(self, *args, **kwargs):
        failed = send(self, *args, **kwargs)
        answers.append(receive(self, 60))  # the inspector has read the file...
        swapped = tmp_path / "swap"
        swapped.write_bytes(bad)
        os.replace(swapped, data)  # ...and the rank swaps it before anything else reads it
        return failed

    monkeypatch.setattr(validation.Inspector, "_send", send_then_swap)
    monkeypatch.setattr(validation.Inspector, "_receive", lambda self, timeout_s: answers.pop())
    result = validate(path)
    assert not result.valid
    assert any(p.startswith(f"{data.name}: sha256 mismatch") for p in result.problems), result.problems


def test_a_reader_hashes_the_bytes_it_returns_even_if_the_file_is_swapped(tmp_path: Path) -> None:
    file = tmp_path / "f"
    file.write_bytes(b"a" * 100_000)
    with readonce.Once(tmp_path, "f") as once:
        first = once.read(50_000)
        file.write_bytes(b"b" * 100_000)  # a new file under the name: the open one is still read
        rest = once.read(10**6)
        assert once.finish() == (100_000, hashlib.sha256(first + rest).hexdigest())


def test_a_reader_follows_no_link(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_bytes(b"x")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "sub").symlink_to(tmp_path / "real")
    (tmp_path / "ckpt" / "f").symlink_to(tmp_path / "real" / "f")
    for rel in ("sub/f", "f", "../real/f"):
        try:
            readonce.Once(tmp_path / "ckpt", rel)
        except OSError:
            continue
        raise AssertionError(f"{rel} was opened through a link")


def test_rank_chosen_names_reach_the_problems_as_one_printable_line(tmp_path: Path) -> None:
    path = tmp_path / "step_000010"
    weights = torch.ones(4)
    weights[0] = float("nan")
    dcp.save({"model": {"w\nprogress: step 999 \x1b[2K": weights}}, checkpoint_id=path, no_dist=True)
    rewrite_manifest(path)
    (path / "late\nprogress: forged").write_bytes(b"x")
    result = validate(path)
    assert len(result.problems) == 1 and "not listed" in result.problems[0]
    assert "\n" not in result.problems[0] and "late\\nprogress: forged" in result.problems[0]
    (path / "late\nprogress: forged").unlink()
    [problem] = validate(path).problems
    assert "\n" not in problem and "\x1b" not in problem and "w\\nprogress: step 999 \\x1b[2K" in problem
