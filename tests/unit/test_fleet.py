"""The fleet history: one file per node, the references it gives, and the cool-down of an evicted node."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from trainyard.burnin.fleet import KEEP, Fleet

DAY = 24 * 3600.0
NOW = 1_800_000_000.0
FIG = {"matmul_gflops": 120.0, "membw_gbps": 15.0}


def test_outcomes_are_kept_per_node_and_capped(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / ".fleet")
    for i in range(KEEP + 5):
        fleet.record("node-0", "local:h", at=NOW + i, run_id=f"r{i}", figures=FIG, verdict="train")
    history = fleet.read("node-0")
    assert history is not None and len(history.runs) == KEEP and history.runs[-1]["run"] == f"r{KEEP + 4}"
    data = json.loads(fleet.path("node-0").read_text())
    assert data["kind"] == "local:h" and data["runs"][-1]["figures"] == FIG


def test_the_reference_is_the_median_of_healthy_undrilled_runs_of_the_same_kind(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    for node, value in [("a", 100.0), ("b", 110.0), ("c", 120.0)]:
        fleet.record(node, "h100", at=NOW, run_id="r", figures={"matmul_gflops": value}, verdict="train")
    fleet.record("d", "h100", at=NOW, run_id="r", figures={"matmul_gflops": 10.0}, verdict="evicted", reason="slow")
    fleet.record(
        "e", "h100", at=NOW, run_id="r", figures={"matmul_gflops": 80.0}, verdict="train", drill="throttle:0.2"
    )
    fleet.record("f", "a100", at=NOW, run_id="r", figures={"matmul_gflops": 40.0}, verdict="spare")
    assert fleet.references(["h100", "a100"]) == {"h100": {"matmul_gflops": 110.0}, "a100": {}}  # a100: one figure


def test_an_eviction_starts_a_cool_down_then_the_node_is_due_for_a_retest(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.record("node-1", "k", at=NOW, run_id="r1", figures=FIG, verdict="evicted", reason="straggler")
    fleet.record("node-0", "k", at=NOW, run_id="r1", figures=FIG, verdict="train")
    assert fleet.cooling(["node-0", "node-1"], NOW + DAY - 1, DAY) == {"node-1": NOW + DAY}
    assert fleet.due(["node-0", "node-1"], NOW + DAY - 1, DAY) == []
    assert fleet.cooling(["node-0", "node-1"], NOW + DAY, DAY) == {}
    assert fleet.due(["node-0", "node-1"], NOW + DAY, DAY) == ["node-1"]
    fleet.record("node-1", "k", at=NOW + DAY, run_id="r2", figures=FIG, verdict="train")  # passed: re-admitted
    assert fleet.due(["node-1"], NOW + 3 * DAY, DAY) == [] and fleet.read("node-1").evicted_at is None  # type: ignore[union-attr]


def test_a_drill_eviction_starts_no_cool_down(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path)
    fleet.record("node-1", "k", at=NOW, run_id="r", figures=FIG, verdict="evicted", reason="x", drill="throttle:0.2")
    assert fleet.cooling(["node-1"], NOW + 1, DAY) == {}


def test_an_unreadable_or_foreign_history_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fleet = Fleet(tmp_path)
    tmp_path.mkdir(exist_ok=True)
    fleet.path("node-0").write_text("{not json")
    fleet.path("node-1").write_text(json.dumps({"node": "node-9", "runs": []}))  # another node's file under this name
    fleet.path("node-2").write_text(
        json.dumps(
            {
                "node": "node-2",
                "kind": "k",
                "runs": [{"figures": {"matmul_gflops": "fast", "x": 1e400}, "verdict": "train"}],
            }
        )
    )
    with caplog.at_level(logging.WARNING):
        assert fleet.read("node-0") is None and fleet.read("node-1") is None
    assert "node-0" in caplog.text and "unreadable" in caplog.text
    assert fleet.read("node-2").runs[0]["figures"] == {}  # type: ignore[union-attr]  # numbers only
    assert fleet.cooling(["node-0", "node-1", "node-2"], NOW, DAY) == {}


def test_a_node_name_cannot_leave_the_history_folder(tmp_path: Path) -> None:
    fleet = Fleet(tmp_path / ".fleet")
    fleet.record("../../etc/passwd", "k", at=NOW, run_id="r", figures=FIG, verdict="train")
    assert [p.parent for p in (tmp_path / ".fleet").iterdir()] == [tmp_path / ".fleet"]
    assert fleet.read("../../etc/passwd") is not None
