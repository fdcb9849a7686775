"""Run summary, report and view pages from a ledger written the way the stages write it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from trainyard.events.fold import fold
from trainyard.events.ledger import Ledger, run_dir
from trainyard.report.charts import burnin_svg, loss_svg
from trainyard.report.pages import index_page, report_html, run_href, run_page, run_url, to_json
from trainyard.report.runs import RunNotFound, find_run, overview, run_folders
from trainyard.report.summary import format_summary, run_state, summarize, write_report

RUN_ID = "manual__2026-11-28T02:00:00+00:00"
EVIL = "<script>alert('x')</script>"


def stage(ledger: Ledger, name: str, ok: bool = True, **result: object) -> None:
    ledger.append(name, "stage_start")
    if ok:
        ledger.append(name, "stage_end", seconds=1.5, result=result)
    else:
        ledger.append(name, "stage_failed", error="DataError", message=EVIL, seconds=0.5)


def write_run(root: Path, run_id: str = RUN_ID, dag_id: str = "nightly") -> Ledger:
    folder = run_dir(root, dag_id, run_id)
    folder.mkdir(parents=True)
    (folder / "spec.json").write_text(json.dumps({"dag_id": dag_id, "run_id": run_id, "ds": "2026-11-28"}))
    ledger = Ledger.in_dir(folder)
    stage(ledger, "stage_dataset")
    stage(ledger, "check_dataset", ok=False)  # failed once, then retried
    stage(ledger, "check_dataset")
    ledger.append("burn_in", "stage_start")
    for node, gflops, verdict, reason in (
        ("node-0", 100.0, "train", ""),
        ("node-1", 98.0, "train", ""),
        ("node-2", 30.0, "evicted", f"straggler: matmul_gflops 30.00 {EVIL}"),
    ):
        ledger.append(
            "burn_in",
            "node_verdict",
            node=node,
            verdict=verdict,
            reason=reason,
            collective={"64KB": 0.1},
            figures={"matmul_gflops": gflops, "membw_gbps": 20.0, "gpu": {"skipped": "no CUDA"}},
        )
    ledger.append(
        "burn_in",
        "thresholds",
        medians={"matmul_gflops": 98.0, "membw_gbps": 20.0},
        thresholds={"matmul_gflops": 88.2, "membw_gbps": 18.0},
        seconds=2.0,
    )
    ledger.append("burn_in", "stage_end", seconds=2.5, result={"healthy": ["node-0", "node-1"]})
    ledger.append("train", "stage_start")
    ledger.append("train", "lineage_reset", path=None)
    ledger.append(
        "train",
        "attempt_start",
        attempt=1,
        nodes=["node-0", "node-1"],
        world_size=2,
        micro_batch=2,
        resume_from="none",
    )
    ckpt = "/ck/nightly/step_{:06d}"
    for step in range(1, 11):
        ledger.append("train", "step", attempt=1, step=step, loss=5.0 - step * 0.1)
    ledger.append("train", "checkpoint_saved", attempt=1, step=4, path=ckpt.format(4))
    ledger.append(
        "train", "checkpoint_validated", path=ckpt.format(4), step=4, valid=False, problems=["sha256 mismatch"]
    )
    ledger.append(
        "train",
        "checkpoint_quarantined",
        path=ckpt.format(4),
        to="/ck/nightly/quarantine/step_000004-1",
        problems=["sha256 mismatch"],
    )
    ledger.append("train", "checkpoint_saved", attempt=1, step=8, path=ckpt.format(8))
    ledger.append("train", "checkpoint_validated", path=ckpt.format(8), step=8, valid=True, problems=[])
    ledger.append("train", "checkpoint_promoted", path=ckpt.format(8), step=8)
    ledger.append("train", "drill_fired", fault="kill", node="node-1", step=10)
    ledger.append("train", "attempt_end", attempt=1, state="failed", trigger="crash", reason="node-1 exited -9")
    ledger.append(
        "train",
        "failure_classified",
        attempt=1,
        kind="node_lost",
        evidence=f"node-1 exit -9 {EVIL}",
        culprits=["node-1"],
        detected_at=0,
    )
    ledger.append(
        "train",
        "decision",
        attempt=1,
        kind="node_lost",
        action="scale_down",
        nodes=["node-0", "node-1"],
        reason="scale down 2 -> 1 nodes",
        new_nodes=["node-0"],
        micro_batch=2,
        delay_s=0.2,
    )
    ledger.append(
        "train", "attempt_start", attempt=2, nodes=["node-0"], world_size=1, micro_batch=2, resume_from="latest"
    )
    ledger.append("train", "resumed", attempt=2, step=8, path=ckpt.format(8))
    for step in range(9, 13):
        ledger.append("train", "step", attempt=2, step=step, loss=4.0 - step * 0.1)
    ledger.append("train", "checkpoint_saved", attempt=2, step=12, path=ckpt.format(12))
    ledger.append("train", "checkpoint_validated", path=ckpt.format(12), step=12, valid=True, problems=[])
    ledger.append("train", "checkpoint_promoted", path=ckpt.format(12), step=12)
    ledger.append("train", "checkpoint_retired", path=ckpt.format(8), step=8)
    ledger.append("train", "attempt_end", attempt=2, state="succeeded", seconds=3.0, last_step=12)
    ledger.append(
        "train", "recovery_figures", detection_s=0.7, resume_delay_s=5.1, lost_steps=2, productive_s=1.2, ettr=0.3
    )
    ledger.append(
        "train", "stage_end", seconds=9.0, result={"nodes": ["node-0", "node-1"], "checkpoint": ckpt.format(12)}
    )
    ledger.append("check_checkpoint", "stage_start")
    ledger.append("check_checkpoint", "checkpoint_checked", path=ckpt.format(12), valid=True, problems=[], seconds=0.1)
    ledger.append("check_checkpoint", "stage_end", seconds=0.2, result={"checkpoint": ckpt.format(12), "step": 12})
    stage(ledger, "publish", uri="file:///cold/nightly/step_000012")
    return ledger


def test_the_summary_has_every_section_from_the_ledger(tmp_path: Path) -> None:
    summary = summarize(write_run(tmp_path))
    assert list(summary["stages"]) == [
        "stage_dataset",
        "check_dataset",
        "burn_in",
        "train",
        "check_checkpoint",
        "publish",
    ]
    assert summary["stages"]["check_dataset"]["ok"]  # the retry's end replaces the failed try
    assert summary["state"] == "running" and summary["running"] == []  # ended publish, report not yet run
    assert summary["thresholds"]["thresholds"]["matmul_gflops"] == 88.2
    assert summary["node_verdicts"]["node-2"]["verdict"] == "evicted"
    first, second = summary["attempt_details"]
    assert (
        first["state"] == "failed"
        and first["failure"]["kind"] == "node_lost"
        and first["decision"]["action"] == "scale_down"
    )
    assert first["decision"]["new_nodes"] == ["node-0"] and first["drills"][0]["fault"] == "kill"
    assert second["state"] == "succeeded" and second["resumed_step"] == 8 and second["last_step"] == 12
    ckpts = {c["step"]: c for c in summary["checkpoints"]}
    assert ckpts[4]["valid"] is False and ckpts[4]["fate"] == ["quarantined to /ck/nightly/quarantine/step_000004-1"]
    assert ckpts[8]["fate"] == ["promoted", "retired (keep_hot)"] and not ckpts[8]["latest"]
    assert ckpts[12]["latest"] and ckpts[12]["fate"] == ["promoted", "gate passed"]
    assert summary["latest_checkpoint"] == "/ck/nightly/step_000012"
    assert summary["loss_curve"][-1] == (12, pytest.approx(2.8)) and summary["steps_trained"] == 12
    assert "attempts:         2" in format_summary(summary)


@pytest.mark.parametrize(
    ("paths", "line"),
    [
        ([], None),  # the train stage has not started: nothing to say
        # Allowed, but no group formed on the store yet (a script that may never group): not said as done.
        ([(True, "")], "in place (not yet: no group formed)"),
        ([(True, ""), "group_formed"], "in place"),  # the ranks formed a group on the store
        ([(False, "recovery.in_place is false")], "relaunch: recovery.in_place is false"),
        # The first failure of a script that never formed the elastic group: the stage's later word wins.
        ([(True, ""), (False, "its ranks never formed a group")], "relaunch: its ranks never formed a group"),
    ],
)
def test_the_summary_says_how_a_lost_node_is_healed(tmp_path: Path, paths: list, line: str | None) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "stage_start")
    for path in paths:
        if path == "group_formed":
            ledger.append("train", "group_formed", attempt=1)
        else:
            ledger.append("train", "recovery_path", in_place=path[0], why_not=path[1])
    summary = summarize(ledger)
    assert summary["recovery_path"] == line
    said = [t for t in format_summary(summary).splitlines() if t.startswith("  recovery path:")]
    assert said == ([f"  recovery path:    {line}"] if line else [])


@pytest.mark.parametrize(
    ("stages", "running", "state"),
    [
        ({}, ["stage_dataset"], "running"),
        ({"train": {"ok": False}}, [], "failed"),
        ({"train": {"ok": False}}, ["train"], "running"),  # a retry of the failed task is on
        ({"train": {"ok": True}}, [], "running"),  # between two tasks
        ({"train": {"ok": True}, "report": {"ok": True}}, [], "succeeded"),
    ],
)
def test_run_state(stages: dict, running: list, state: str) -> None:
    assert run_state(stages, running) == state


def test_the_report_file_shows_every_section_and_escapes_the_ledger(tmp_path: Path) -> None:
    ledger = write_run(tmp_path)
    folder = ledger.path.parent
    result = write_report(folder, fold(ledger.events()))
    page = Path(result["report"]).read_text()
    assert EVIL not in page and "&lt;script&gt;" in page
    for text in (
        "<h2>Stages</h2>",
        "<h2>Burn-in</h2>",
        "<h2>Training attempts</h2>",
        "<h2>Loss</h2>",
        "<h2>Checkpoints</h2>",
        "<h2>Recovery figures</h2>",
        'aria-label="loss versus step"',
        'aria-label="matmul_gflops per node against its threshold"',
        'aria-label="training attempts over time"',
        "node_lost",
        "scale_down",
        "<b>LATEST</b>",
        RUN_ID,
    ):
        assert text in page, text
    saved = json.loads((folder / "summary.json").read_text())
    assert saved["state"] == "succeeded"  # written by the report stage: the other stages decide
    assert saved["report"] == str(folder / "report.html")


def test_burn_in_bars_below_the_threshold_are_red_and_other_evictions_grey() -> None:
    svg = burnin_svg(
        "matmul_gflops",
        {"node-0": 100.0, "node-2": 30.0, "node-1": 95.0, "node-3": None},
        88.2,
        98.0,
        {"node-0": "train", "node-2": "evicted", "node-1": "evicted", "node-3": "evicted"},
    )
    bars = svg.split('<rect class="bar"')[1:]
    assert 'fill="#2ca02c"' in bars[0] and 'fill="#d62728"' in bars[1]
    assert 'fill="#bbbbbb"' in bars[2]  # passed this probe, evicted for another
    assert "threshold 88.2" in svg and "no figure (evicted)" in svg


def test_the_loss_curve_marks_resumes_and_skips_non_finite_losses() -> None:
    svg = loss_svg([(1, 5.0), (2, math.nan), (3, 4.0), (4, 3.5)], [(3, "attempt 2")])
    assert svg.count('class="boundary"') == 1 and "attempt 2" in svg
    assert "nan" not in svg.split('class="loss"')[1]  # the polyline holds finite points only
    assert "loss nan at step 2" in svg
    assert "No loss curve" in loss_svg([(1, 5.0)])


def test_find_run_maps_airflow_ids_and_refuses_paths(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    folder = write_run(root).path.parent
    assert find_run(root, "nightly", RUN_ID) == folder.resolve()
    with pytest.raises(RunNotFound):  # its snapshot names the run: its folder name is not its id
        find_run(root, "nightly", folder.name)
    bare = root / "nightly" / "by-hand"
    bare.mkdir()
    Ledger.in_dir(bare).append("train", "step", step=1)
    assert find_run(root, "nightly", "by-hand") == bare.resolve()  # no snapshot: the folder name works
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "events.jsonl").write_text("{}\n")
    (root / "nightly" / "link").symlink_to(tmp_path / "outside")
    for run_id in ("..", "../outside", "a/b", "..\\x", "", "link"):
        with pytest.raises(RunNotFound):
            find_run(root, "nightly", run_id)
    with pytest.raises(RunNotFound, match="not a valid DAG id"):
        find_run(root, "..", "outside")
    with pytest.raises(RunNotFound, match="no run 'nope' of DAG 'nightly'"):
        find_run(root, "nightly", "nope")


def test_a_folder_shared_by_two_dags_is_served_only_as_the_dag_its_snapshot_names(tmp_path: Path) -> None:
    """Before names were distinct, DAGs ``nightly`` and ``nightly_`` shared the folder ``nightly``."""
    root = tmp_path / "runs"
    write_run(root, run_id="r1", dag_id="nightly")
    assert run_dir(root, "nightly_", "r1") != run_dir(root, "nightly", "r1")
    with pytest.raises(RunNotFound):  # the legacy name of nightly_ is nightly: its snapshot says whose it is
        find_run(root, "nightly_", "r1")
    legacy = root / "scheduled_x" / "manual__1_00"  # written under the old names by DAG scheduled:x
    legacy.mkdir(parents=True)
    (legacy / "spec.json").write_text(json.dumps({"dag_id": "scheduled:x", "run_id": "manual__1:00"}))
    Ledger.in_dir(legacy).append("train", "step", step=1)
    assert find_run(root, "scheduled:x", "manual__1:00") == legacy.resolve()  # old runs are still found
    with pytest.raises(RunNotFound):
        find_run(root, "scheduled_x", "manual__1_00")  # but not under the ids it does not belong to
    (legacy / "spec.json").unlink()
    (legacy / "spec.json").symlink_to(root / "nightly" / "r1" / "spec.json")
    with pytest.raises(RunNotFound, match="cannot tell whose run"):
        find_run(root, "scheduled:x", "manual__1:00")


def test_the_index_lists_runs_per_dag_newest_first(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    write_run(root, "scheduled__2026-11-27T02:00:00+00:00")
    write_run(root, RUN_ID)
    rows = [overview(f) for f in run_folders(root)]
    assert {r["run_id"] for r in rows} == {RUN_ID, "scheduled__2026-11-27T02:00:00+00:00"}
    page = index_page(rows)
    assert page.index(RUN_ID) < page.index("scheduled__2026-11-27")  # written later: newer
    assert f'href="{run_href("nightly", RUN_ID)}"' in page and "%3A" in run_href("nightly", RUN_ID)
    assert "No run ledger found" in index_page([], "/x/runs")


def test_run_page_links_stay_relative_and_json_has_no_nan(tmp_path: Path) -> None:
    ledger = write_run(tmp_path)
    summary = summarize(ledger)
    page = run_page(summary, {"dag_id": "nightly", "run_id": RUN_ID}, has_report=True)
    assert 'href="../../"' in page and f'href="../../{run_href("nightly", RUN_ID)}/summary.json"' in page
    assert run_url("http://af:8080/", "nightly", RUN_ID) == f"http://af:8080/trainyard/{run_href('nightly', RUN_ID)}"
    assert json.loads(to_json({"loss": [(1, math.nan)]})) == {"loss": [[1, None]]}
    assert report_html(summary)  # renders without an identity too


def test_the_burn_in_section_shows_both_rounds_and_a_cleared_suspect() -> None:
    from trainyard.report.burn_in import burn_in_section

    figures = {"matmul_gflops": 120.0, "membw_gbps": 15.0}
    summary = {
        "node_verdicts": {
            "node-0": {"figures": figures, "again": {"matmul_gflops": 118.0}, "verdict": "train", "reason": ""},
            "node-1": {
                "figures": {"matmul_gflops": 95.0, "membw_gbps": 15.0},
                "again": {"matmul_gflops": 117.0},
                "suspect": "straggler: matmul_gflops 95.00 < 0.90 x 120.00 (median of 3)",
                "verdict": "train",
                "reason": "",
            },
            "node-2": {"figures": figures, "verdict": "train", "reason": ""},
        },
        "thresholds": {
            "thresholds": {"matmul_gflops": 108.0, "membw_gbps": 13.5},
            "references": {"matmul_gflops": 120.0, "membw_gbps": 15.0},
            "seconds": 6.1,
        },
    }
    page = burn_in_section(summary)
    assert page.count("<i>again</i>") == 2 and "<i>reference</i>" in page
    assert "suspect, cleared by the second round: straggler: matmul_gflops 95.00" in page
    assert "117.00" in page or "117.0" in page


def test_the_summary_names_the_final_nodes_and_never_calls_unknown_figures_0(tmp_path: Path) -> None:
    """A scale-down of a script that reports no steps and writes no heartbeats (issue 31)."""
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "stage_start")
    ledger.append("train", "attempt_start", attempt=1, nodes=["node-0", "node-1"], world_size=2, micro_batch=4)
    ledger.append("train", "hang_detection_off", attempt=1, reason="the training script writes no heartbeats (x)")
    ledger.append("train", "attempt_end", attempt=1, state="failed", trigger="crash")
    ledger.append("train", "decision", attempt=1, kind="node_lost", action="scale_down", new_nodes=["node-0"])
    ledger.append("train", "attempt_start", attempt=2, nodes=["node-0"], world_size=1, micro_batch=4)
    ledger.append("train", "attempt_end", attempt=2, state="succeeded", seconds=3.0)
    ledger.append("train", "recovery_figures", detection_s=0.7, resume_delay_s=None, resume_delay_why="no steps",
                  lost_steps=None, lost_steps_why="no steps", ettr=None)  # fmt: skip
    ledger.append("train", "stage_end", seconds=9.0, result={"nodes": ["node-0", "node-1"]})
    summary = summarize(ledger)
    assert summary["nodes_used"] == ["node-0"]
    text = format_summary(summary)
    assert "  nodes used:       node-0\n" in text
    assert "resume delay unknown (no steps), lost steps unknown (no steps)" in text
    assert "hang detection:   off: the training script writes no heartbeats (x); to turn it on, call" in text
    html = report_html(summary, {"dag_id": "d", "run_id": "r", "ds": None})
    assert "unknown (no steps)" in html and "Hang detection: off" in html
