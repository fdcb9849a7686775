"""``runtime.follow_batch``: the split of TRAINYARD_GLOBAL_BATCH over the world, said once per attempt."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.events.ledger import Ledger
from trainyard.protocol.env import TrainEnv
from trainyard.runtime import follow_batch


def contract(tmp_path: Path, attempt: int = 1, micro: int | None = 2) -> TrainEnv:
    ledger = Ledger.in_dir(tmp_path)
    return TrainEnv(data_dir=tmp_path, checkpoint_dir=tmp_path / "ckpt", max_steps=10, events_dir=ledger.events_dir,
                    run_id=tmp_path.name, attempt=attempt, global_batch=16, micro_batch=micro, node="node-0")  # fmt: skip


@pytest.mark.parametrize(
    ("rank", "world", "micro", "expected"),
    [("0", "2", 2, (2, 4)), ("0", "4", 2, (2, 2)), ("0", "2", None, (8, 1)), ("1", "2", 4, (4, 2))],
)
def test_the_micro_batch_and_accumulation_keep_the_global_batch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: str, world: str, micro: int | None, expected: tuple
) -> None:
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    assert tuple(follow_batch(contract(tmp_path, micro=micro))) == expected


def test_rank_0_says_it_once_per_attempt_and_other_ranks_never(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    follow_batch(contract(tmp_path))
    assert list(Ledger.in_dir(tmp_path).events("train", "batch_followed")) == []
    monkeypatch.setenv("RANK", "0")
    for attempt in (1, 1, 2):
        assert follow_batch(contract(tmp_path, attempt=attempt)) == (2, 4)
    said = list(Ledger.in_dir(tmp_path).events("train", "batch_followed"))
    assert [(e["attempt"], e["global_batch"], e["micro_batch"], e["accumulation"]) for e in said] == [
        (1, 16, 2, 4),
        (2, 16, 2, 4),
    ]


def test_a_batch_that_does_not_split_is_a_value_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="divisible"):
        follow_batch(contract(tmp_path))
