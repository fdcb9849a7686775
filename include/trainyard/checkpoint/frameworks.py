"""The framework checkpoint formats trainyard adopts: one registered record each.

A format is everything the house must know of a framework's save, in one ``Framework`` record (as
storage has one implementation per scheme): how a save is recognised (a folder's name or a file's
suffix), whether it is complete and where its step comes from (``read``), what of it the sandboxed
inspector reads and how (``inspector``, ``finite``), what is checked here without torch
(``checked_here``), which files name the ranks that wrote it, and what a framework loads to resume.
``saves`` scans with these records, ``foreign`` adopts and resumes by them, ``validate`` and the
inspector (``tensors``, ``torchfiles``) judge by them; none of them names a format. Adding a format
(DeepSpeed's ``global_stepN/``, say) is one record in ``FORMATS`` plus its tests.

Torch-free and never unpickling (docs/architecture.md, rules 11 and 14): only names, sizes, a bounded
``trainer_state.json`` and zip trailers are read. Training processes import it through ``foreign``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainyard.atomic import TooLarge, read_json_capped
from trainyard.checkpoint.pickles import TORCH_FILES
from trainyard.errors import CheckpointInvalid

STATE_BYTES = 16 << 20
"""The cap on reading ``trainer_state.json`` (its log history grows with the run: kilobytes to a few MB)."""
HF_STATE = "trainer_state.json"
DCP_METADATA = ".metadata"  # metadata.METADATA (that module imports torch)
_EOCD = b"PK\x05\x06"
_EOCD_SPAN = 22 + 65535  # the end-of-central-directory record and the longest zip comment

STEP_KEYS = ("step", "global_step", "iter_num", "iteration", "epoch")
"""The top-level keys of a torch.save file that hold its step, in order of preference (a spec's
``checkpoint.step_key`` comes first): trainyard's own and torchtitan's ``step``, Lightning's and Hugging Face's
``global_step``, nanoGPT's ``iter_num``, Megatron's ``iteration``. ``epoch`` last: it counts passes over the
data, not optimizer steps, so a file that holds both (Lightning's) says its step in the other; alone it is the
only count a script that saves once per epoch keeps."""

Inspector = Literal["dcp", "torch"]
"""How the sandboxed inspector reads a save: torch.distributed.checkpoint's metadata and data files (as
trainyard's own checkpoints), or each torch.save file weights-only."""


@dataclass(frozen=True)
class Reading:
    """What a save's own files say: why it is not complete ("" when it is), and a step or metrics it holds."""

    problem: str = ""
    step: int | None = None
    """The step the save records, which wins over its name's (None: its name's)."""
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Framework:
    """One checkpoint format. Its fields have no defaults: a new format answers every question."""

    name: str
    """The manifest's ``framework`` of a save adopted from it."""
    folder: re.Pattern[str] | None
    """A save that is a folder: the folder's name, with its step as group 1 (written once, adopted by hard links);
    a pattern without a group: a folder the script overwrites in place, its step in its files, adopted as a copy
    (``checkpoint.save_folder`` names another such folder). None: a save that is one file."""
    suffixes: tuple[str, ...]
    """A save that is one file: its suffixes; its step is in its name, else the inspector reads it from the file.
    Also what a framework loads to resume from the adopted checkpoint (a folder save resumes from the folder)."""
    read: Callable[[Path, frozenset[str]], Reading]
    """Whether the save at ``path`` (whose files are these names) is complete, and what step it holds."""
    inspector: Inspector
    checked_here: tuple[str, ...]
    """Suffixes of files checked in this process without torch (``checkpoint.safetensor``)."""
    finite: tuple[str, ...]
    """Top-level keys of a torch.save file whose tensors must be finite (a Lightning file's callbacks may hold
    anything); (): every tensor."""
    ranks: re.Pattern[str] | None
    """Files that name the rank which wrote them (group 1): an adopted save's world size is at least theirs."""
    help: str
    """What the gate says it understands of this format, when no valid checkpoint was found (``foreign.FORMATS_HELP``)."""

    def inspected(self, rel: str) -> bool:
        """Whether the inspecting child reads (and hashes) the listed file ``rel``."""
        return inspected(self.inspector, rel)

    def resume_file(self, step_dir: Path) -> Path:
        """What the framework loads to resume from its adopted checkpoint ``step_dir``."""
        if self.folder is not None:
            return step_dir
        files = sorted(
            p for p in step_dir.iterdir() if p.suffix in self.suffixes and p.is_file() and not p.is_symlink()
        )
        if len(files) != 1:
            raise CheckpointInvalid(
                f"{step_dir}: expected one {'/'.join(self.suffixes)} file of a {self.name} save, found {len(files)}"
            )
        return files[0]


def inspected(inspector: Inspector, rel: str) -> bool:
    if inspector == "dcp":
        return rel == DCP_METADATA or rel.endswith(".distcp")
    return rel.endswith(TORCH_FILES)


# ---------------------------------------------------------------- what each format's files say


def zip_problems(folder: Path, names: Iterable[str]) -> str:
    """A torch.save file is whole when its zip's end-of-central-directory record is there (written last)."""
    for name in sorted(names):
        try:
            fd = os.open(folder / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            return f"{name}: cannot open ({exc.strerror or exc})"
        try:
            size = os.fstat(fd).st_size
            tail = os.pread(fd, min(size, _EOCD_SPAN), max(0, size - _EOCD_SPAN))
        finally:
            os.close(fd)
        if _EOCD not in tail:
            return f"{name}: no zip end record (a torch.save cut short, still being written, or the legacy format)"
    return ""


def _hf(path: Path, names: frozenset[str]) -> Reading:
    if HF_STATE not in names:
        return Reading(f"no {HF_STATE} (save incomplete?)")
    if not any(n.endswith(".safetensors") or (n.startswith("pytorch_model") and n.endswith(".bin")) for n in names):
        return Reading("no model weights (*.safetensors or pytorch_model*.bin)")
    reading = trainer_state(path / HF_STATE)
    if reading.problem:
        return reading
    return Reading(zip_problems(path, [n for n in names if n.endswith(TORCH_FILES)]), reading.step, reading.metrics)


def trainer_state(path: Path) -> Reading:
    """``global_step`` and the last logged losses of a ``trainer_state.json``, read bounded and schema-checked."""
    try:
        state = read_json_capped(path, STATE_BYTES)
    except (OSError, ValueError, TooLarge) as exc:  # a link, a FIFO, oversized, not JSON
        return Reading(f"{HF_STATE} is unreadable ({exc})")
    if not isinstance(state, dict):
        return Reading(f"{HF_STATE} is not a JSON object")
    step = state.get("global_step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        return Reading(f"{HF_STATE} has no integer global_step")
    metrics: dict[str, float] = {}
    history = state.get("log_history")
    for entry in history if isinstance(history, list) else []:
        if not isinstance(entry, dict):
            continue
        for key in ("loss", "eval_loss"):
            value = entry.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                metrics[key] = float(value)  # the last logged value wins
    return Reading("", step, metrics)


def _dcp(path: Path, names: frozenset[str]) -> Reading:
    return Reading("" if DCP_METADATA in names else f"no {DCP_METADATA} (save incomplete?)")


def _torch_file(path: Path, names: frozenset[str]) -> Reading:
    return Reading(zip_problems(path.parent, names))


def _torch_folder(path: Path, names: frozenset[str]) -> Reading:
    # Every torch file whole, not only the one holding the step: a resume loads them all.
    torch = [n for n in names if n.endswith(TORCH_FILES)]
    return Reading(zip_problems(path, torch) if torch else f"no torch.save file ({', '.join(TORCH_FILES)})")


# ---------------------------------------------------------------- the registry

FORMATS: dict[str, Framework] = {
    fw.name: fw
    for fw in (
        # Hugging Face Trainer: checkpoint-N/ (trainer_state.json + *.safetensors or pytorch_model*.bin; optimizer.pt,
        # scheduler.pt, rng_state*.pth); its global_step wins over the folder's name.
        Framework("hf", re.compile(r"checkpoint-([0-9]+)\Z"), (), _hf, "torch", (".safetensors",), (), None,
                  "Hugging Face Trainer checkpoint-N/ folders (trainer_state.json + *.safetensors or pytorch_model*.bin)"),
        # Lightning's ModelCheckpoint: one torch.save zip; its model and optimizer must be finite.
        Framework("lightning", None, (".ckpt",), _torch_file, "torch", (), ("state_dict", "optimizer_states"), None,
                  "Lightning ModelCheckpoint *.ckpt files"),
        # A plain torch.save file.
        Framework("torch", None, (".pt", ".pth"), _torch_file, "torch", (), (), None,
                  "torch.save *.pt/*.pth files (zip format, tensors in plain dicts and lists: loadable with"
                  " torch.load(weights_only=True))"),
        # A folder of torch.save files a script overwrites in place (latest/ with model.pt and optim.pt): one save,
        # its step from the first of its files to hold a step key (read by the inspector), adopted as a copy.
        Framework("torch_folder", re.compile(r"(?:latest|last|checkpoint|ckpt)\Z"), (), _torch_folder, "torch", (), (),
                  None, "a folder of torch.save files overwritten in place (latest/, last/, checkpoint/, ckpt/, or"
                  " checkpoint.save_folder), its step in one of its files"),
        # torch.distributed.checkpoint as torchtitan writes it: step-N/ with .metadata and a file per rank.
        Framework("dcp", re.compile(r"step-([0-9]+)\Z"), (), _dcp, "dcp", (), (), re.compile(r"__(\d+)_\d+\.distcp\Z"),
                  "torch.distributed.checkpoint step-N/ folders (.metadata, as torchtitan writes them)"),
    )
}  # fmt: skip
"""Every format, by the manifest's ``framework`` name. Scanning tries the folder formats in this order."""


def of_folder(name: str, save_folder: str | None = None) -> tuple[Framework, int | None] | None:
    """The folder format whose save folder is called ``name``, and the step its name carries (None: a folder
    overwritten in place, its step in its files). ``save_folder``: the spec's name of another such folder."""
    for fw in FORMATS.values():
        match = fw.folder.match(name) if fw.folder is not None else None
        if match:
            return fw, int(match.group(1)) if match.re.groups else None
    if name == save_folder:
        return next((fw, None) for fw in FORMATS.values() if fw.folder is not None and not fw.folder.groups)
    return None


def of_file(name: str) -> Framework | None:
    """The one-file format of the file ``name``, by its suffix."""
    return next((fw for fw in FORMATS.values() if fw.folder is None and name.endswith(fw.suffixes)), None)


def inspector_of(name: str | None) -> Inspector:
    """How the inspector reads a checkpoint adopted from ``name`` (None: trainyard's own, DCP)."""
    fw = FORMATS.get(name) if name is not None else None
    return fw.inspector if fw is not None else "dcp"
