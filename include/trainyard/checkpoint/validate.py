"""Deep validation of one checkpoint: whole, loadable, finite, consistent, and good enough.

``format.verify`` proves the bytes are the ones the manifest lists (parallel
sha256). This module adds what only loading can tell: the DCP metadata reads,
every tensor loads on CPU and is finite, the rank files agree with the
manifest's world size, the step moves forward, and the metrics meet the
spec. One reason per problem; an empty list means valid.

Loading interprets bytes that training code wrote (untrusted, DESIGN rule 11),
so it never happens in this process, which may hold the worker's secrets: one
child per validation (``trainyard.checkpoint.tensors``) does it with an
allow-list environment, no file writes, a time limit, and answers in JSON. This
module imports no torch.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trainyard
from trainyard.checkpoint.format import read_manifest, verify
from trainyard.quality.metrics import History, metric_problems
from trainyard.spec import MetricExpectations

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp\Z")
CHILD = "trainyard.checkpoint.tensors"
CHILD_TIMEOUT_S = 1800.0
# What the child may inherit: where programs and libraries are, locale, thread counts. Nothing else:
# never AIRFLOW__* (Fernet key, JWT secret, database URL), AWS_*, connections or tokens.
CHILD_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "LD_LIBRARY_PATH")


@dataclass(frozen=True)
class Validation:
    path: Path
    step: int | None
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def valid(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "valid": self.valid, "problems": self.problems,
                "seconds": self.seconds}


def child_env(parent: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the inspecting child: the allow-list, trainyard importable, no GPU, no bytecode writes."""
    parent = dict(os.environ) if parent is None else parent
    env = {k: parent[k] for k in CHILD_ENV if k in parent}
    here = str(Path(trainyard.__file__).resolve().parents[1])  # the folder that holds this trainyard
    paths = [here, *(p for p in parent.get("PYTHONPATH", "").split(os.pathsep) if p and p != here)]
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1",
               CUDA_VISIBLE_DEVICES="")
    return env


def child_command(ckpt_dir: Path) -> list[str]:
    # -P (3.11+): the working directory never lands on sys.path, so no planted module is imported; before
    # 3.11 the child's working directory, "/", is what lands there.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", CHILD, str(ckpt_dir.resolve())]


def start_inspection(ckpt_dir: Path) -> subprocess.Popen[bytes]:
    """Start the child that loads ``ckpt_dir``'s tensors; collect its answer with ``inspection_problems``."""
    return subprocess.Popen(child_command(ckpt_dir), env=child_env(), cwd="/", stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def inspection_problems(child: subprocess.Popen[bytes], timeout_s: float = CHILD_TIMEOUT_S) -> list[str]:
    """The child's problems from its last stdout line, which must be JSON; anything else is a problem itself."""
    try:
        out, err = child.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(child)
        return [f"loading the tensors took longer than {timeout_s:.0f} s; the inspecting process was stopped"]
    lines = out.decode("utf-8", "replace").strip().splitlines()
    try:
        answer = json.loads(lines[-1]) if child.returncode == 0 and lines else None
    except ValueError:
        answer = None
    if isinstance(answer, dict) and isinstance(answer.get("problems"), list):
        return [str(p)[:1000] for p in answer["problems"]]
    tail = err.decode("utf-8", "replace").strip().splitlines()[-1:] or ["no output"]
    return [f"the process inspecting the tensors failed (exit {child.returncode}): {tail[0][:300]}"]


def _stop(child: subprocess.Popen[bytes]) -> None:
    if child.poll() is None:
        child.kill()
    child.communicate()  # reap it and close its pipes


def tensor_problems(ckpt_dir: Path, timeout_s: float = CHILD_TIMEOUT_S) -> list[str]:
    """The checkpoint loads weights-only and every floating-point tensor is finite, judged in a child process."""
    return inspection_problems(start_inspection(ckpt_dir), timeout_s)


def validate(
    ckpt_dir: str | Path,
    expect: MetricExpectations | None = None,
    history: History | None = None,
    after_step: int | None = None,
) -> Validation:
    """Every check on ``ckpt_dir``; ``after_step`` is the latest valid step it must follow."""
    started = time.monotonic()
    path = Path(ckpt_dir)
    child = start_inspection(path)  # it starts (imports torch) and loads while this process hashes
    try:
        problems = verify(path)  # manifest, version, sizes, hashes, unlisted files
        if problems:
            return Validation(path, None, problems, round(time.monotonic() - started, 3))
        manifest = read_manifest(path)
        step = int(manifest["step"])
        ranks = [int(m.group(1)) for p in path.iterdir() if (m := _RANK_FILE.match(p.name))]
        if any(rank >= manifest["world_size"] for rank in ranks):
            problems.append(f"rank files up to {max(ranks)} but the manifest says world size {manifest['world_size']}")
        if after_step is not None and step <= after_step:
            problems.append(f"step {step} does not follow the latest valid step {after_step}")
        problems += inspection_problems(child)
    finally:
        _stop(child)  # not needed after a failed integrity check; a no-op once it answered
    if expect is not None:
        loss = manifest.get("metrics", {}).get("loss")
        problems += metric_problems(history or [(step, loss)], step, loss, expect)
    return Validation(path, step, problems, round(time.monotonic() - started, 3))
