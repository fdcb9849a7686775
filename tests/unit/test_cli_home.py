"""``trainyard`` run by a person in the checkout where ``make demo`` ran, without ``TRAINYARD_HOME`` set."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.cli import main
from trainyard.events.ledger import Ledger


def demo_run(home: Path) -> Path:
    run = home / "runs" / "nightly_pretrain" / "manual__1"
    run.mkdir(parents=True)
    ledger = Ledger.in_dir(run)
    ledger.append("stage_dataset", "stage_end", seconds=1.0, result={})
    return run


def test_summary_in_the_checkout_reads_its_dot_trainyard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TRAINYARD_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))  # ~/.trainyard holds nothing
    run = demo_run(tmp_path / "checkout" / ".trainyard")
    monkeypatch.chdir(tmp_path / "checkout")
    assert main(["summary", "--dag-id", "nightly_pretrain"]) == 0
    assert f"run folder:         {run}" in capsys.readouterr().out


def test_summary_elsewhere_says_the_variable_is_not_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("TRAINYARD_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    assert main(["summary", "--dag-id", "nightly_pretrain"]) == 2  # no run found: a usage error
    err = capsys.readouterr().err
    assert f"no runs of nightly_pretrain under {tmp_path / 'user' / '.trainyard' / 'runs'}" in err
    assert "TRAINYARD_HOME is not set" in err
