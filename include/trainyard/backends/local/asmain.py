"""A script run in a fork of the zygote as ``python script.py`` / ``python -m module`` would run it in a new interpreter.

A rank forked from the zygote (``backends.local.zygote``) is a process that has imported torch
and the script's framework already; what the script sees must still be a new interpreter's
(rule 18: a script runs as its author wrote it): ``sys.argv``, ``sys.path[0]`` (the script's
folder, or the working folder for ``-m``), ``__main__``, and how it ends: the code of a
``SystemExit`` (``None`` 0, a number itself, anything else printed and 1), an uncaught exception's
traceback on stderr (through ``sys.excepthook``, without the zygote's own frames) and 1, an
uncaught ``KeyboardInterrupt`` ended by SIGINT, non-daemon threads joined and ``atexit`` run
before the end (``finish``).
"""

from __future__ import annotations

import contextlib
import os
import runpy
import signal
import sys
import threading
from types import TracebackType
from typing import Any

_HERE = (__file__, "runpy", "<frozen runpy>")


def run(argv: list[str]) -> None:
    """Run ``python <argv>`` (a ``.py`` path or ``-m module``, then its arguments) in this process; it returns
    when the script does, and raises what it raises."""
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's file in argv[0], as python -m does
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
    runpy.run_path(os.path.abspath(argv[0]), run_name="__main__")


def exit_code(code: Any) -> int:
    """A ``SystemExit``'s code as the interpreter ends with it (printing a non-number, as it does)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def own_frames(tb: TracebackType | None) -> TracebackType | None:
    """``tb`` from the script's first frame: the zygote's and runpy's frames above it are not the script's."""
    while tb is not None and tb.tb_next is not None and _ours(tb):
        tb = tb.tb_next
    return tb


def _ours(tb: TracebackType) -> bool:
    frame = tb.tb_frame
    return (
        frame.f_code.co_filename in _HERE
        or frame.f_globals.get("__name__") in ("runpy", __name__)
        or (frame.f_code.co_filename.endswith(os.path.join("backends", "local", "zygote.py")))
    )


def uncaught(exc: BaseException) -> int:
    """Report an exception no one caught as the interpreter does (``sys.excepthook``); the exit code, or a
    negative signal number for ``KeyboardInterrupt`` (the interpreter ends itself by SIGINT then)."""
    with contextlib.suppress(BaseException):
        # On the exception itself too: the default hook prints the exception's own traceback, not its argument.
        tb = own_frames(exc.__traceback__)
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
    return -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1


def finish(code: int) -> None:
    """End as an interpreter ends: join non-daemon threads, run ``atexit``, flush, then exit with ``code`` (a
    negative one: by that signal). Never returns."""
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]  # what Py_Finalize waits for first
    with contextlib.suppress(BaseException):
        import atexit

        atexit._run_exitfuncs()  # the runtime's last progress, logging's flush
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code if code >= 0 else 1)
