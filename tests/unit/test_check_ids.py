"""``trainyard check`` refuses what would break the DAG folder: a file name that is no DAG id, two specs with one
id (issue 52). The DAG folder's own scan is exercised in tests/integration/test_dag_folder_check.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from check_specs import write

from trainyard.cli import main as cli
from trainyard.spec import check_files, load_spec
from trainyard.spec.ids import dag_id_problems, duplicate_ids


@pytest.mark.parametrize("name", ["my pipeline.yaml", "nächtlich?.yaml", "a+b.yaml"])
def test_a_file_name_airflow_refuses_as_dag_id_fails_check(tmp_path: Path, name: str) -> None:
    path = write(tmp_path, name)
    [line] = check_files([tmp_path])
    assert line.startswith(f"{path}: pipeline: the file name {name!r}"), line
    assert "rename the file" in line and "set pipeline:" in line


def test_an_id_longer_than_airflow_takes_is_refused(tmp_path: Path) -> None:
    spec = load_spec(write(tmp_path, "p.yaml"))  # a file system keeps names under 256 bytes: only the rule is run
    [line] = dag_id_problems(tmp_path / f"{'x' * 251}.yaml", spec)
    assert "at most 250 characters" in line


def test_the_fix_the_message_names_passes(tmp_path: Path) -> None:
    [line] = check_files([write(tmp_path, "my pipeline.yaml")])
    assert "(e.g. my_pipeline.yaml)" in line
    assert check_files([write(tmp_path, "my_pipeline.yaml")]) == []
    assert check_files([write(tmp_path, "my pipeline.yaml", pipeline="my_pipeline2")]) == []


def test_valid_unusual_names_pass(tmp_path: Path) -> None:
    for name in ("nightly-v2.yaml", "team.a_pretrain.yml", "übung.yaml"):  # Airflow's \w takes Unicode letters
        path = write(tmp_path, name)
        assert dag_id_problems(path, load_spec(path)) == [], name


def test_two_specs_with_one_dag_id_fail_check_naming_both(tmp_path: Path) -> None:
    first = write(tmp_path, "a_nightly.yaml", pipeline="nightly", dataset='{source: "file:///a", name: a}')
    second = write(tmp_path, "b_new.yaml", pipeline="nightly", dataset='{source: "file:///b", name: b}')
    [line] = check_files([tmp_path])
    assert line.startswith(f"{second}: pipeline: DAG id 'nightly' is already used by {first.name}"), line
    assert "give this spec a pipeline: id of its own" in line


def test_a_file_stem_and_a_pipeline_field_may_collide(tmp_path: Path) -> None:
    write(tmp_path, "nightly.yaml", dataset='{source: "file:///a", name: a}')
    other = write(tmp_path, "other.yaml", pipeline="nightly", dataset='{source: "file:///b", name: b}')
    assert duplicate_ids({p: load_spec(p) for p in sorted(tmp_path.glob("*.yaml"))}).keys() == {other}


def test_a_copy_that_sorts_first_does_not_take_the_dag_of_the_file_named_after_its_id(tmp_path: Path) -> None:
    """Copying nightly_pretrain.yaml to a new name that keeps ``pipeline: nightly_pretrain``: the new file is refused,
    and the DAG stays the one of the file named after it (file-name order alone gave it to the copy)."""
    original = write(tmp_path, "nightly_pretrain.yaml", dataset='{source: "file:///a", name: a}')
    copy = write(tmp_path, "nightly_copy.yaml", pipeline="nightly_pretrain", dataset='{source: "file:///b", name: b}')
    problems = duplicate_ids({p: load_spec(p) for p in sorted(tmp_path.glob("*.yaml"))})
    assert problems.keys() == {copy}, problems
    assert f"already used by {original.name}" in problems[copy]


def test_the_command_exits_1_and_prints_every_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path, "good.yaml", dataset='{source: "file:///g", name: g}')
    write(tmp_path, "my pipeline.yaml", dataset='{source: "file:///m", name: m}')
    write(tmp_path, "twin.yaml", pipeline="good", dataset='{source: "file:///t", name: t}')
    assert cli(["check", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "my pipeline.yaml: pipeline:" in out and "twin.yaml: pipeline: DAG id 'good'" in out
    assert "good.yaml: pipeline" not in out and "Traceback" not in out
