"""``bench/gpu_check.sh`` on a machine without a GPU: it says it skipped, and why, in its one JSON line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible: run bench/gpu_check.sh itself")
def test_without_a_gpu_the_check_skips_saying_why_and_leaves_nothing(tmp_path: Path) -> None:
    """Run as a newcomer runs it: no venv activated, PATH with only the system's Python. It finds the project's
    venv by itself, says in its one JSON line that it skipped and why, and leaves no scratch behind."""
    bare = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TMPDIR": str(tmp_path)}
    if not (ROOT / ".venv" / "bin" / "python").exists():  # a checkout without make venv: name this Python
        bare["PYTHON"] = sys.executable
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh")], env=bare, capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0 and "ModuleNotFoundError" not in done.stderr, done.stderr[-2000:]
    [line] = done.stdout.splitlines()  # one JSON line, nothing else on stdout
    result = json.loads(line)
    assert result["bench"] == "gpu_check" and result["skipped"] is True
    assert result["reason"].startswith("no CUDA device visible (torch ") and torch.__version__ in result["reason"]
    assert list(tmp_path.iterdir()) == []  # its scratch TRAINYARD_HOME is gone


def test_a_python_without_torch_is_a_skip_not_a_traceback(tmp_path: Path) -> None:
    done = subprocess.run(
        [str(ROOT / "bench" / "gpu_check.sh")],
        env={"PATH": "/usr/bin:/bin", "PYTHON": "/usr/bin/python3", "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "bench": "gpu_check",
        "skipped": True,
        "reason": "/usr/bin/python3 cannot import torch, yaml and trainyard: run make venv, or set PYTHON",
    }
