"""``resume_from`` reaches only the pipeline's own checkpoints (or roots the spec lists), decided when the run opens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainyard.errors import SpecError
from trainyard.pipeline.run import SNAPSHOT, open_run

SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: "file://{root}/runs"
nodes: {{count: 1}}
training: {{max_steps: 10, global_batch: 4, micro_batch: 2, checkpoint_every: 5{extra}}}
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/cold/ckpt"}}
params: [resume_from]
"""


def spec(tmp_path: Path, extra: str = "") -> Path:
    path = tmp_path / "p.yaml"
    path.write_text(SPEC.format(root=tmp_path, extra=extra))
    return path


def refusal(path: Path, resume_from: str, run_id: str) -> str:
    with pytest.raises(SpecError) as caught:
        open_run(path, "p", run_id, "2026-11-30", {"resume_from": resume_from})
    return str(caught.value)


@pytest.fixture
def other(tmp_path: Path) -> Path:
    """Another pipeline's checkpoint, next to this one's."""
    ckpt = tmp_path / "ckpt" / "other" / "step_000010"
    ckpt.mkdir(parents=True)
    (ckpt / "manifest.json").write_text("{}")
    return ckpt


def test_another_pipelines_checkpoint_is_refused_when_the_run_opens(tmp_path: Path, other: Path) -> None:
    path = spec(tmp_path)
    message = refusal(path, str(other), "manual__1")
    assert message.startswith(f"{path}: training.resume_from: '{other}' is outside this pipeline's checkpoint folders")
    assert "training.allowed_resume_roots" in message
    assert not (tmp_path / "runs" / "p" / "manual__1" / SNAPSHOT).exists()  # nothing pinned, nothing staged


def test_the_refusal_does_not_tell_whether_the_path_exists(tmp_path: Path, other: Path) -> None:
    path = spec(tmp_path)
    missing = other.with_name("step_000020")
    there, absent = refusal(path, str(other), "manual__1"), refusal(path, str(missing), "manual__2")
    assert there.replace(str(other), "X") == absent.replace(str(missing), "X")


def test_a_link_inside_the_own_root_to_elsewhere_is_refused(tmp_path: Path, other: Path) -> None:
    own = tmp_path / "ckpt" / "p"
    own.mkdir(parents=True)
    os.symlink(other, own / "step_000010")
    assert "is outside this pipeline's checkpoint folders" in refusal(spec(tmp_path), str(own / "step_000010"), "m__3")


def test_the_pipelines_own_checkpoints_and_listed_roots_are_accepted(tmp_path: Path, other: Path) -> None:
    path = spec(tmp_path)
    for i, target in enumerate([tmp_path / "ckpt" / "p" / "step_000010", tmp_path / "cold" / "ckpt" / "p" / "step_5"]):
        assert open_run(
            path, "p", f"manual__{i}", "2026-11-30", {"resume_from": str(target)}
        ).spec.training.resume_from == str(target)
    listed = spec(tmp_path, extra=f", allowed_resume_roots: [{tmp_path}/ckpt/other]")
    assert open_run(
        listed, "p", "manual__9", "2026-11-30", {"resume_from": str(other)}
    ).spec.training.resume_from == str(other)


@pytest.mark.parametrize(
    "resume_from,ok",
    [
        ("latest", True),
        ("none", True),
        ("/r/p/step_1", True),
        ("/r/p/a/b", True),
        ("/r/p", False),
        ("/r/pp/step_1", False),
        ("/r/other/step_1", False),
        ("/etc/passwd", False),
    ],
)
def test_containment_is_by_whole_path_parts(tmp_path: Path, resume_from: str, ok: bool) -> None:
    from trainyard.spec import load_spec, resume_problems

    assert (resume_problems(load_spec(spec(tmp_path)), resume_from, [Path("/r/p")]) == []) is ok
