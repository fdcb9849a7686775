"""``training.resume_from`` stays inside the pipeline's own checkpoint folders and its allowed roots
(issue 13, hole 9; ``spec.resume``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from check_specs import text

from trainyard.spec import load_spec, resume_problems, resume_root_fields


def training(extra: str) -> str:
    return f"{{max_steps: 10, global_batch: 8, micro_batch: 2, checkpoint_every: 5, {extra}}}"


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    own, shared, other = tmp_path / "ck" / "p", tmp_path / "shared", tmp_path / "ck" / "other"
    for folder in (own / "step_000010", shared / "step_000005", other / "step_000020"):
        folder.mkdir(parents=True)
    (own / "escape").symlink_to(other / "step_000020")
    return {"own": own, "shared": shared, "other": other}


def spec_with(tmp_path: Path, allowed: list[str]) -> object:
    path = tmp_path / "p.yaml"
    path.write_text(text(training=training(f"allowed_resume_roots: {allowed!r}")))
    return load_spec(path)


def test_resume_from_inside_its_own_or_an_allowed_root(tmp_path: Path, roots: dict[str, Path]) -> None:
    spec = spec_with(tmp_path, [f"file://{roots['shared']}"])
    allowed = [roots["own"], f"file://{roots['shared']}", "s3://bucket/cold/p"]
    for choice in ("latest", "none", str(roots["own"] / "step_000010"), str(roots["shared"] / "step_000005")):
        assert resume_problems(spec, choice, allowed) == [], choice


def test_resume_from_elsewhere_is_refused_without_saying_whether_it_exists(
    tmp_path: Path, roots: dict[str, Path]
) -> None:
    spec = spec_with(tmp_path, [])
    allowed = [roots["own"], "s3://bucket/cold/p"]
    outside = {
        "another pipeline's checkpoint": roots["other"] / "step_000020",
        "a folder that does not exist": roots["other"] / "step_999999",
        "a sibling with the same prefix": Path(str(roots["own"]) + "-evil") / "step_000010",
        "a link out of its own root": roots["own"] / "escape",
    }
    answers = {why: resume_problems(spec, str(path), allowed) for why, path in outside.items()}
    for why, found in answers.items():
        assert len(found) == 1 and "is outside this pipeline's checkpoint folders" in found[0], why
    # The same words whether or not the path exists (only the path itself differs).
    assert len({found[0].replace(str(path), "PATH") for path, found in zip(outside.values(), answers.values())}) == 1
    assert resume_problems(spec, "../etc", allowed) == [
        "training.resume_from: '../etc' must be 'latest', 'none' or an absolute checkpoint path"
    ]


def test_resume_root_fields_are_uris_to_render(tmp_path: Path) -> None:
    spec = spec_with(tmp_path, ["/shared/ckpt", "file://${TRAINYARD_HOME}/x"])
    assert resume_root_fields(spec) == [
        ("training.allowed_resume_roots[0]", "file:///shared/ckpt"),
        ("training.allowed_resume_roots[1]", "file://${TRAINYARD_HOME}/x"),
    ]
