"""The launcher's side of the zygote's pipe trusts no line: shape, length, request id, and a pid it forked.

A stand-in zygote (no torch) answers as a forger on the same pipe would: lines that are not the protocol,
an answer to no request, a foreign pid, an exit of a node still running; then the true answers.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

import trainyard
from trainyard.backends.local.zygote_client import MAX_REPLY, Zygote, parse_reply

FORGER = r"""
import json, os, sys, time
def say(line):
    os.write(1, line if isinstance(line, bytes) else (json.dumps(line) + "\n").encode())
request = json.loads(sys.stdin.readline())
say(b"not json\n")
say(b"[" * 3000 + b"\n")  # nested past the parser's recursion
say(b'{"pid": ' + b"1" * 9000 + b"}\n")  # overlong
say({"id": request["id"], "pid": True})
say({"id": "another request", "pid": os.getpid()})
say({"id": request["id"], "pid": 1})  # a pid it never forked: the machine's init
request = json.loads(sys.stdin.readline())
child = os.fork()
if child == 0:
    time.sleep(1.5)
    os._exit(3)
say({"id": request["id"], "pid": child})
say({"exit": child, "code": 0})  # the child still runs: a forged end
say({"exit": 1, "code": 0})  # not a node it forked
os.waitpid(child, 0)
say({"exit": child, "code": 3})
sys.stdin.read()
"""


@pytest.mark.parametrize(
    "line",
    [
        b"",
        b"[1, 2]",
        b'{"pid": 12}',  # no request id
        b'{"id": "a", "pid": -1}',
        b'{"id": "a", "pid": "12"}',
        b'{"id": "a", "pid": 12, "env": {}}',
        b'{"exit": 12, "code": 1e9}',
        b'{"exit": 12, "code": 100000}',
        b'{"id": "a", "error": "' + b"x" * MAX_REPLY + b'"}',
        b"[" * 3000,  # under MAX_REPLY, and once a RecursionError out of the launcher's reader
        b'{"id": "a", "error": ' + b"[" * 100 + b"]" * 100 + b"}",
        b'{"id": "\xed\xa0\x80", "pid": 12}',  # a surrogate in UTF-8 bytes: not Unicode
    ],
)
def test_a_line_off_the_protocol_is_no_reply(line: bytes) -> None:
    assert parse_reply(line) is None


def test_protocol_lines_parse() -> None:
    assert parse_reply(b'{"id": "a", "pid": 12}\n') == {"id": "a", "pid": 12}
    assert parse_reply(b'{"exit": 12, "code": -9}') == {"exit": 12, "code": -9}
    assert parse_reply(b'{"id": "a", "error": "fork failed"}') == {"id": "a", "error": "fork failed"}


def test_forged_replies_and_a_foreign_pid_are_refused(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    zygote = Zygote({}, argv=[sys.executable, "-c", FORGER])
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(RuntimeError, match="names pid 1, which it did not fork"):
            zygote.spawn(["-m", "trainyard.workload"], {}, tmp_path / "node-0.log", timeout_s=20)
        refused = [r.getMessage() for r in caplog.records if "refused a reply line" in r.getMessage()]
        assert len(refused) == 5 and all(len(r) < 400 for r in refused)
        node = zygote.spawn(["-m", "trainyard.workload"], {}, tmp_path / "node-1.log", timeout_s=20)
        assert node.wait(timeout=20) == 3  # its true end; the forged "0" while it ran was refused
        assert zygote.exit_code(1) is None
    finally:
        zygote.close()
        zygote.proc.wait(timeout=20)


HOLDER = """
import os, sys, time
from trainyard.backends.local.zygote import _not_dumpable
if sys.argv[1] == "closed":
    _not_dumpable()  # as the zygote does before it forks a node
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
print(child, flush=True)
time.sleep(30)
"""


def _as_nobody() -> None:
    os.setgid(65534)
    os.setuid(65534)


@pytest.mark.parametrize("closed", [True, False])
def test_the_zygote_and_its_forks_are_closed_to_processes_of_their_own_user(closed: bool) -> None:
    """Training code runs as the zygote's user: it may not read the zygote's (or a fork's) memory, environment
    or pipes through /proc. Shown as an unprivileged user (as root, every check passes by privilege)."""
    import subprocess

    user = _as_nobody if os.geteuid() == 0 else None
    python = sys.executable if user is None else "/usr/bin/python3"  # the venv's may lie in root's home
    env = {"PYTHONPATH": str(Path(trainyard.__file__).parents[1]), "PATH": os.environ["PATH"]}
    if subprocess.run([python, "-c", "import trainyard"], env=env, preexec_fn=user).returncode != 0:
        pytest.skip(f"{python} cannot import trainyard as an unprivileged user here")
    holder = subprocess.Popen(
        [python, "-c", HOLDER, "closed" if closed else "open"], env=env, stdout=subprocess.PIPE, preexec_fn=user
    )
    child = None
    try:
        assert holder.stdout is not None
        child = int(holder.stdout.readline())
        for pid in (holder.pid, child):
            peek = f"open('/proc/{pid}/environ', 'rb').read(1); open('/proc/{pid}/mem', 'rb')"
            seen = subprocess.run([python, "-c", peek], env=env, preexec_fn=user, capture_output=True, text=True)
            assert (seen.returncode != 0 and "PermissionError" in seen.stderr) == closed, seen.stderr
    finally:
        if child is not None:
            os.kill(child, 9)
        holder.kill()
        holder.wait()
