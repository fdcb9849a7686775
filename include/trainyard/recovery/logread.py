"""Reading a node's log tail for ``classify``: its streams, exception chains and the best line per category.

Pure text handling (no I/O): how the logs are read is described in ``recovery.classify``'s docstring.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainyard.protocol.signs import LOG_PATTERNS

_COMPILED = {cat: re.compile("|".join(f"(?:{p})" for p in pats), re.IGNORECASE) for cat, pats in LOG_PATTERNS.items()}
# Categories that name a root cause, in the order their rules are tried (user exceptions come after them).
ROOT_CAUSES = ("diverged", "data", "spec", "oom", "hardware")

# torchrun's wrappers and the ways an attempt is ended from outside: never a root cause.
NOT_ROOT_CAUSES = frozenset({"ChildFailedError", "SignalException", "KeyboardInterrupt", "SystemExit"})

_RANK_PREFIX = re.compile(r"^\[([A-Za-z_]*\d+)\]:\s?")
_EXCEPTION = re.compile(r"^(?P<name>(?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Failed|Interrupt|Exit))(?::|$)")
_CHAINED = re.compile(r"During handling of the above exception|The above exception was the direct cause")
# glog headers of torch's C++ and elastic logs ("E1129 22:05:25.913000 26115 .../api.py:1002] ",
# "[W1129 22:02:17.454685851 TCPStore.cpp:115] "): noise in a one-line evidence.
LOG_HEADER = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +(?:\d+ )?\S+:\d+\] ")
_WORKER_EXIT = re.compile(r"failed \(exitcode: -?\d+\)")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line \d+')
# Code of torchrun's agent: an exception raised there (innermost frame) is the agent's own, e.g. its
# teardown after a cancel finding a worker's process group already gone (ProcessLookupError), not the script's.
_AGENT_CODE = "/torch/distributed/elastic/"


@dataclass(frozen=True)
class Hit:
    node: str
    line: str
    """The matching log line, stripped (a rank prefix kept: it says which rank)."""


def split_streams(log: str) -> dict[str, list[tuple[str, str]]]:
    """Lines by rank prefix (``""`` for unprefixed ones): (text without the prefix, line to quote)."""
    streams: dict[str, list[tuple[str, str]]] = {}
    for raw in log.splitlines():
        m = _RANK_PREFIX.match(raw)
        quoted = LOG_HEADER.sub("", raw.strip())
        streams.setdefault(m.group(1) if m else "", []).append((raw[m.end() :] if m else raw, quoted))
    return streams


@dataclass(frozen=True)
class _Raised:
    text: str
    raw: str
    where: str
    """The file of the innermost frame printed above the exception line ("" if none was)."""


def _chains(stream: list[tuple[str, str]]) -> list[list[_Raised]]:
    """The exception lines of one stream, grouped into chains of chained tracebacks."""
    chains: list[list[_Raised]] = []
    joined = False
    where = ""
    for text, raw in stream:
        frame = _FRAME.match(text)
        if frame:
            where = frame.group("file")
        elif _CHAINED.search(text):
            joined = True
        elif _EXCEPTION.match(text):
            if joined and chains:
                chains[-1].append(_Raised(text, raw, where))
            else:
                chains.append([_Raised(text, raw, where)])
            joined = False
            where = ""
    return chains


def _raised_by_user_code(chain: list[_Raised]) -> bool:
    """A chain a worker raised on its own: not a wrapper, not the agent's own, not a peer's disappearance,
    not a known category."""
    last = chain[-1]
    name = _EXCEPTION.match(last.text).group("name").rsplit(".", 1)[-1]  # type: ignore[union-attr]
    if name in NOT_ROOT_CAUSES or _AGENT_CODE in last.where:
        return False
    if any(_COMPILED["comm"].search(r.text) for r in chain):
        return False
    return not any(_COMPILED[cat].search(last.text) for cat in ROOT_CAUSES)


Streams = dict[str, list[tuple[str, str]]]


def best_line(streams: Streams, category: str) -> str | None:
    """The most telling line in ``category``: an exception line, else an unindented one, else any."""
    best: tuple[int, str] | None = None
    for text, raw in (line for stream in streams.values() for line in stream):
        if not _COMPILED[category].search(text):
            continue
        score = 2 if _EXCEPTION.match(text) else 1 if not text[:1].isspace() else 0
        if best is None or score > best[0]:
            best = (score, raw)
    return best[1] if best else None


def user_exception(streams: Streams) -> str | None:
    for stream in streams.values():
        for chain in _chains(stream):
            if _raised_by_user_code(chain):
                return chain[-1].raw
    return None


def last_words(log: str) -> str:
    """What to quote from a log nothing matched: the agent's word on its worker's exit, else the last real line."""
    lines = [LOG_HEADER.sub("", line.strip()) for line in log.splitlines() if line.strip(" =-\t")]
    return next((line for line in reversed(lines) if _WORKER_EXIT.search(line)), lines[-1] if lines else "")
