from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.events.ledger import Ledger, run_dir, safe_name
from trainyard.spec.templating import placeholder_problems, render


def test_ledger_appends_filters_and_skips_a_torn_line(tmp_path: Path) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "step", step=1, loss=2.5)
    ledger.append("burn_in", "node_verdict", node="node-0")
    with ledger.path.open("a") as fh:
        fh.write('{"stage": "train", "eve')  # a writer killed mid-line
    assert [e["step"] for e in ledger.events("train", "step")] == [1]
    assert len(list(ledger.events())) == 2


def test_run_dirs_of_two_runs_never_collide(tmp_path: Path) -> None:
    a = run_dir(tmp_path, "nightly", "backfill__2026-11-01T02:00:00+00:00")
    b = run_dir(tmp_path, "nightly", "backfill__2026-11-02T02:00:00+00:00")
    assert a != b and a.parent == b.parent
    assert "/" not in safe_name("../../etc") and safe_name("../../etc").startswith("etc~")


@pytest.mark.parametrize(
    "ids",
    [
        ("nightly", "nightly_"),
        ("a/b", "a_b"),
        ("a:b", "a_b"),
        ("a/b", "a:b"),
        (".", "_"),
        ("x" * 201, "x" * 202),
        ("a_b", f"a_b~{'0' * 16}"),
    ],
)
def test_distinct_ids_never_share_a_folder(tmp_path: Path, ids: tuple[str, str]) -> None:
    first, second = ids
    assert safe_name(first) != safe_name(second)
    assert run_dir(tmp_path, first, "r") != run_dir(tmp_path, second, "r")
    assert run_dir(tmp_path, "d", first) != run_dir(tmp_path, "d", second)
    for name in map(safe_name, ids):
        assert name not in (".", "..") and "/" not in name and len(name) <= 255


def test_ids_that_are_already_safe_keep_their_folder_names() -> None:
    assert [safe_name(i) for i in ("nightly", "train-7b.v2", "backfill_2026")] == [
        "nightly",
        "train-7b.v2",
        "backfill_2026",
    ]
    assert safe_name("manual__2026-11-29T02:00:00+00:00").startswith("manual__2026-11-29T02_00_00_00_00~")


def test_render_fills_run_and_environment() -> None:
    run = {"ds": "2026-11-28", "ds_nodash": "20261128", "dag_id": "d", "run_id": "r"}
    assert (
        render(
            "file://${ROOT}/x/{{ ds }}/{{ds_nodash}}",
            run,
            {"ROOT": "/data", "AIRFLOW__TRAINYARD__SPEC_VARIABLES": "ROOT"},
        )
        == "file:///data/x/2026-11-28/20261128"
    )
    assert render("${TRAINYARD_HOME}/x", run, {}).endswith(".trainyard/x")
    with pytest.raises(KeyError, match="environment variable NOPE is not set"):
        render("${NOPE}/x", run, {"AIRFLOW__TRAINYARD__SPEC_VARIABLES": "NOPE"})


def test_placeholder_problems() -> None:
    assert placeholder_problems("a/{{ ds }}/${HOME}") == []
    assert "unknown template variable" in placeholder_problems("{{ execution_date }}")[0]
    assert "unbalanced" in placeholder_problems("a/{{ ds }/b")[0]
