"""``bench/gpu_check.sh`` on a machine without a GPU: it says it skipped, and why, in its one JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run bench/gpu_check.sh itself")
def test_without_a_gpu_the_check_skips_saying_why_and_leaves_nothing(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr[-2000:]
    [line] = done.stdout.splitlines()  # one JSON line, nothing else on stdout
    result = json.loads(line)
    assert result["bench"] == "gpu_check" and result["skipped"] is True
    assert result["reason"].startswith("no CUDA device visible (torch ") and torch.__version__ in result["reason"]
    assert list(tmp_path.iterdir()) == []  # its scratch TRAINYARD_HOME is gone


def test_outside_a_venv_it_uses_the_projects_venv_and_a_python_without_torch_skips(tmp_path: Path) -> None:
    """Run as a newcomer runs it: no venv activated, PATH with only the system's Python."""
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh")], env=bare, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0 and "ModuleNotFoundError" not in done.stderr, done.stderr[-2000:]
    result = json.loads(done.stdout.splitlines()[-1])
    if (ROOT / ".venv" / "bin" / "python").exists():  # the project's venv, found without being activated
        assert result["reason"].startswith("no CUDA device visible"), result
    without = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh")],
        env={**bare, "PYTHON": "/usr/bin/python3"},
        capture_output=True,
        text=True,
    )
    assert without.returncode == 0
    assert json.loads(without.stdout) == {
        "bench": "gpu_check",
        "skipped": True,
        "reason": "/usr/bin/python3 cannot import torch, yaml and trainyard: run make venv, or set PYTHON",
    }
