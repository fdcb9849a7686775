"""The package's metadata: what Airflow reads of the provider, and the dependencies an install gets.

The wheel itself, installed into a fresh virtualenv, is tested in ``tests/integration/test_wheel.py``.
"""

from __future__ import annotations

import importlib
import json
import re
import tomllib
from pathlib import Path

import jsonschema
import pytest

from trainyard import __version__
from trainyard.airflow.provider import PACKAGE, get_provider_info

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def pins() -> dict[str, str]:
    """requirements.txt: name -> the exact version this project's venv and images install."""
    out = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if m := re.fullmatch(r"([A-Za-z0-9_.-]+)==([0-9][^\s#]*)", line.strip()):
            out[m[1].lower().replace("_", "-")] = m[2]
    return out


def ranges() -> dict[str, str]:
    out = {}
    for dep in PYPROJECT["dependencies"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)(.*)", dep)
        assert m, dep
        out[m[1].lower().replace("_", "-")] = m[2]
    return out


def test_the_provider_info_is_what_airflow_accepts() -> None:
    import airflow

    schema = json.loads((Path(airflow.__file__).parent / "provider_info.schema.json").read_text())
    info = get_provider_info()
    jsonschema.validate(info, schema)
    assert info["package-name"] == PYPROJECT["name"] == PACKAGE  # Airflow refuses a provider whose names differ
    assert info["versions"] == [__version__]
    assert "plugins" not in info  # the entry point registers the view; both would register it twice


def test_every_class_and_module_the_provider_names_imports() -> None:
    info = get_provider_info()
    for path in [*info["extra-links"], *info["notifications"]]:
        module, _, name = path.rpartition(".")
        assert isinstance(getattr(importlib.import_module(module), name), type), path
    for group in ("operators", "triggers"):
        for entry in info[group]:
            for module in entry["python-modules"]:
                importlib.import_module(module)


def test_the_entry_points_name_what_exists() -> None:
    points = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]
    assert points["apache_airflow_provider"] == {"provider_info": "trainyard.airflow.provider:get_provider_info"}
    module, _, name = points["airflow.plugins"]["trainyard"].partition(":")
    from airflow.plugins_manager import AirflowPlugin

    plugin = getattr(importlib.import_module(module), name)
    assert issubclass(plugin, AirflowPlugin) and plugin.name == "trainyard"


@pytest.mark.parametrize("name", sorted(set(pins()) - {"psycopg2-binary", "asyncpg"}))
def test_each_runtime_pin_is_a_dependency_whose_range_starts_at_it(name: str) -> None:
    """An install gets what this project's venv has (and no older): the range's floor is the tested pin."""
    pin, spec = pins()[name], ranges().get(name)
    assert spec is not None, f"requirements.txt pins {name} but pyproject.toml does not depend on it"
    floor = re.search(r">=([0-9][^,]*)", spec)
    assert floor, f"{name}{spec}: no lower bound"
    low, tested = (tuple(map(int, re.findall(r"\d+", v))) for v in (floor[1], pin))
    assert tested[: len(low)] == low, f"{name}{spec}: its floor is not the tested {pin}"


def test_the_python_it_declares_is_the_one_its_pins_need() -> None:
    # numpy 2.4 and pandas 3.1 (requirements.txt) publish wheels for 3.11 and later only.
    assert PYPROJECT["requires-python"] == ">=3.11"
    readme = (ROOT / "README.md").read_text()
    assert "Python 3.10" not in readme and "3.10+" not in readme


@pytest.mark.parametrize(
    ("env", "chosen"),
    [
        ({"PIP_FIND_LINKS": ""}, "--torch-backend auto"),  # PyTorch's index for this machine, not PyPI's CUDA build
        ({"PIP_FIND_LINKS": "", "UV_TORCH_BACKEND": "cpu"}, "--torch-backend cpu"),
        ({"PIP_FIND_LINKS": "/opt/wheels"}, '--find-links "/opt/wheels"'),  # a local folder of wheels wins
    ],
)
def test_make_venv_takes_torch_from_where_this_machine_needs_it(env: dict[str, str], chosen: str) -> None:
    import os
    import subprocess

    base = {k: v for k, v in os.environ.items() if k not in ("PIP_FIND_LINKS", "UV_TORCH_BACKEND", "MAKEFLAGS")}
    done = subprocess.run(
        ["make", "-n", "-B", ".venv/.installed"], cwd=ROOT, env=base | env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert chosen in done.stdout and "-r requirements.txt" in done.stdout


def test_the_readme_is_a_landing_page_and_every_link_of_the_docs_resolves() -> None:
    """README at most ~250 lines; every relative link and #anchor in it and in docs/ leads somewhere."""
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 250
    pages = [readme, *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if link.startswith(("http:", "https:", "mailto:")):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{page.name}: {link}")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                broken.append(f"{page.name}: {link} (no such heading)")
    assert broken == []


def _anchors(page: Path) -> set[str]:
    """GitHub's ids of a page's headings (outside code blocks)."""
    out, fence = set(), False
    for line in page.read_text().splitlines():
        fence ^= line.startswith("```")
        if not fence and re.match(r"#{1,6} ", line):
            out.add(re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-"))
    return out
