"""A node's log tail: only its end is read (a log of gigabytes is never read whole), each line printable."""

from __future__ import annotations

import os
from pathlib import Path

from test_ledger_bounded_reads import GiB, address_space, bytes_read

from trainyard.recovery.watch import TAIL_LINES, tail


def test_a_2_gib_log_costs_its_last_kib_only(tmp_path: Path) -> None:
    log = tmp_path / "node-0.log"
    log.write_bytes(b"started\n")
    os.truncate(log, 2 * GiB)  # a sparse log: gigabytes of NUL bytes, no disk
    with log.open("ab") as fh:
        fh.write(b"\nTraceback (most recent call last):\n  File train.py\nRuntimeError: CUDA out of memory\n")
    before = bytes_read()
    with address_space(256 * 2**20):  # reading it whole would need 2 GiB and more
        text = tail(str(log))
    assert bytes_read() - before < 2**20  # its end: 64 KiB
    assert text.endswith("Traceback (most recent call last):\n  File train.py\nRuntimeError: CUDA out of memory")


def test_a_small_log_gives_its_last_lines_as_before(tmp_path: Path) -> None:
    log = tmp_path / "node-0.log"
    log.write_text("".join(f"line {i}\n" for i in range(200)))
    assert tail(str(log)).splitlines() == [f"line {i}" for i in range(200 - TAIL_LINES, 200)]
    assert tail(str(log), 3) == "line 197\nline 198\nline 199"
    assert tail(str(tmp_path / "absent.log")) == ""


def test_escape_sequences_in_a_log_are_quoted_as_text(tmp_path: Path) -> None:
    log = tmp_path / "node-0.log"
    log.write_bytes("ok\n\x1b[2K\x1b[1Aprogress: step 999\x07 done\x9b0m\n\tindented\n".encode())
    text = tail(str(log))
    assert text.splitlines() == ["ok", "\\x1b[2K\\x1b[1Aprogress: step 999\\x07 done\\x9b0m", "        indented"]
