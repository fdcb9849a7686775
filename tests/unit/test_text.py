"""Worker text made printable: one line, every control character visible as its escape, length capped."""

from __future__ import annotations

import pytest

from trainyard.text import LIMIT, printable


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("step_000010", "step_000010"),
        ("step_000010\nprogress: step 999 \x1b[2K", "step_000010\\nprogress: step 999 \\x1b[2K"),
        ("a\rb\tc\x00d\x7fe\x9bf", "a\\rb\\tc\\x00d\\x7fe\\x9bf"),  # CR, tab, NUL, DEL, C1 CSI
        ("line\u2028sep \u202eevil", "line\\u2028sep \\u202eevil"),  # a line separator, a bidi override
        ("ünïcode ✓ stays", "ünïcode ✓ stays"),
        (7, "7"),
    ],
)
def test_control_characters_are_shown_as_escapes(text: object, want: str) -> None:
    assert printable(text) == want


def test_long_text_is_cut_and_marked() -> None:
    assert printable("x" * 10_000) == "x" * LIMIT + "..."
    assert printable("\x1b" * 10_000, 8) == "\\x1b\\x1b..."
    assert printable("abc", 3) == "abc"
