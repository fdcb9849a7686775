"""Spec text for the spec tests (``trainyard check``, boundaries, folders, resume): a valid spec, and one with
some sections replaced."""

from __future__ import annotations

from pathlib import Path

GOOD = {
    "dataset": '{source: "file:///data/tokens/{{ ds }}", name: "tokens/{{ ds }}"}',
    "nodes": "{count: 2}",
    "training": "{max_steps: 10, global_batch: 8, micro_batch: 2, checkpoint_every: 5}",
}


def text(**sections: str) -> str:
    return "".join(f"{key}: {value}\n" for key, value in {**GOOD, **sections}.items())


def write(folder: Path, name: str, **sections: str) -> Path:
    path = folder / name
    path.write_text(text(**sections))
    return path
