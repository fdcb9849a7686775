"""The launcher's side of the zygote (``backends.local.zygote``): start it, fork nodes from it, learn how they ended.

Protocol, one JSON object per line: the launcher writes ``{"id", "argv", "env",
"log"}`` (and optionally ``"cwd"`` and ``"unbuffered"``, python's ``-u``); the zygote answers ``{"id", "pid"}`` for each (or ``{"id", "error"}``) and
``{"exit": pid, "code": c}`` when a child ends (``c`` as ``Popen.returncode``:
negative for a signal).

Training code runs as the same user, so the launcher trusts no line it reads:
each must have the protocol's shape and length (``parse_reply``), answer the
request it sent (a random ``id``), and name a pid whose parent is the zygote
(``child_of``); an exit counts only for a node it forked that is no longer the
zygote's live child. Anything else is refused with a warning. A torchrun agent
forked by the zygote talks to its own fork server through the same class
(``Zygote.over``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, Protocol

from trainyard.atomic import loads_untrusted

MODULE = "trainyard.workload"
"""The entry point the zygote has imported: a plan that runs anything else starts a fresh interpreter."""
TORCHRUN = ["-m", "torch.distributed.run"]
"""A node's torchrun agent, which the zygote has imported too."""
REAP_S = 0.05
"""How often a node's end is looked for: by the launcher in ``Forked.wait``, by the zygote in its loop."""
MAX_REPLY = 4096
"""Bytes of one reply line: ``{"id", "pid"}``, ``{"exit", "code"}`` or a short ``{"id", "error"}``."""
MAX_WARNINGS = 20
log = logging.getLogger(__name__)


def _pid(value: Any) -> bool:
    return type(value) is int and 0 < value < 1 << 22


def parse_reply(line: bytes) -> dict[str, Any] | None:
    """The zygote's reply if ``line`` has one of the protocol's shapes (bounded), else None."""
    if len(line) > MAX_REPLY:
        return None
    try:
        message = loads_untrusted(line, "zygote reply")
    except ValueError:  # nesting included: a forged reply must not end the launcher's reader
        return None
    if not isinstance(message, dict):
        return None
    keys, ident = set(message), message.get("id")
    if keys == {"id", "pid"} and isinstance(ident, str) and _pid(message["pid"]):
        return message
    if keys == {"id", "error"} and isinstance(ident, str) and isinstance(message["error"], str):
        return message
    if keys == {"exit", "code"} and _pid(message["exit"]) and type(message["code"]) is int:
        return message if -256 < message["code"] < 256 else None
    return None


def child_of(zygote: int, pid: int) -> bool:
    """Whether ``pid`` is a child of ``zygote`` not yet reaped (running or a zombie), from ``/proc``.

    A node's ``{"pid"}`` is sent before the zygote could reap it, so a true one is its child; an
    ``{"exit"}`` is sent after the reap, so a true one is not (any more)."""
    try:
        ppid = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]
    except (OSError, IndexError):
        return False
    return ppid == str(zygote)


class Forked:
    """A node forked by the zygote, with the part of ``subprocess.Popen``'s interface the launcher uses."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"forked node pid {self.pid}", timeout or 0.0)
            time.sleep(REAP_S)
        return code


class ForkServer(Protocol):
    """What ``Zygote`` needs of the process it talks to: a ``subprocess.Popen`` or a ``_ServerProcess``."""

    pid: int

    @property
    def stdin(self) -> IO[bytes] | None: ...

    @property
    def stdout(self) -> IO[bytes] | None: ...

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


class Zygote:
    """The launcher's side: start the zygote, fork nodes from it, learn how they ended."""

    def __init__(self, env: Mapping[str, str], preexec_fn: Any = None, argv: list[str] | None = None):
        self._attach(
            subprocess.Popen(
                argv or [sys.executable, "-m", "trainyard.backends.local.zygote"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=None,  # its own failure (an import error) reaches the task's log
                env=dict(env),
                start_new_session=True,
                preexec_fn=preexec_fn,
            )
        )

    @classmethod
    def over(cls, proc: ForkServer) -> Zygote:
        """The side that talks to a server already running (a torchrun agent's, ``_agent``)."""
        zygote = cls.__new__(cls)
        zygote._attach(proc)
        return zygote

    def _attach(self, proc: ForkServer) -> None:
        self.proc = proc
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out: IO[bytes] = self.proc.stdout
        self._lock = threading.Lock()  # one request at a time: the answers come back in order
        self._exits: dict[int, int] = {}
        self._replies: dict[str, dict[str, Any]] = {}  # the answer to the request awaited, by its id
        self._awaited: str | None = None
        self._forked: set[int] = set()
        self._gone: str | None = None
        self._refused = 0
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="trainyard-zygote", daemon=True).start()

    def _read(self) -> None:
        while line := self._out.readline(MAX_REPLY + 1):
            if not line.endswith(b"\n") and len(line) > MAX_REPLY:
                while (rest := self._out.readline(MAX_REPLY)) and not rest.endswith(b"\n"):
                    pass  # the rest of an overlong line: never held whole
            message = parse_reply(line)
            with self._changed:
                if message is None or not self._take(message):
                    self._refused += 1
                    if self._refused <= MAX_WARNINGS:  # a flood of forged lines must not flood the task log
                        log.warning("zygote: refused a reply line that is not its answer: %r", line[:200])
                    continue
                self._changed.notify_all()
        with self._changed:  # the zygote is gone: nothing more will come
            self._gone = f"the zygote exited ({self.proc.wait()})"
            self._changed.notify_all()

    def _take(self, message: dict[str, Any]) -> bool:
        """Keep a parsed reply if it is true: an exit of a node it forked and reaped, or an answer awaited."""
        if "exit" in message:
            pid = message["exit"]
            if pid not in self._forked or pid in self._exits or child_of(self.proc.pid, pid):
                return False
            self._exits[pid] = message["code"]
        elif (ident := str(message["id"])) == self._awaited and ident not in self._replies:
            if "pid" in message and not child_of(self.proc.pid, message["pid"]):
                message = {"error": f"its answer names pid {message['pid']}, which it did not fork; refused"}
            elif "pid" in message:
                self._forked.add(message["pid"])  # now, before its exit can be read
            self._replies[ident] = message
        else:
            return False
        return True

    def spawn(
        self,
        argv: list[str],
        env: Mapping[str, str],
        log: Path,
        cwd: Path | None = None,
        timeout_s: float = 60.0,
        unbuffered: bool = False,
    ) -> Forked:
        """Fork a node running ``python [-u] <argv>`` (``argv`` as ``usable`` takes it) with ``env`` in ``cwd``
        (None: the zygote's), its output appended to ``log``. ``RuntimeError`` if the zygote cannot."""
        ident = secrets.token_hex(16)  # its answer must name it: a line written by anyone else cannot
        where: dict[str, Any] = {"cwd": str(cwd)} if cwd is not None else {}
        if unbuffered:
            where["unbuffered"] = True
        request = json.dumps({"id": ident, "argv": argv, "env": dict(env), "log": str(log), **where}) + "\n"
        with self._lock, self._changed:
            assert self.proc.stdin is not None
            self._awaited = ident
            try:
                self.proc.stdin.write(request.encode())
                self.proc.stdin.flush()
            except OSError as exc:
                raise RuntimeError(f"the zygote is gone: {exc}") from exc
            if not self._changed.wait_for(lambda: ident in self._replies or self._gone, timeout=timeout_s):
                raise RuntimeError(f"the zygote did not answer within {timeout_s:.0f}s")
            reply, self._awaited = self._replies.pop(ident, {"error": self._gone}), None
        if "pid" not in reply:
            raise RuntimeError(f"the zygote could not start the node: {str(reply.get('error'))[:300]}")
        return Forked(self, reply["pid"])

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            if pid in self._forked and pid not in self._exits and self._gone:
                return -signal.SIGKILL  # its children die with it (``die_with_parent``): no exit will come
            return self._exits.get(pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Close its stdin: it exits once its children have (they are the launcher's to end)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def usable(argv: list[str], scripts: bool = False) -> bool:
    """Whether a node's ``argv`` (after the interpreter) runs what the zygote has imported: the reference
    workload, or a torchrun agent (torch's code, whatever its workers run); with ``scripts`` (a zygote that
    imported the script's framework, ``zygote_argv``) any ``.py`` script or ``-m`` module too."""
    if argv[:2] in (["-m", MODULE], TORCHRUN):
        return True
    return scripts and bool(argv) and (argv[0].endswith(".py") or (argv[0] == "-m" and len(argv) > 1))


def zygote_argv(framework: str, script: Path | None) -> list[str]:
    """The zygote's command line: what it imports before forking (``trainyard.preload``: ``framework``, read
    from ``script`` for ``auto``); ``none`` forks no script's rank."""
    where = ["--script", str(script)] if script is not None else []
    return [sys.executable, "-m", "trainyard.backends.local.zygote", "--framework", framework, *where]
