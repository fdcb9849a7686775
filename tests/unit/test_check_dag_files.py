"""A DAG folder needs both DAG files (issue 52): ``pipelines.py`` builds the valid specs' DAGs and
``pipeline_spec_errors.py`` reports the invalid ones; a copy or mount of the first alone lets an invalid spec
vanish from Airflow without an import error. The README, the docs and the compose stack say and do both."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BUILDS, REPORTS = "pipelines.py", "pipeline_spec_errors.py"


def test_every_compose_folder_that_builds_dags_also_reports_invalid_specs() -> None:
    stack = yaml.safe_load((ROOT / "docker" / "docker-compose.yaml").read_text())
    volumes = [v for v in stack["x-airflow-common"]["volumes"] if isinstance(v, str)]
    targets = [v.split(":")[1] for v in volumes]
    built = [t.removesuffix(BUILDS) for t in targets if t.endswith(f"/{BUILDS}")]
    assert built, volumes  # the S3 example's folder mounts its own pipelines.py
    for folder in built:
        assert f"{folder}{REPORTS}" in targets, f"{folder} mounts {BUILDS} without {REPORTS}"


def test_the_readme_and_the_spec_guide_say_to_copy_both_files() -> None:
    for page in (ROOT / "README.md", ROOT / "docs" / "pipelines.md"):
        text = " ".join(page.read_text().split())
        assert f"`dags/{BUILDS}`" in text and f"`dags/{REPORTS}`" in text and "both" in text, page
