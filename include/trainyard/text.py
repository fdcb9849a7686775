"""Text that training code chose, made safe to print in one log line or the ledger's human-facing text.

A checkpoint folder name, a node name in a heartbeat, a message in a failure
record or a line of a node's log is written by training code (untrusted,
docs/architecture.md, rule 11). Printed as it is, a newline in it starts a
line of its own (a forged ``progress:`` line in the task log) and an escape
sequence (``ESC [2K``) rewrites what a terminal shows. ``printable`` shows every
control character as its escape (``\\n``, ``\\x1b``) and caps the length, so such
text is always one visible line of bounded size, whatever it holds.
"""

from __future__ import annotations

import re

LIMIT = 200
"""Characters of worker text kept in one field of a log line (a name, a reason); the rest is cut."""

# C0 (newline, CR and ESC among them), DEL and C1; the Unicode line and paragraph separators (a new line to
# str.splitlines and to some viewers); the bidirectional overrides, which reorder what a reader sees.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return _NAMED.get(char) or (f"\\x{ord(char):02x}" if ord(char) < 0x100 else f"\\u{ord(char):04x}")


def printable(text: object, limit: int = LIMIT) -> str:
    """``text`` (or its ``str``) as one printable line: control characters as escapes, at most ``limit``
    characters of it kept (a cut is marked ``...``)."""
    raw = str(text)
    shown = _CONTROL.sub(_escape, raw[: limit + 1])  # only what can be shown is escaped (a huge text costs its cap)
    if len(raw) > limit or len(shown) > limit:
        return shown[:limit] + "..."
    return shown
