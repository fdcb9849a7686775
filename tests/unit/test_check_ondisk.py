"""What a spec names must exist where it runs (``spec.ondisk``): an unset ``${VAR}``, a missing plain ``file://``
source, a missing local script or module are errors; the same under a variable or a template, or an entrypoint
that lives in a Kubernetes image, only warnings, which never change the exit code."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from check_specs import write

from trainyard.cli import main as cli
from trainyard.spec import Finding, review

SETTING = "AIRFLOW__TRAINYARD__SPEC_VARIABLES"
K8S = "{count: 1, backend: kubernetes, kubernetes: {image: 'registry.example/train:1'}}"


def one(path: Path, environ: dict[str, str] | None = None) -> tuple[list[Finding], list[Finding]]:
    [report] = review([path], environ if environ is not None else {})
    return report.errors, report.warnings


def test_an_allowed_but_unset_variable_is_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SETTING, "DATA_ROOT")  # the spec's own validation reads the allow-list from the environment
    monkeypatch.delenv("DATA_ROOT", raising=False)
    path = write(tmp_path, "p.yaml", dataset='{source: "file://${DATA_ROOT}/tokens", name: tokens}')
    errors, _ = one(path, {SETTING: "DATA_ROOT"})
    assert errors[0].field == "dataset.source"
    assert errors[0].message.startswith("${DATA_ROOT} is not set here, so the run would fail to fill it in; set")
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    assert one(path, {SETTING: "DATA_ROOT", "DATA_ROOT": str(tmp_path)}) == ([], [])


def test_a_missing_plain_source_is_an_error_and_an_existing_one_passes(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yaml", dataset=f'{{source: "file://{tmp_path}/cold", name: tokens}}')
    [error], [] = one(path)
    assert error == Finding("dataset.source", f"{str(tmp_path / 'cold')!r} does not exist; the run would fail at"
                            " stage_dataset: create it (trainyard demo-data writes a synthetic one) or fix the path")  # fmt: skip
    (tmp_path / "cold").mkdir()
    assert one(path) == ([], [])


def test_a_source_under_a_template_is_a_warning_about_its_fixed_part(tmp_path: Path) -> None:
    path = write(tmp_path, "p.yaml", dataset=f'{{source: "file://{tmp_path}/cold/{{{{ ds }}}}", name: t}}')
    [], [warning] = one(path)
    assert warning.field == "dataset.source" and f"{str(tmp_path / 'cold')!r}" in warning.message
    (tmp_path / "cold").mkdir()
    assert one(path) == ([], [])  # tonight's partition may not be written yet: only the fixed part is looked for


def test_a_missing_local_script_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "cold").mkdir()
    source = f'{{source: "file://{tmp_path}/cold", name: t}}'
    path = write(tmp_path, "p.yaml", dataset=source, training="{entrypoint: train.py, max_steps: 1,"
                 " global_batch: 2, micro_batch: 1, checkpoint_every: 1}")  # fmt: skip
    [error], [] = one(path)
    assert error.field == "training.entrypoint"
    assert (
        error.message
        == f"the script {str(tmp_path / 'train.py')!r} does not exist; the run would fail at train: fix it"
    )
    (tmp_path / "train.py").write_text("print('hi')\n")
    assert one(path) == ([], [])


@pytest.mark.parametrize("module,ok", [("trainyard.workload", True), ("json.decoder", True), ("trainyard.nope", False),
                                       ("nosuchpkg.train", False), ("json.decoder.x", False)])  # fmt: skip
def test_a_module_entrypoint_is_looked_up_without_running_it(tmp_path: Path, module: str, ok: bool) -> None:
    (tmp_path / "cold").mkdir()
    path = write(tmp_path, "p.yaml", dataset=f'{{source: "file://{tmp_path}/cold", name: t}}',
                 training=f"{{entrypoint: {module}, max_steps: 1, global_batch: 2, micro_batch: 1, checkpoint_every: 1}}")  # fmt: skip
    errors, _ = one(path)
    assert (errors == []) is ok, errors
    if not ok:
        assert errors[0].message.startswith(f"the module {module!r} (searched {sys.executable}'s path) does not exist")


def test_a_module_in_the_workdir_is_found(tmp_path: Path) -> None:
    (tmp_path / "cold").mkdir()
    (tmp_path / "repo" / "mytrain").mkdir(parents=True)
    (tmp_path / "repo" / "mytrain" / "__init__.py").write_text("raise SystemExit('never run by check')\n")
    (tmp_path / "repo" / "mytrain" / "main.py").write_text("")
    path = write(tmp_path, "p.yaml", dataset=f'{{source: "file://{tmp_path}/cold", name: t}}',
                 training="{entrypoint: mytrain.main, workdir: repo, max_steps: 1, global_batch: 2, micro_batch: 1,"
                 " checkpoint_every: 1}")  # fmt: skip
    assert one(path) == ([], [])


def test_on_kubernetes_a_missing_entrypoint_is_a_warning(tmp_path: Path) -> None:
    (tmp_path / "cold").mkdir()
    path = write(tmp_path, "p.yaml", dataset=f'{{source: "file://{tmp_path}/cold", name: t}}', nodes=K8S,
                 training="{entrypoint: /app/train.py, max_steps: 1, global_batch: 1, micro_batch: 1,"
                 " checkpoint_every: 1}")  # fmt: skip
    [], [warning] = one(path)
    assert warning.field == "training.entrypoint" and "make sure the image has it" in warning.message


def test_warnings_never_change_the_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "p.yaml", dataset=f'{{source: "file://{tmp_path}/cold/{{{{ ds }}}}", name: t}}')
    assert cli(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"{path}: warning: dataset.source: " in out and "1 spec(s) valid" in out
    assert cli(["check", "-o", "json", str(path)]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert row["ok"] is True and row["errors"] == [] and row["warnings"][0]["field"] == "dataset.source"
