"""Every ``trainyard`` command the docs quote is one the CLI takes, and the cheap ones print what the docs say.

Data-driven, so it follows the docs: each fenced block of README.md and docs/*.md is read for commands,
either ``$ trainyard ...`` lines (the lines after one, up to the next ``$``, are its quoted output) or bare
``trainyard ...`` lines (no quoted output). Every quoted command must parse with the CLI's own parser (a
flag renamed or dropped fails here). The cheap ones (``check``, ``schema``, ``summary``, any ``--help``)
run in this process, in the checkout's root: where the doc quotes output, the output must be exactly it;
where it quotes none, the command must succeed. Commands that run pipelines or need a server (``drill``,
``upload``, ``ls``, ``ckpt``, ``demo-data``) are only parsed; their real runs are tested in
tests/integration.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from trainyard import cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
CHEAP = {"check", "schema", "summary"}
PROMPT = "$ "


@dataclass(frozen=True)
class Quoted:
    """A command a doc quotes: where, its words, and the output the doc shows (None: it shows none)."""

    where: str
    argv: tuple[str, ...]
    output: tuple[str, ...] | None

    @property
    def cheap(self) -> bool:
        return self.argv[1] in CHEAP or "--help" in self.argv or "-h" in self.argv


def fenced_blocks(page: Path) -> list[tuple[int, list[str]]]:
    """Each fenced block of a page: the line number of its opening fence and its lines."""
    blocks: list[tuple[int, list[str]]] = []
    current: list[str] | None = None
    start = 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            if current is None:
                current, start = [], number
            else:
                blocks.append((start, current))
                current = None
        elif current is not None:
            current.append(line)
    return blocks


def quoted_in(block: list[str], where: str) -> list[Quoted]:
    """The trainyard commands of one block, each with the output that follows it in a ``$`` block."""
    found: list[Quoted] = []
    if any(line.startswith(PROMPT) for line in block):
        command: str | None = None
        output: list[str] = []
        for line in [*block, f"{PROMPT}end"]:
            if not line.startswith(PROMPT):
                output.append(line.rstrip())
                continue
            if command is not None:
                argv = tuple(shlex.split(command, comments=True))
                if argv and argv[0] == "trainyard":
                    found.append(Quoted(where, argv, tuple(output) if output else None))
            command, output = line[len(PROMPT) :], []
        return found
    for line in block:
        argv = tuple(shlex.split(line, comments=True)) if line.startswith("trainyard ") else ()
        if argv:
            found.append(Quoted(where, argv, None))
    return found


def all_quoted() -> list[Quoted]:
    return [
        quoted
        for page in PAGES
        for start, block in fenced_blocks(page)
        for quoted in quoted_in(block, f"{page.relative_to(ROOT)}:{start}")
    ]


QUOTED = all_quoted()


def _id(quoted: Quoted) -> str:
    return f"{quoted.where} {' '.join(quoted.argv)}"


def test_the_docs_quote_commands_with_their_output() -> None:
    # Guards the parser above: if it stopped finding blocks, every test below would pass by having no cases.
    with_output = {q.argv[1] for q in QUOTED if q.output is not None}
    assert {"summary", "check"} <= with_output, [_id(q) for q in QUOTED]


def test_a_dollar_block_splits_commands_from_their_output() -> None:
    block = ["$ trainyard check a.yaml  # one", "a.yaml: bad", "", "$ ls", "x", "$ trainyard schema"]
    assert quoted_in(block, "p:1") == [
        Quoted("p:1", ("trainyard", "check", "a.yaml"), ("a.yaml: bad", "")),
        Quoted("p:1", ("trainyard", "schema"), None),
    ]


@pytest.mark.parametrize("quoted", QUOTED, ids=_id)
def test_a_quoted_command_is_one_the_cli_takes(quoted: Quoted) -> None:
    try:
        cli.parser().parse_args(list(quoted.argv[1:]))
    except SystemExit as exc:
        # --help exits 0 after printing; anything else is argparse refusing the doc's command line.
        assert exc.code == 0, f"{quoted.where}: the CLI refuses {' '.join(quoted.argv)!r}: fix the doc or the CLI"


@pytest.mark.parametrize("quoted", [q for q in QUOTED if q.cheap], ids=_id)
def test_a_cheap_quoted_command_prints_what_the_doc_says(
    quoted: Quoted, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.chdir(ROOT)  # the docs' paths are the checkout's
    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path))  # specs render ${TRAINYARD_HOME}; no demo folder read
    for cold in ("tokens", "finetune"):  # the cold tier as `make demo` leaves it: check finds the sources
        (tmp_path / "cold" / cold).mkdir(parents=True)
    monkeypatch.setenv("COLUMNS", "80")  # argparse wraps --help to the terminal's width
    try:
        code = cli.main(list(quoted.argv[1:]))
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    captured = capsys.readouterr()
    printed = [line.rstrip() for line in (captured.out + captured.err).splitlines()]
    if quoted.output is None:
        assert code == 0, f"{quoted.where}: {' '.join(quoted.argv)!r} failed:\n{captured.out}{captured.err}"
        return
    expected = list(quoted.output)
    while expected and not expected[-1]:
        expected.pop()
    assert printed == expected, f"{quoted.where}: the doc quotes other output than {' '.join(quoted.argv)!r} prints"
