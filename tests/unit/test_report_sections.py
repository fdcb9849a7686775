"""The report's sections from a summary dict: every stage, a failed stage's whole error, a cleared burn-in
node, the world path and a healthy run's recovery in words, the configuration, the gate and the links."""

from __future__ import annotations

import re
from typing import Any

from trainyard.report.attempts import world_path
from trainyard.report.burn_in import burn_in_section
from trainyard.report.charts import burnin_svg
from trainyard.report.context import config_section, gate_section, links_section, metrics_section
from trainyard.report.details import STAGES, airflow_links
from trainyard.report.pages import recovery_section, run_page, stages_section

ERROR = "DataError: " + "shard_0003.tok has 12 tokens, fewer than 1000 " * 5 + "; check dataset.source and the path"


def test_every_stage_is_listed_and_a_failed_stages_error_is_whole() -> None:
    done = {
        "stage_dataset": {"seconds": 1.0, "ok": True, "start": 1.0, "end": 2.0},
        "check_dataset": {"seconds": 1.0, "ok": False, "start": 2.0, "end": 3.0, "error": ERROR},
    }
    html = stages_section({"stages": done, "running": []})
    rows = re.findall(r"<tr><td>([a-z_]+)</td>(.*?)</tr>", html)
    assert [name for name, _ in rows] == list(STAGES)
    assert all("did not run" in cells for name, cells in rows if name not in done)
    assert f'<pre class="error">{ERROR}</pre>' in html and "<details>" not in html  # not folded at 120 characters


def test_the_report_stage_writing_this_report_is_not_said_not_to_have_run() -> None:
    """The report stage writes the report while it runs: its row said "did not run" in every report."""
    done = {name: {"seconds": 1.0, "ok": True, "start": 1.0, "end": 2.0} for name in STAGES if name != "report"}
    html = stages_section({"stages": done, "running": [], "writing_report": True})
    [(_, cells)] = [row for row in re.findall(r"<tr><td>([a-z_]+)</td>(.*?)</tr>", html) if row[0] == "report"]
    assert "writing this report" in cells and "did not run" not in cells


def test_a_node_cleared_by_the_second_round_is_not_drawn_red() -> None:
    svg = burnin_svg(
        "matmul_gflops",
        {"node-0": 100.0, "node-1": 80.0, "node-2": 30.0},
        88.2,
        98.0,
        {"node-0": "train", "node-1": "train", "node-2": "evicted"},
        again={"node-1": 97.0, "node-2": 31.0},
    )
    bars = svg.split('<rect class="bar"')[1:]
    assert 'fill="#ff7f0e"' in bars[1] and "cleared by the second" in bars[1]  # below in round one only
    assert 'fill="#d62728"' in bars[2]  # evicted: still red
    assert svg.count('class="again"') == 2 and "node-1 again: 97.00" in svg


def test_burn_in_section_passes_the_second_rounds_figures() -> None:
    summary: dict[str, Any] = {
        "node_verdicts": {
            "node-0": {"figures": {"matmul_gflops": 100.0}, "verdict": "train"},
            "node-1": {
                "figures": {"matmul_gflops": 80.0},
                "verdict": "train",
                "suspect": "slow",
                "again": {"matmul_gflops": 97.0},
            },
        },
        "thresholds": {"thresholds": {"matmul_gflops": 88.2}, "references": {"matmul_gflops": 98.0}},
    }
    html = burn_in_section(summary)
    bars = html.split('<rect class="bar"')[1:]
    assert "node-1 again: 97.00" in html and not any('fill="#d62728"' in bar.split("</rect>")[0] for bar in bars)


def test_the_world_path_is_said_in_words() -> None:
    assert (
        world_path("2")
        == "<p>World path: 2 (the world size, 2 ranks throughout: no relaunch or regroup changed it).</p>"
    )
    assert "World path: 2 -&gt; 1 (the world size in ranks at the start, then after each relaunch" in world_path(
        "2 -> 1"
    )
    assert world_path(None) == ""


def test_a_healthy_runs_recovery_says_no_faults_not_dashes() -> None:
    figures = {
        "detection_s": None,
        "resume_delay_s": None,
        "lost_steps": None,
        "productive_s": 9.5,
        "ettr": 0.91,
        "world_path": "2",
    }
    html = recovery_section({"recovery": figures, "attempts": 1, "attempt_details": [{"faults": []}]})
    assert "No faults" in html and "<td>-</td>" not in html and "0.91" in html
    faulted = recovery_section({"recovery": figures, "attempts": 2, "attempt_details": [{"faults": [{}]}, {}]})
    assert "No faults" not in faulted and "failure detected after (s)" in faulted


def test_the_configuration_shows_the_overrides_and_the_pinned_spec() -> None:
    summary = {
        "pinned": {"overrides": {"max_steps": {"spec": 30, "run": 24}}, "spec_file": "/dags/nightly.yaml"},
        "details": {"spec": {"training": {"max_steps": 24, "args": {"lr": "<b>"}}}},
    }
    html = config_section(summary)
    assert "<td>max_steps</td><td>30</td><td>24</td>" in html and "/dags/nightly.yaml" in html
    assert "&quot;max_steps&quot;: 24" in html and "<b>" not in html.split("spec.json")[1]
    assert "No Param changed" in config_section({"pinned": {"overrides": {}}, "details": {}})


def test_the_gate_shows_its_values_problems_and_metric_checks() -> None:
    summary = {
        "gate": {
            "path": "/ck/step_000024",
            "valid": False,
            "step": 24,
            "target_step": 24,
            "steps_short": 0,
            "manifest_sha256": "9e5b",
            "seconds": 0.3,
            "problems": [".metadata: sha256 mismatch"],
            "notes": [],
        },
        "details": {
            "gate_checks": [
                {"suite": None, "check": "loss recorded for step 24", "passed": True, "observed": "0 of 1 rows outside"}
            ]
        },
    }
    html = gate_section(summary)
    for text in (
        "<td>run's final step</td><td>24</td>",
        "9e5b",
        ".metadata: sha256 mismatch",
        "loss recorded for step 24",
    ):
        assert text in html, text


def test_metrics_charts_share_the_loss_steps_and_mark_faults() -> None:
    points = [[1, 100.0], [10, 90.0]]
    summary = {
        "metrics": {
            "loss": {"points": [[1, 5.0], [20, 4.0]], "bands": []},
            "tokens_per_s": {"points": points, "bands": []},
            "step_ms": {"points": points, "bands": [[2, 10, 80.0, 400.0]]},
            "lr": {"points": points, "bands": []},
            "world_size": [[1, 2.0], [9, 1.0]],
            "faults": [{"step": 9, "label": "node_lost on node-1 -> scale_down"}],
        }
    }
    html = metrics_section(summary)
    for label in ("throughput (tokens/s)", "step time (ms)", "learning rate", "world size (ranks)"):
        assert f'aria-label="{label} versus step"' in html, label
    assert html.count('class="fault"') == 4 and html.count('class="band"') == 1
    assert html.count("step 20</text>") == 4  # every chart spans the loss curve's steps


def test_links_reach_airflow_and_the_node_logs_from_the_view_and_the_file() -> None:
    summary = {
        "details": {
            "links": airflow_links("../../..", "d", "r"),
            "node_logs": [{"name": "attempt-1/node-0.log", "bytes": 10}],
        }
    }
    html = links_section(summary)
    assert 'href="../../../dags/d/runs/r"' in html and 'href="../../../dags/d/runs/r/tasks/train"' in html
    assert 'href="attempt-1/node-0.log"' in html  # the report file sits in the run folder
    page = run_page({**summary, "stages": {}, "node_verdicts": {}, "loss_curve": []}, {"dag_id": "d", "run_id": "r"})
    assert 'href="../../runs/d/r/attempt-1/node-0.log"' in page
