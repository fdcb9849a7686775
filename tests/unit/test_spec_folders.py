"""Dataset folders that nest are refused (issue 13, hole 7): by ``trainyard check`` across a folder of
specs, and at run time on the rendered name (``spec.folders``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from check_specs import text

from trainyard.cli import main as cli
from trainyard.errors import SpecError
from trainyard.pipeline.run import open_run
from trainyard.spec import check_files, dataset_name_problems, load_spec, nested_roots

ROOT = Path(__file__).resolve().parents[2]


def write_specs(folder: Path, **names: tuple[str, str]) -> list[Path]:
    """One spec per (hot root, dataset name), named after the keyword."""
    paths = []
    for stem, (hot, name) in names.items():
        path = folder / f"{stem}.yaml"
        path.write_text(text(dataset=f'{{source: "file:///cold/{stem}", hot: "file://{hot}", name: "{name}"}}'))
        paths.append(path)
    return paths


@pytest.mark.parametrize(
    "a,b",
    [
        (("/hot", "tokens"), ("/hot", "tokens/{{ ds }}")),
        (("/hot", "tokens/{{ ds }}"), ("/hot", "tokens")),
        (("/hot", "tokens/{{ ds }}"), ("/hot", "tokens/2026-11-28/extra")),
        (("/hot", "data"), ("/hot/data", "x")),
        (("/hot", "night-{{ ds }}"), ("/hot", "night-eval")),
        (("/hot", "a"), ("/hot", "a")),
    ],
)
def test_nested_dataset_folders_are_refused_by_trainyard_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], a: tuple[str, str], b: tuple[str, str]
) -> None:
    first, second = write_specs(tmp_path, first=a, second=b)
    [line] = check_files([first, second])
    assert line.startswith(f"{second}: dataset.name: ") and "first.yaml's dataset" in line and "must not nest" in line
    assert cli(["check", str(tmp_path)]) == 1  # a folder: its specs, checked together
    assert "must not nest" in capsys.readouterr().out


@pytest.mark.parametrize(
    "a,b",
    [
        (("/hot", "tokens/{{ ds }}"), ("/hot", "finetune")),
        (("/hot", "night-{{ ds }}"), ("/hot", "eval-{{ ds }}")),
        (("/hot", "tokens"), ("/other-hot", "tokens")),
        (("/hot", "tokens"), ("/hot", "tokens2")),
    ],
)
def test_sibling_dataset_folders_pass(tmp_path: Path, a: tuple[str, str], b: tuple[str, str]) -> None:
    assert check_files(write_specs(tmp_path, first=a, second=b)) == []


def test_two_pipelines_may_share_one_staged_copy_of_the_same_source(tmp_path: Path) -> None:
    specs = {}
    for stem in ("pretrain", "eval"):
        path = tmp_path / f"{stem}.yaml"
        path.write_text(text())
        specs[path] = load_spec(path)
    assert nested_roots(specs) == []


def test_the_shipped_pipelines_do_not_nest() -> None:
    assert check_files(sorted((ROOT / "dags" / "pipelines").glob("*.yaml"))) == []


@pytest.mark.parametrize(
    "name,template,fragment",
    [
        ("tokens/2026-11-28", "tokens/{{ ds }}", None),
        ("manual__2026", "{{ run_id }}", None),
        ("a/b", "{{ run_id }}", "a placeholder rendered a '/'"),
        ("..", "{{ run_id }}", "escapes the hot root"),
        (".", "{{ run_id }}", "has an empty or '.' part"),
        ("", "{{ run_id }}", "escapes the hot root"),
        ("/etc", "{{ run_id }}", "escapes the hot root"),
        ("tokens/", "tokens/{{ ds }}", "has an empty or '.' part"),
    ],
)
def test_rendered_dataset_names(name: str, template: str, fragment: str | None) -> None:
    found = dataset_name_problems(name, template)
    assert (found == []) if fragment is None else (len(found) == 1 and fragment in found[0]), found


def test_stage_dataset_refuses_a_name_that_rendered_out_of_its_folder(tmp_path: Path) -> None:
    from trainyard.pipeline import stages

    (tmp_path / "cold").mkdir()
    path = tmp_path / "p.yaml"
    path.write_text(
        text(
            dataset=f'{{source: "file://{tmp_path}/cold", hot: "file://{tmp_path}/hot", name: "{{{{ run_id }}}}"}}',
            runs_root=f'"file://{tmp_path}/runs"',
        )
    )
    run = open_run(path, "p", "..", "2026-11-28")
    with pytest.raises(SpecError, match=r"dataset\.name: '\.\.' escapes the hot root"):
        stages.stage_dataset(run)
    assert not (tmp_path / "hot").exists() or not any((tmp_path / "hot").iterdir())


def test_a_folder_without_specs_is_a_problem_not_zero_valid_specs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    assert cli(["check", str(tmp_path / "empty")]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path / 'empty'}: no spec files (*.yaml, *.yml) in this folder" in out and "valid" not in out
