"""The ``trainyard`` command's conventions, shared by every subcommand: exit codes, ``-o text|json``, local paths
given as ``file://`` URIs, and one line (never a traceback) for whatever goes wrong.

They follow Airflow's and kubectl's CLIs, so that scripts and CI treat trainyard like the tools beside it:
``-o json`` prints one JSON document on stdout and nothing else there; the exit code says whose move it is.
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from trainyard.errors import InfrastructureError, TrainyardError, TransientError, UsageError
from trainyard.spec.templating import render

DEBUG_VARIABLE = "TRAINYARD_DEBUG"
"""Set to 1 for the full traceback of an unexpected error (the default is one line)."""


class Exit(enum.IntEnum):
    """What an exit code tells a script (README, "Exit codes"): declared here once."""

    OK = 0
    FAILED = 1
    """The thing checked failed: a failed run, an invalid checkpoint, an invalid spec, a failed drill."""
    USAGE = 2
    """The command line is wrong (argparse's own code): a path that does not exist or is not a run folder, no run
    found, a bucket that does not exist."""
    INFRASTRUCTURE = 3
    """Something around trainyard failed: S3, credentials, the network, Airflow. Fix it (or wait) and run again."""
    BUG = 4
    """An exception trainyard did not expect: a defect of ours; run with TRAINYARD_DEBUG=1 and report it."""
    INTERRUPTED = 130
    """Ctrl-C (128 + SIGINT), as shells report it."""
    BROKEN_PIPE = 141
    """The reader of stdout went away (``| head``): 128 + SIGPIPE, as other CLIs end."""


def exit_code(exc: TrainyardError) -> Exit:
    """The exit code of an error trainyard explains in one line."""
    from trainyard.storage.s3auth import CredentialsNotFound

    if isinstance(exc, UsageError):
        return Exit.USAGE
    if isinstance(exc, InfrastructureError | TransientError | CredentialsNotFound):
        return Exit.INFRASTRUCTURE
    return Exit.FAILED


# ------------------------------------------------------------------ output


OUTPUTS = ("text", "json")


def add_output(parser: argparse.ArgumentParser) -> None:
    """``-o text|json`` (and ``--json``) on a command that reports something."""
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUTS,
        default="text",
        help="text for people (default), or json: one JSON document on stdout, for scripts",
    )
    parser.add_argument("--json", dest="output", action="store_const", const="json", help="the same as -o json")


def emit(args: argparse.Namespace, data: Any, text: Callable[[], str]) -> None:
    """Print the command's report: ``data`` as JSON with ``-o json``, else ``text()`` (built only when shown)."""
    if getattr(args, "output", "text") == "json":
        print(json.dumps(data, indent=2, default=str))
    else:
        print(text())


# ------------------------------------------------------------------ paths


def local_path(text: str, where: str) -> Path:
    """A local file or folder given as a path or as a ``file://`` URI (the spec's own form); ``${VAR}`` filled.

    ``where`` names the argument in the error of any other scheme."""
    try:
        rendered = render(text, {})
    except KeyError as exc:
        raise UsageError(f"{where}: {exc.args[0]}") from None
    scheme, sep, rest = rendered.partition("://")
    if not sep:
        return Path(rendered)
    if scheme != "file":
        raise UsageError(f"{where}: {text!r} is not a local path; give a folder or a file:// URI")
    return Path(rest)


def path_arg(text: str) -> Path:
    """argparse ``type`` of a positional path: a path or a ``file://`` URI."""
    try:
        return local_path(text, "path")
    except UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def existing(path: Path, what: str = "file or folder") -> Path:
    """``path``, or a ``UsageError`` saying it is not there."""
    if not path.exists():
        raise UsageError(f"{path}: no such {what}")
    return path


# ------------------------------------------------------------------ running a command


def run_command(command: str, fn: Callable[[], int]) -> int:
    """Run one command to its exit code: every error one line on stderr, never a traceback (except on request)."""
    try:
        with _stdout_guard():
            code = fn()
            sys.stdout.flush()  # a reader that left shows here, inside the guard, not at interpreter exit
            return code
    except TrainyardError as exc:
        print(f"trainyard {command}: {exc}", file=sys.stderr)
        return exit_code(exc)
    except _BrokenPipe:
        return Exit.BROKEN_PIPE
    except KeyboardInterrupt:
        print(f"trainyard {command}: interrupted", file=sys.stderr)
        return Exit.INTERRUPTED
    except Exception as exc:
        if os.environ.get(DEBUG_VARIABLE) == "1":
            traceback.print_exc()
        else:
            print(
                f"trainyard {command}: unexpected {type(exc).__name__}: {exc} (a bug of trainyard's;"
                f" {DEBUG_VARIABLE}=1 shows the traceback)",
                file=sys.stderr,
            )
        return Exit.BUG


class _BrokenPipe(Exception):
    """stdout's reader went away; stdout is already pointed at /dev/null."""


@contextmanager
def _stdout_guard() -> Iterator[None]:
    """Turn a broken stdout pipe into ``_BrokenPipe`` after pointing stdout at /dev/null: Python flushes stdout
    again as it exits, and that second failure would print "Exception ignored ... BrokenPipeError"."""
    try:
        yield
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, sys.stdout.fileno())
        finally:
            os.close(devnull)
        raise _BrokenPipe from None
