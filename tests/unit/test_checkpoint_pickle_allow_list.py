"""A framework's torch.save file may name only the globals real saves name (issue 49, item 5).

Each hostile file's manifest matches its bytes (training code writes the manifest too), so only the allow-list
stands between it and a consumer's ``torch.load(weights_only=False)``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pickle
import pydoc
import random
import sys
import timeit
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from numpy.testing._private.utils import runstring
from test_checkpoint_foreign import adopt_one, torch_save
from test_checkpoint_untrusted import RunsCode, touch_marker

from trainyard.checkpoint import pickles
from trainyard.checkpoint.validate import validate

RUNNERS = {
    "timeit.timeit": timeit.timeit,
    "cProfile.run": cProfile.run,
    "pydoc.pipepager": pydoc.pipepager,
    "numpy.testing._private.utils.runstring": runstring,
}


@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_a_standard_library_runner_is_refused_by_name(tmp_path: Path, name: str) -> None:
    root, marker = tmp_path / "pipe", tmp_path / "marker"
    code = f"import os; os.system({sys.executable!r} + ' -c \"{touch_marker(marker)}\"')"
    torch_save(root / "ckpt_000003.pt", {"w": torch.ones(2), "x": RunsCode(RUNNERS[name], code)})
    result = validate(adopt_one(root, "ckpt_000003.pt"))
    assert not marker.exists(), "the checkpoint's pickle ran"
    [problem] = result.problems
    assert f"calls {name} (" in problem and "refused, never loaded" in problem


def _replace_pickle(path: Path, data: bytes) -> None:
    """``path``, a torch.save zip, with its ``data.pkl`` replaced (every other record kept)."""
    with zipfile.ZipFile(path) as old:
        records = {name: old.read(name) for name in old.namelist()}
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as new:
        for name, raw in records.items():
            new.writestr(name, data if name.endswith("/data.pkl") else raw)


def test_a_dotted_stack_global_is_matched_whole(tmp_path: Path) -> None:
    """Protocol 4's STACK_GLOBAL takes a dotted name: ``posixpath`` + ``os.system`` is ``os.system``."""
    root = tmp_path / "pipe"
    file = torch_save(root / "ckpt_000003.pt", {"w": torch.ones(2)})
    call = b"\x8c\tposixpath\x8c\tos.system\x93\x8c\x04true\x85R"  # STACK_GLOBAL, then REDUCE with ("true",)
    _replace_pickle(file, b"\x80\x04}\x8c\x01x" + call + b"s.")
    result = validate(adopt_one(root, "ckpt_000003.pt"))
    [problem] = result.problems
    assert "calls posixpath.os.system (" in problem
    assert pickles.globals_in(pickles.data_pickle(file.read_bytes())) == {"posixpath.os.system"}


def test_framework_types_are_allowed_only_in_their_own_files() -> None:
    base = frozenset({"torch._utils._rebuild_tensor_v2"})
    args = "transformers.training_args.TrainingArguments"
    assert args in pickles.allowed("training_args.bin", base)
    assert args not in pickles.allowed("optimizer.pt", base)
    assert "lightning.fabric.utilities.data.AttributeDict" in pickles.allowed("sub/last.ckpt", base)
    assert "argparse.Namespace" in pickles.allowed("x.pt", base)


def test_a_users_full_save_passes_and_its_tensors_are_still_checked(tmp_path: Path) -> None:
    """Model, optimizer, scheduler, every RNG and parsed arguments, as scripts save them: valid; a NaN beside
    them (in a file that needs more than torch's weights-only set) is still found."""
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)
    state = {
        "model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "step": 3,
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
        "args": argparse.Namespace(lr=0.1, name="x"), "scale": np.float32(1.5),
    }  # fmt: skip
    root = tmp_path / "pipe"
    torch_save(root / "ckpt_000003.pt", state)
    good = validate(adopt_one(root, "ckpt_000003.pt"))
    assert good.valid, good.problems
    [note] = good.notes
    assert "argparse.Namespace" in note and "accepted on its hash" in note
    state["model"]["weight"][0, 0] = float("nan")
    torch_save(root / "ckpt_000004.pt", state)
    bad = validate(adopt_one(root, "ckpt_000004.pt"))
    assert bad.problems == ["tensor ckpt_000004.pt.model.weight has 1 NaN and 0 Inf value(s)"]


def test_the_name_collector_builds_nothing() -> None:
    data = pickle.dumps(RunsCode(print, "ran"), protocol=4)
    out = io.StringIO()
    sys.stdout, saved = out, sys.stdout
    try:
        assert pickles.globals_in(data) == {"builtins.print"}
    finally:
        sys.stdout = saved
    assert out.getvalue() == ""
