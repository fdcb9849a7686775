"""``dataset.files``: the files a script reads beside its shards (nanoGPT's ``meta.pkl``) are staged, verified
and required by the data gate; what a format leaves at the source unnamed is a warning (issue 51, point 10).

Each case stages a real numpy dataset as nanoGPT's prepare.py writes it from a ``file://`` source; the
vocabulary is a real pickle whose unpickling would leave a mark, so a test also sees that nothing opens it.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.pipeline import stages
from trainyard.pipeline.run import open_run
from trainyard.quality.dataset import check_dataset
from trainyard.report.pages import report_html
from trainyard.report.summary import format_summary, summarize
from trainyard.spec import FORMAT_SUFFIXES, DataExpectations, DataFile
from trainyard.storage import LocalTier
from trainyard.storage.staged import read_staged
from trainyard.storage.staging import stage

NUMPY = FORMAT_SUFFIXES["numpy"]
UNSTAGED = "meta.pkl at the source is not staged; name it in dataset.files if the script reads it"


class _Marks:
    """Unpickled, it touches ``path``: the mark that something opened the vocabulary as a pickle."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def write_bin(path: Path, tokens: np.ndarray) -> None:
    """As nanoGPT's prepare.py writes train.bin: a raw uint16 memmap, no header."""
    path.parent.mkdir(parents=True, exist_ok=True)
    out = np.memmap(path, dtype="uint16", mode="w+", shape=(len(tokens),))
    out[:] = tokens
    out.flush()
    del out


def nanogpt_data(cold: Path, marker: Path) -> bytes:
    """train.bin and val.bin (uint16 memmaps) and meta.pkl (a vocabulary pickle) as prepare.py leaves them."""
    write_bin(cold / "train.bin", np.arange(4096) % 65)
    write_bin(cold / "val.bin", np.arange(512) % 65)
    meta = pickle.dumps({"vocab_size": 65, "itos": {i: chr(32 + i) for i in range(65)}, "trap": _Marks(marker)})
    (cold / "meta.pkl").write_bytes(meta)
    return meta


def numpy_stage(root: Path, *files: DataFile, ledger: Ledger | None = None) -> Any:
    return stage(LocalTier(root / "cold"), root / "hot", ledger=ledger, suffixes=NUMPY, files=files)


def gate(root: Path, *files: DataFile, **kwargs: Any) -> Any:
    return check_dataset(root / "hot", DataExpectations(), format="numpy", dtype="uint16", files=files, **kwargs)


def test_a_named_vocabulary_is_staged_verified_and_never_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "unpickled"
    meta = nanogpt_data(tmp_path / "cold", marker)
    named = DataFile(name="meta.pkl", sha256=hashlib.sha256(meta).hexdigest(), size=len(meta))
    result = numpy_stage(tmp_path, named)
    assert (result.files, result.extra_files, result.unstaged, result.warnings) == (3, 1, 0, [])
    assert (tmp_path / "hot" / "meta.pkl").read_bytes() == meta
    assert set(read_staged(tmp_path / "hot")) == {"train.bin", "val.bin", "meta.pkl"}
    checked = gate(tmp_path, named)
    # Not a shard: the arrays are the two .bin files, and the vocabulary is a file beside them.
    assert (checked.shards, checked.tokens, checked.extra_files, checked.warnings) == (2, 4096 + 512, ["meta.pkl"], [])
    assert not marker.exists()
    assert numpy_stage(tmp_path, named).transferred == 0  # re-staged incrementally like any object


def test_a_required_file_missing_at_the_source_fails_staging_before_any_copy(tmp_path: Path) -> None:
    nanogpt_data(tmp_path / "cold", tmp_path / "unpickled")
    (tmp_path / "cold" / "meta.pkl").unlink()
    with pytest.raises(DataError) as err:
        numpy_stage(tmp_path, DataFile(name="meta.pkl"))
    assert str(err.value) == (
        f"dataset.files[0].name: meta.pkl is not at the source {LocalTier(tmp_path / 'cold').uri}; put it there"
        " beside the shards, or set dataset.files[0].required: false if the script does without it"
    )
    assert not (tmp_path / "hot" / "train.bin").exists()


def test_an_optional_file_missing_is_a_warning_carried_to_the_data_check(tmp_path: Path) -> None:
    nanogpt_data(tmp_path / "cold", tmp_path / "unpickled")
    optional = DataFile(name="tokenizer.json", required=False)
    result = numpy_stage(tmp_path, DataFile(name="meta.pkl"), optional)
    [warning] = result.warnings
    assert warning.startswith("dataset.files[1].name: tokenizer.json is not at the source ")
    assert warning.endswith("not staged (required: false): the script must do without it")
    checked = gate(tmp_path, DataFile(name="meta.pkl"), optional, warnings=result.warnings)
    assert checked.extra_files == ["meta.pkl"]
    assert checked.warnings[0] == warning
    assert checked.warnings[1].startswith("dataset.files[1].name: tokenizer.json is not in the staged dataset")


@pytest.mark.parametrize(
    ("named", "expected"),
    [
        (
            {"size": 7},
            r"dataset\.files\[0\]\.size: meta\.pkl is {size} bytes at the source file://.*, expected 7; fix the file"
            r" at dataset\.source or the size in the spec",
        ),
        (
            {"sha256": "0" * 64},
            r"dataset\.files\[0\]\.sha256: meta\.pkl has sha256 {sha}, expected 0{{64}}; fix the file at"
            r" dataset\.source \(then stage again\) or the sha256 in the spec",
        ),
    ],
    ids=["size", "sha256"],
)
def test_a_size_or_sha256_not_as_the_spec_says_fails_naming_both(
    tmp_path: Path, named: dict[str, Any], expected: str
) -> None:
    meta = nanogpt_data(tmp_path / "cold", tmp_path / "unpickled")
    with pytest.raises(DataError, match=expected.format(size=len(meta), sha=hashlib.sha256(meta).hexdigest())):
        numpy_stage(tmp_path, DataFile(name="meta.pkl", **named))


def test_the_gate_fails_on_a_required_file_the_staged_folder_lacks_or_changed(tmp_path: Path) -> None:
    meta = nanogpt_data(tmp_path / "cold", tmp_path / "unpickled")
    numpy_stage(tmp_path)  # staged before the spec named it
    with pytest.raises(DataError, match=r"dataset\.files\[0\]\.name: meta\.pkl is not in the staged dataset .*"
                       r"clear stage_dataset in the Airflow UI to stage it again"):  # fmt: skip
        gate(tmp_path, DataFile(name="meta.pkl"))
    numpy_stage(tmp_path, DataFile(name="meta.pkl"))
    (tmp_path / "hot" / "meta.pkl").write_bytes(meta[:-1] + b"!")  # same size, other bytes
    sha = hashlib.sha256(meta).hexdigest()
    with pytest.raises(
        DataError, match=rf"dataset\.files\[0\]\.sha256: meta\.pkl has sha256 [0-9a-f]{{64}}, expected {sha}"
    ):
        gate(tmp_path, DataFile(name="meta.pkl", sha256=sha))
    (tmp_path / "hot" / "meta.pkl").write_bytes(b"short")
    with pytest.raises(DataError, match=r"meta\.pkl in .* is missing or changed since it was staged \(5 bytes"):
        gate(tmp_path, DataFile(name="meta.pkl"))


def test_files_a_format_leaves_at_the_source_unnamed_are_a_bounded_warning(tmp_path: Path, caplog) -> None:
    nanogpt_data(tmp_path / "cold", tmp_path / "unpickled")
    ledger = Ledger.in_dir(tmp_path / "run")
    result = numpy_stage(tmp_path, ledger=ledger)
    assert (result.files, result.unstaged) == (2, 1)
    assert result.warnings == [f"{UNSTAGED} (dataset.format numpy stages only its .bin/.npy files)"]
    assert UNSTAGED in caplog.text
    [staged] = ledger.events("stage_dataset", "staged")
    assert staged["warnings"] == result.warnings
    # Many: ten named, the rest counted; markers and hidden files (Spark's _SUCCESS, .crc sums) are not a script's.
    for i in range(14):
        (tmp_path / "cold" / f"extra/{i:02d}.txt").parent.mkdir(exist_ok=True)
        (tmp_path / "cold" / f"extra/{i:02d}.txt").write_text("x")
    (tmp_path / "cold" / "_SUCCESS").write_text("")
    (tmp_path / "cold" / ".train.bin.crc").write_text("")
    [warning] = numpy_stage(tmp_path).warnings
    assert warning.startswith("extra/00.txt, extra/01.txt, ")
    assert "extra/09.txt and 5 more at the source are not staged; name them in dataset.files" in warning
    assert "_SUCCESS" not in warning and ".crc" not in warning
    assert numpy_stage(tmp_path, DataFile(name="meta.pkl")).unstaged == 14


SPEC = """\
dataset:
  source: "file://{root}/cold"
  name: shakespeare
  hot: "file://{root}/hot"
  format: numpy
  dtype: uint16
  files: [{{name: meta.pkl, sha256: {sha}}}, {{name: tokenizer.json, required: false}}]
runs_root: file://{root}/runs
nodes: {{count: 1}}
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
training: {{entrypoint: train.py, max_steps: 4, global_batch: 8, micro_batch: 2, checkpoint_every: 2}}
"""


def test_the_data_stages_show_the_files_in_the_result_ledger_summary_and_report(tmp_path: Path) -> None:
    meta = nanogpt_data(tmp_path / "cold", tmp_path / "unpickled")
    (tmp_path / "cold" / "input.txt").write_text("First Citizen:\n")
    (tmp_path / "spec.yaml").write_text(SPEC.format(root=tmp_path, sha=hashlib.sha256(meta).hexdigest()))
    run = open_run(tmp_path / "spec.yaml", "shakespeare", "manual__1", "2026-12-01")
    staged = stages.stage_dataset(run)
    assert (staged.extra_files, staged.unstaged) == (1, 1)
    checked = stages.check_dataset(run)
    assert checked.extra_files == ["meta.pkl"]
    assert any(w.startswith("input.txt at the source is not staged") for w in checked.warnings)
    assert any(w.startswith("dataset.files[1].name: tokenizer.json is not at the source") for w in checked.warnings)
    [event] = run.ledger.events("check_dataset", "dataset_checked")
    assert (event["extra_files"], event["warnings"]) == (["meta.pkl"], checked.warnings)
    summary = summarize(run.ledger)
    text = format_summary(summary)
    assert "  data checked:     2 numpy files; beside them meta.pkl" in text
    assert "  data warning:     input.txt at the source is not staged; name it in dataset.files" in text
    html = report_html(summary, {"dag_id": "shakespeare", "run_id": "manual__1"})
    assert "<h2>Data</h2>" in html and "files beside them verified: meta.pkl" in html
    assert "input.txt at the source is not staged" in html
