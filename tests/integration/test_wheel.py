"""The built wheel, installed as an Airflow team installs a provider: into a fresh virtualenv that has only Airflow.

Airflow must then list trainyard among its providers (with its extra link) and load the training-runs
view as a plugin from the package's entry point, with an empty plugins folder: nothing copied.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from trainyard import __version__

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def run(cmd: list[str | Path], env: dict[str, str] | None = None, timeout: float = 600) -> str:
    done = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd[:4]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def build_wheel(tmp: Path) -> Path:
    """``pip wheel`` of a copy of the sources (a build writes ``build/`` and ``*.egg-info`` beside them)."""
    src = tmp / "src"
    shutil.copytree(
        ROOT / "include" / "trainyard", src / "include" / "trainyard", ignore=shutil.ignore_patterns("__pycache__")
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", tmp / "dist", src])
    (wheel,) = (tmp / "dist").glob("trainyard-*.whl")
    return wheel


def test_the_wheel_installs_the_provider_and_its_view_into_a_venv_with_only_airflow(tmp_path: Path) -> None:
    uv = shutil.which("uv", path=str(BIN))
    if uv is None:
        pytest.skip("uv is not in this venv (make venv installs it)")
    wheel = build_wheel(tmp_path)
    venv, python = tmp_path / "venv", tmp_path / "venv" / "bin" / "python"
    run([uv, "venv", "-q", "--python", sys.executable, venv])
    links = ["--find-links", os.environ["PIP_FIND_LINKS"]] if os.environ.get("PIP_FIND_LINKS") else []
    pins = ["-c", ROOT / "constraints.txt", "-c", ROOT / "requirements.txt", *links]
    run([uv, "pip", "install", "-q", "--python", python, "apache-airflow", *pins])
    run([uv, "pip", "install", "-q", "--python", python, wheel, *pins])  # what `pip install trainyard` brings

    plugins, dags = tmp_path / "plugins", tmp_path / "dags"
    plugins.mkdir(), dags.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AIRFLOW", "PYTHON", "TRAINYARD"))} | {
        "AIRFLOW_HOME": str(tmp_path / "airflow"),
        "AIRFLOW__CORE__PLUGINS_FOLDER": str(plugins),  # empty: the view must come from the package
        "AIRFLOW__CORE__DAGS_FOLDER": str(dags),
        "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
    }
    where = run([python, "-c", "import trainyard; print(trainyard.__file__)"], env)
    assert where.startswith(str(venv)), where  # the wheel's copy, not this checkout's
    airflow = venv / "bin" / "airflow"
    providers = json.loads(run([airflow, "providers", "list", "-o", "json"], env))
    ours = [p for p in providers if p["package_name"] == "trainyard"]
    assert ours and ours[0]["version"] == __version__, providers
    links = json.loads(run([airflow, "providers", "links", "-o", "json"], env))
    assert any(link["extra_link_class_name"] == "trainyard.airflow.operators.RunPageLink" for link in links), links
    loaded = json.loads(run([airflow, "plugins", "-o", "json"], env))
    (view,) = [p for p in loaded if p["name"] == "trainyard"]
    assert "trainyard.airflow.plugin" in json.dumps(view) and "Training runs" in json.dumps(view), view
