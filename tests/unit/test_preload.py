"""What the local zygote imports before forking a script's ranks (``trainyard.preload``), and how a forked script
ends as a new interpreter would (``backends.local.asmain``): tables of cases, no process started."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from trainyard.backends.local import asmain
from trainyard.preload import MAX_SCRIPT_BYTES, TABLE, modules_for, script_frameworks

HF = list(TABLE["torch"].modules) + list(TABLE["hf"].modules)
LIGHTNING = list(TABLE["torch"].modules) + list(TABLE["lightning"].modules)

# (case, a script's source, the frameworks it reveals)
SCRIPTS = [
    ("plain torch", "import torch\nimport torch.distributed as dist\n", []),
    ("hf", "from transformers import GPT2Config, Trainer\n", ["hf"]),
    ("hf adapter only", "from trainyard.runtime import hf\n", ["hf"]),
    ("hf adapter module", "import trainyard.runtime.hf as ty\n", ["hf"]),
    ("lightning", "import lightning.pytorch as pl\n", ["lightning"]),
    ("lightning's old name", "import pytorch_lightning as pl\n", ["lightning"]),
    ("lightning adapter", "from trainyard.runtime import lightning as ty\n", ["lightning"]),
    ("both, inside a function", "def main():\n    import lightning\n    import transformers\n", ["hf", "lightning"]),
    ("a relative import is the script's own", "from .transformers import x\n", []),
    ("a name that only starts alike", "import transformers_extra\nimport lightningfast\n", []),
    ("not python", "def (:\n", []),
]


@pytest.mark.parametrize("source,expected", [(s, e) for _, s, e in SCRIPTS], ids=[c for c, _, _ in SCRIPTS])
def test_auto_reads_the_framework_from_the_scripts_imports(source: str, expected: list[str]) -> None:
    assert script_frameworks(source) == expected


def test_the_spec_names_the_modules_and_auto_reads_a_script(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("from transformers import Trainer\n")
    assert modules_for("none", script) == []  # cold: every rank a new interpreter
    assert modules_for("hf", None) == HF
    assert modules_for("lightning", script) == LIGHTNING  # named in the spec: the script is not read
    assert modules_for("auto", script) == HF
    assert modules_for("auto", None) == list(TABLE["torch"].modules)  # a module entrypoint
    assert modules_for("auto", tmp_path / "missing.py") == list(TABLE["torch"].modules)
    script.write_text("import transformers\n" + "#" * MAX_SCRIPT_BYTES)  # larger than read: plain torch
    assert modules_for("auto", script) == list(TABLE["torch"].modules)


# (case, SystemExit's code, the exit code, what is printed on stderr)
EXITS = [
    ("sys.exit()", None, 0, ""),
    ("sys.exit(0)", 0, 0, ""),
    ("sys.exit(3)", 3, 3, ""),
    ("sys.exit(256) wraps as the kernel does", 256, 0, ""),
    ("sys.exit(-1)", -1, 255, ""),
    ("sys.exit('why') prints it", "why", 1, "why\n"),
]


@pytest.mark.parametrize("code,expected,printed", [e[1:] for e in EXITS], ids=[e[0] for e in EXITS])
def test_a_system_exit_ends_as_a_new_interpreter_ends(
    code: object, expected: int, printed: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert asmain.exit_code(code) == expected
    assert capsys.readouterr().err == printed


def test_an_uncaught_exception_is_the_hooks_with_the_scripts_frames_only(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, exc, tb: seen.append((kind, exc, tb)))

    def script() -> None:  # what runpy runs: a frame of the script's own
        raise ValueError("the script's")

    def ours() -> None:  # a frame of this module: asmain's own frames are dropped the same way
        script()

    monkeypatch.setattr(asmain, "_HERE", (*asmain._HERE, __file__))
    try:
        ours()
    except ValueError as exc:
        assert asmain.uncaught(exc) == 1
    [(kind, exc, tb)] = seen
    assert kind is ValueError and tb is exc.__traceback__
    assert tb is not None and tb.tb_frame.f_code.co_name == "script"  # the test's and ours() frames are gone
    try:
        raise KeyboardInterrupt
    except KeyboardInterrupt as interrupt:
        assert asmain.uncaught(interrupt) == -signal.SIGINT  # python ends by SIGINT after its traceback
