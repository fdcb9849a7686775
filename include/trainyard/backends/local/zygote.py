"""Local nodes as forks of one process that imported torch once (``python -m trainyard.backends.local.zygote``).

Three local nodes importing torch and the training code at once on 2 shared
cores spend 3.4 s before their first step, 2 s of CPU each; a node started
again to rejoin a running world spends those 2 s of CPU beside the survivors'
training. A fork of a process that already imported them starts in
milliseconds (its pages are shared, copy on write). The zygote imports the
reference workload (``trainyard.workload``) and nothing else runs in it: no
thread, no torch operation (an OpenMP pool or CUDA context must not exist
across a fork), so each child is as fresh as a new interpreter.

Its environment is the part every node shares (allow-listed by the launcher,
never the Airflow worker's secrets, since training code is untrusted and a
fork keeps the zygote's original environment block in memory); each child
then takes its node's own. Each child is a session of its own that dies with
the zygote, which dies with the launcher (``PR_SET_PDEATHSIG``) or when the
launcher closes its stdin.

Protocol, one JSON object per line: the launcher writes ``{"argv", "env",
"log"}``; the zygote answers ``{"pid"}`` for each (or ``{"error"}``) and
``{"exit": pid, "code": c}`` when a child ends (``c`` as ``Popen.returncode``:
negative for a signal).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

MODULE = "trainyard.workload"
"""The entry point the zygote has imported: a plan that runs anything else starts a fresh interpreter."""
_REAP_S = 0.05


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


class Zygote:
    """The launcher's side: start the zygote, fork nodes from it, learn how they ended."""

    def __init__(self, env: Mapping[str, str], preexec_fn: Any = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "trainyard.backends.local.zygote"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=None,  # its own failure (an import error) reaches the task's log
            env=dict(env),
            start_new_session=True,
            preexec_fn=preexec_fn,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._out: IO[bytes] = self.proc.stdout
        self._lock = threading.Lock()  # one request at a time: the answers come back in order
        self._exits: dict[int, int] = {}
        self._replies: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        threading.Thread(target=self._read, name="trainyard-zygote", daemon=True).start()

    def _read(self) -> None:
        for line in self._out:
            message = json.loads(line)
            with self._changed:
                if "exit" in message:
                    self._exits[message["exit"]] = message["code"]
                else:
                    self._replies.append(message)
                self._changed.notify_all()
        with self._changed:  # the zygote is gone: nothing more will come
            self._replies.append({"error": f"the zygote exited ({self.proc.wait()})"})
            self._changed.notify_all()

    def spawn(self, argv: list[str], env: Mapping[str, str], log: Path, timeout_s: float = 60.0) -> Forked:
        """Fork a node running ``python <argv>`` (``argv`` starts with ``-m trainyard.workload``) with ``env``,
        its output appended to ``log``. ``RuntimeError`` if the zygote cannot."""
        request = json.dumps({"argv": argv, "env": dict(env), "log": str(log)}) + "\n"
        with self._lock, self._changed:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(request.encode())
                self.proc.stdin.flush()
            except OSError as exc:
                raise RuntimeError(f"the zygote is gone: {exc}") from exc
            if not self._changed.wait_for(lambda: self._replies, timeout=timeout_s):
                raise RuntimeError(f"the zygote did not answer within {timeout_s:.0f}s")
            reply = self._replies.pop(0)
        if "pid" not in reply:
            raise RuntimeError(f"the zygote could not start the node: {reply.get('error')}")
        return Forked(self, reply["pid"])

    def exit_code(self, pid: int) -> int | None:
        with self._changed:
            return self._exits.get(pid)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        """Close its stdin: it exits once its children have (they are the launcher's to end)."""
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()


def usable(argv: list[str]) -> bool:
    """Whether a node's ``argv`` (after the interpreter) runs what the zygote has imported."""
    return argv[:2] == ["-m", MODULE]


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


def _send(message: dict[str, Any]) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _reap(children: set[int]) -> None:
    """Report every child that ended (``waitpid`` without blocking)."""
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        children.discard(pid)
        _send({"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def serve() -> None:
    """Read requests on stdin, fork a node for each, report each child's end; exit at EOF once none is left."""
    # The point of the zygote: torch and the workload imported once, and what each fork needs (``_child``).
    import trainyard.atomic
    import trainyard.backends.local.procs
    import trainyard.workload.__main__  # noqa: F401

    if threading.active_count() != 1:  # a fork copies only the forking thread: a lock another held stays held
        raise SystemExit(f"trainyard zygote: {threading.active_count()} threads after the imports; not forking")
    children: set[int] = set()
    pending, reading = b"", True
    while reading or children:
        if reading and select.select([0], [], [], _REAP_S)[0]:
            chunk = os.read(0, 65536)
            reading, pending = bool(chunk), pending + chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                try:
                    request = json.loads(line)
                    pid = os.fork()
                except (ValueError, OSError) as exc:
                    _send({"error": f"{type(exc).__name__}: {exc}"})
                    continue
                if pid == 0:
                    _child(request)
                children.add(pid)
                _send({"pid": pid})
        elif not reading:
            time.sleep(_REAP_S)
        _reap(children)


if __name__ == "__main__":
    serve()
