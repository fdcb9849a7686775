"""The spec's JSON Schema and reference page: generated from the models, kept in docs/, named by the example specs."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from trainyard.cli import main
from trainyard.spec.schema import json_schema, markdown_reference, schema_text

ROOT = Path(__file__).resolve().parents[2]
SPECS = sorted([*(ROOT / "dags" / "pipelines").glob("*.yaml"), *(ROOT / "examples").glob("*/*.yaml")])


def test_docs_hold_what_trainyard_schema_prints(capsys: pytest.CaptureFixture[str]) -> None:
    """If this fails: `trainyard schema > docs/spec.schema.json && trainyard schema --markdown > docs/spec.md`."""
    assert main(["schema"]) == 0
    printed = capsys.readouterr().out
    assert printed == schema_text() == (ROOT / "docs" / "spec.schema.json").read_text()
    assert json.loads(printed)["$schema"].startswith("https://json-schema.org/")
    assert main(["schema", "--markdown"]) == 0
    assert capsys.readouterr().out == markdown_reference() == (ROOT / "docs" / "spec.md").read_text()


def _on(data: Any) -> Any:
    """YAML 1.1 reads a bare ``on`` key as true (the spec takes it back; the YAML language server reads 1.2)."""
    if isinstance(data, dict):
        return {("on" if k is True else k): _on(v) for k, v in data.items()}
    if isinstance(data, dt.date):  # PyYAML makes a date of 2026-11-01; to the schema (and an editor) it is text
        return data.isoformat()
    return [_on(v) for v in data] if isinstance(data, list) else data


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_each_example_names_the_schema_and_meets_it(path: Path) -> None:
    first = path.read_text().splitlines()[0]
    assert first.startswith("# yaml-language-server: $schema=")
    target = (path.parent / first.split("$schema=", 1)[1]).resolve()
    assert target == ROOT / "docs" / "spec.schema.json"
    jsonschema.validate(_on(yaml.safe_load(path.read_text())), json_schema())


def test_the_schema_refuses_what_the_spec_refuses() -> None:
    spec = _on(yaml.safe_load((ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml").read_text()))
    spec["nodes"]["cuont"] = 2  # a typo an editor should underline
    with pytest.raises(jsonschema.ValidationError, match="cuont"):
        jsonschema.validate(spec, json_schema())


def test_the_your_script_walkthrough_spec_passes_trainyard_check(tmp_path: Path) -> None:
    """docs/your-script.md's walkthrough spec (a nanoGPT-style script brought unmodified) is one that
    ``trainyard check`` passes, with its entrypoint pointed at the test copy of such a script."""
    page = (ROOT / "docs" / "your-script.md").read_text()
    [walk] = re.findall(r"### A script as its author wrote it.*?```yaml\n(.*?)```", page, re.S)
    script = ROOT / "tests" / "integration" / "scripts" / "nanogpt_style" / "train.py"
    spec = tmp_path / "nanogpt.yaml"
    data = tmp_path / "shakespeare_char"  # the dataset the walkthrough prepared; check refuses a missing one
    data.mkdir()
    walk = walk.replace("/src/nanoGPT/train.py", str(script)).replace("/data/cold/shakespeare_char", str(data))
    spec.write_text("nodes: {count: 2}\n" + walk)
    assert main(["check", str(spec)]) == 0


def test_the_staging_text_corpus_example_passes_trainyard_check(tmp_path: Path) -> None:
    """docs/staging.md's text-corpus example is a whole spec, as it says: ``trainyard check`` passes it as written."""
    page = (ROOT / "docs" / "staging.md").read_text()
    [text] = re.findall(r"A text corpus, which your script tokenizes, as a whole spec.*?```yaml\n(.*?)```", page, re.S)
    spec = tmp_path / "web_docs.yaml"
    spec.write_text(text)
    (tmp_path / "my_team").mkdir()  # its script, where the page says a relative entrypoint resolves
    (tmp_path / "my_team" / "train.py").write_text("print('training')\n")
    assert main(["check", str(spec)]) == 0
