"""Local nodes as forks of one process that imported torch once (``python -m trainyard.backends.local.zygote``).

Three local nodes importing torch and the training code at once on 2 shared
cores spend 3.4 s before their first step, 2 s of CPU each; a node started
again to rejoin a running world spends those 2 s of CPU beside the survivors'
training. A fork of a process that already imported them starts in
milliseconds (its pages are shared, copy on write). The zygote imports the
reference workload (``trainyard.workload``) and nothing else runs in it: no
thread, no torch operation (an OpenMP pool or CUDA context must not exist
across a fork), so each child is as fresh as a new interpreter.

On the relaunch path a node is a torchrun agent (``torch.distributed.run``, torch's
code whatever the entry point): it is forked too, and forks the workers of the
reference workload in turn from a fork server of its own, forked before the
agent starts its threads (``_agent``); any other worker is started as torchrun
starts it, a new interpreter. A node on the relaunch path thus costs two
imports of torch less (~3 s and ~5 s of CPU each here) at every attempt.

Its environment is the part every node shares (allow-listed by the launcher,
never the Airflow worker's secrets, since training code is untrusted and a
fork keeps the zygote's original environment block in memory); each child
then takes its node's own. Each child is a session of its own that dies with
the zygote, which dies with the launcher (``PR_SET_PDEATHSIG``) or when the
launcher closes its stdin.

Protocol, one JSON object per line: the launcher writes ``{"id", "argv", "env",
"log"}``; the zygote answers ``{"id", "pid"}`` for each (or ``{"id", "error"}``) and
``{"exit": pid, "code": c}`` when a child ends (``c`` as ``Popen.returncode``:
negative for a signal).

Training code runs as the same user, so the zygote (it holds every node's
environment, and the pipe the launcher trusts) is not dumpable: no ptrace, no
``/proc/PID/mem``, ``environ`` or ``fd`` of it or its forks for that user. The
launcher still trusts no line it reads: each must have the protocol's shape and
length (``parse_reply``), answer the request it sent (a random ``id``), and name
a pid whose parent is the zygote (``child_of``); an exit counts only for a node
it forked that is no longer the zygote's live child. Anything else is refused
with a warning.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import secrets
import select
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
_REAP_S = 0.05
_ANNOUNCED_S = 1.0  # a node stays the zygote's (unreaped) child this long: the launcher checks its pid by it
MAX_REPLY = 4096
"""Bytes of one reply line: ``{"id", "pid"}``, ``{"exit", "code"}`` or a short ``{"id", "error"}``."""
MAX_REQUEST = 16 << 20
"""Bytes of one request line (a node's environment): the zygote drops a longer one."""
_PR_SET_DUMPABLE = 4
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
            time.sleep(_REAP_S)
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

    def spawn(self, argv: list[str], env: Mapping[str, str], log: Path, timeout_s: float = 60.0) -> Forked:
        """Fork a node running ``python <argv>`` (``argv`` starts with ``-m trainyard.workload``) with ``env``,
        its output appended to ``log``. ``RuntimeError`` if the zygote cannot."""
        ident = secrets.token_hex(16)  # its answer must name it: a line written by anyone else cannot
        request = json.dumps({"id": ident, "argv": argv, "env": dict(env), "log": str(log)}) + "\n"
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


def usable(argv: list[str]) -> bool:
    """Whether a node's ``argv`` (after the interpreter) runs what the zygote has imported: the reference
    workload, or a torchrun agent (torch's code, whatever its workers run)."""
    return argv[:2] in (["-m", MODULE], TORCHRUN)


# --- the zygote process ---


def _child(request: dict[str, Any]) -> None:
    """In the fork: become the node (session, output, environment, argv), run it, never return.

    Its imports are the zygote's, already done (``serve``): here they only look the modules up."""
    from trainyard.atomic import open_append
    from trainyard.backends.local.procs import die_with_parent

    code = 1
    try:
        os.setsid()
        die_with_parent()  # the zygote's death ends the node, as a launcher's death ends a node it started
        with open_append(Path(request["log"])) as out:  # training code may have planted a link
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.executable, *request["argv"]]
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # the log, line by line
        sys.stderr = open(2, "w", buffering=1, closefd=False)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a fork server's children: it ignores them (``_agent``)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["argv"][:2] == TORCHRUN:
            _agent(request["argv"][2:], Path(request["log"]))
            code = 0
        else:
            import torch

            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
            from trainyard.workload.__main__ import main

            code = main(request["argv"][2:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()  # what an interpreter's exit runs (the runtime's last progress, logging)
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _not_dumpable() -> None:
    """No ptrace, ``/proc/PID/mem``, ``environ`` or ``fd`` of this process (and its forks) for its own user:
    training code runs as that user, and this process holds every node's request and the launcher's pipe."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0)


def _send(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _reap(children: dict[int, float]) -> None:
    """Report every child that ended (``waitpid`` without blocking), once its pid is ``_ANNOUNCED_S`` old:
    until it is reaped it stays the zygote's child, which is how the launcher knows its pid is true."""
    now = time.monotonic()
    for pid in [p for p, born in children.items() if now - born >= _ANNOUNCED_S]:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            del children[pid]
            _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(line: bytes, children: dict[int, float]) -> None:
    """Fork a node for one request line; answer with its pid (or why not) under the request's id."""
    try:
        request = json.loads(line)
        ident = str(request["id"])
    except (ValueError, KeyError, TypeError) as exc:
        _send({"id": "", "error": f"a malformed request ({type(exc).__name__})"})
        return
    try:
        pid = os.fork()
    except OSError as exc:
        _send({"id": ident, "error": f"OSError: {exc}"})
        return
    if pid == 0:
        _child(request)
    children[pid] = time.monotonic()
    _send({"id": ident, "pid": pid})


def _agent(argv: list[str], log: Path) -> None:
    """Run a torchrun agent (``torch.distributed.run`` with ``argv``) whose workers of the reference workload are
    forks: of a server forked first, while this process has one thread (the agent starts threads for its
    rendezvous). The server is the agent's child, so the node's process tree holds every worker as before; it
    ignores SIGTERM (the agent ends the workers itself, and the server must report how they ended) and exits
    once the agent has (its stdin closes) and its children have. An agent of any other entry point runs as
    torchrun's own, with no server."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    from torch.distributed.run import main, parse_args

    entry = parse_args(argv)
    if not (entry.module and entry.training_script == MODULE):
        main(argv)
        return
    server = Zygote.over(_fork_server())

    class Handler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            if self._stdout is None and self._stderr is None and args[:2] == (sys.executable, "-u"):
                if usable(worker := [str(a) for a in args[2:]]) and worker[:2] != TORCHRUN:
                    try:
                        return server.spawn(worker, env, log)
                    except RuntimeError as exc:
                        print(f"trainyard zygote: {exc}; starting the worker as a new process", file=sys.stderr)
            return super()._popen(args, env)

    # How torchrun's SubprocessContext makes each worker's handler (by keyword, as the class takes them).
    api.get_subprocess_handler = Handler  # type: ignore[assignment]
    main(argv)


class _ServerProcess:
    """A fork server forked by this process, as ``Zygote`` talks to it (``ForkServer``)."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]):
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()  # the reader thread waits while the agent polls

    def poll(self) -> int | None:
        with self._lock:
            if self.returncode is None and (done := os.waitpid(self.pid, os.WNOHANG))[0]:
                self.returncode = os.waitstatus_to_exitcode(done[1])
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        while (code := self.poll()) is None:
            time.sleep(_REAP_S)
        return code


def _fork_server() -> _ServerProcess:
    """Fork a server of forks of this process (``_serve`` on a pair of pipes); never returns in the child."""
    requests, replies = os.pipe(), os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.dup2(requests[0], 0)
            os.dup2(replies[1], 1)
            for fd in (*requests, *replies):
                os.close(fd)
            from trainyard.backends.local.procs import die_with_parent

            die_with_parent()
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _serve()
        finally:
            os._exit(0)
    os.close(requests[0])
    os.close(replies[1])
    return _ServerProcess(pid, os.fdopen(requests[1], "wb"), os.fdopen(replies[0], "rb"))


def serve() -> None:
    """Read requests on stdin, fork a node for each, report each child's end; exit at EOF once none is left."""
    # The point of the zygote: torch, the workload and torchrun imported once, and what each fork needs.
    import torch.distributed.elastic.multiprocessing.api
    import torch.distributed.run  # noqa: F401

    import trainyard.atomic
    import trainyard.backends.local.procs
    import trainyard.workload.__main__  # noqa: F401

    _not_dumpable()
    if threading.active_count() != 1:  # a fork copies only the forking thread: a lock another held stays held
        raise SystemExit(f"trainyard zygote: {threading.active_count()} threads after the imports; not forking")
    _serve()


def _serve() -> None:
    children: dict[int, float] = {}  # pid -> when it was forked
    pending, reading = b"", True
    while reading or children:
        if reading and select.select([0], [], [], _REAP_S)[0]:
            chunk = os.read(0, 65536)
            reading, pending = bool(chunk), pending + chunk
            if len(pending) > MAX_REQUEST and b"\n" not in pending:
                pending = b""  # no request is this long; what follows its end is refused as malformed
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                _fork(line, children)
        elif not reading:
            time.sleep(_REAP_S)
        _reap(children)


if __name__ == "__main__":
    serve()
