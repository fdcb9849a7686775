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
code whatever the entry point): it is forked too, and forks its workers in turn
from a fork server of its own, forked before the agent starts its threads
(``_agent``). A node on the relaunch path thus costs two imports of torch less
(~3 s and ~5 s of CPU each here) at every attempt.

Warm for any script: the zygote also imports the script's framework before it
serves (``--framework``, the spec's ``training.framework``; its modules are
``trainyard.preload``'s: transformers' trainer and ``trainyard.runtime.hf`` for
``hf``, ``lightning.pytorch`` and ``trainyard.runtime.lightning`` for
``lightning``; ``auto`` reads the script's imports), so a worker of any ``.py``
script or ``-m`` module, the reference workload's or a user's, is a fork that
runs the script as a new interpreter would (``asmain``: its argv, ``sys.path[0]``,
``__main__``, exit codes, traceback, signals). A framework whose import starts
a thread or initialises CUDA cannot be forked from: the zygote says so once on
the task's log and becomes one that imported only torch (``--framework none``),
whose agents start their workers as new interpreters.

Its environment is the part every node shares (allow-listed by the launcher,
never the Airflow worker's secrets, since training code is untrusted and a
fork keeps the zygote's original environment block in memory); each child
then takes its node's own. Each child is a session of its own that dies with
the zygote, which dies with the launcher (``PR_SET_PDEATHSIG``) or when the
launcher closes its stdin.

Its protocol and the launcher's side of it are ``backends.local.zygote_client``.

Training code runs as the same user, so the zygote (it holds every node's
environment, and the pipe the launcher trusts) is not dumpable: no ptrace, no
``/proc/PID/mem``, ``environ`` or ``fd`` of it or its forks for that user. The
launcher still trusts no line it reads (``zygote_client``).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import io
import json
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import IO, Any

from trainyard.backends.local import asmain
from trainyard.backends.local.zygote_client import MODULE, REAP_S, TORCHRUN, Zygote, usable
from trainyard.preload import modules_for


class _Warm:
    scripts = False
    """Whether the zygote imported the script's framework (``serve``): its forks' workers of any script are forks."""
    parent_death = signal.SIGTERM
    """The signal a fork gets when the process that forked it dies (SIGKILL in an agent's fork server)."""


_WARM = _Warm()

MAX_REQUEST = 16 << 20
"""Bytes of one request line (a node's environment): the zygote drops a longer one."""
_ANNOUNCED_S = 1.0  # a node stays the zygote's (unreaped) child this long: the launcher checks its pid by it
_PR_SET_DUMPABLE = 4


def _child(request: dict[str, Any]) -> None:
    """In the fork: become the node (session, output, environment, argv), run it, never return.

    Its imports are the zygote's, already done (``serve``): here they only look the modules up."""
    from trainyard.atomic import open_append
    from trainyard.backends.local.procs import die_with_parent

    code = 1
    try:
        os.setsid()
        # The zygote's death ends the node, as a launcher's death ends a node it started. A fork server dies only
        # with its agent, killed (it ignores SIGTERM): its workers die as the node did, with no handler run (a
        # SIGTERM there would read as a preemption notice, torchrun's own workers get none).
        die_with_parent(_WARM.parent_death)
        with open_append(Path(request["log"])) as out:  # training code may have planted a link
            os.dup2(out.fileno(), 1)
            os.dup2(out.fileno(), 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        if request.get("cwd"):
            os.chdir(request["cwd"])  # where the launcher says the ranks start (``LaunchPlan.local_workdir``)
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [sys.executable, *request["argv"]]
        # The log, line by line; python -u (torchrun's workers) writes through.
        unbuffered = request.get("unbuffered") is True
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=unbuffered)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True, errors="backslashreplace"
        )
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a fork server's children: it ignores them (``_agent``)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        if request["argv"][:2] == TORCHRUN:
            _agent(request["argv"][2:], Path(request["log"]))
            code = 0
        else:
            import torch

            torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
            if request["argv"][:2] == ["-m", MODULE]:
                from trainyard.workload.__main__ import main

                code = main(request["argv"][2:])
            else:
                asmain.run(request["argv"])
                code = 0
    except SystemExit as exc:
        code = asmain.exit_code(exc.code)
    except BaseException as exc:
        code = asmain.uncaught(exc)
    finally:
        asmain.finish(code)  # as an interpreter's exit: threads joined, atexit (the runtime's last progress)


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
    """Run a torchrun agent (``torch.distributed.run`` with ``argv``) whose workers are forks: of a server forked
    first, while this process has one thread (the agent starts threads for its rendezvous). The server is the
    agent's child, so the node's process tree holds every worker as before; it ignores SIGTERM (the agent ends
    the workers itself, and the server must report how they ended) and exits once the agent has (its stdin
    closes) and its children have. An agent of an entry point the zygote cannot run warm (a script when it
    imported no framework, ``--no-python``) runs as torchrun's own, with no server."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import SubprocessHandler
    from torch.distributed.run import main, parse_args

    entry = parse_args(argv)
    target = ["-m", entry.training_script] if entry.module else [entry.training_script]
    if entry.no_python or not usable(target, scripts=_WARM.scripts):
        main(argv)
        return
    server = Zygote.over(_fork_server())

    class Handler(SubprocessHandler):
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            if self._stdout is None and self._stderr is None and args[:2] == (sys.executable, "-u"):
                if usable(worker := [str(a) for a in args[2:]], _WARM.scripts) and worker[:2] != TORCHRUN:
                    try:  # in the agent's folder, as torchrun's workers; python -u as theirs
                        return server.spawn(worker, env, log, Path.cwd(), unbuffered=True)
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
            time.sleep(REAP_S)
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
            _WARM.parent_death = signal.SIGKILL
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            _serve()
        finally:
            os._exit(0)
    os.close(requests[0])
    os.close(replies[1])
    return _ServerProcess(pid, os.fdopen(requests[1], "wb"), os.fdopen(replies[0], "rb"))


def serve(argv: list[str] | None = None) -> None:
    """Read requests on stdin, fork a node for each, report each child's end; exit at EOF once none is left."""
    options = _options(argv)
    # The point of the zygote: torch, the workload and torchrun imported once, and what each fork needs.
    import torch.distributed.elastic.multiprocessing.api
    import torch.distributed.run  # noqa: F401

    import trainyard.atomic
    import trainyard.backends.local.procs
    import trainyard.workload.__main__  # noqa: F401

    _not_dumpable()
    if threading.active_count() != 1:  # a fork copies only the forking thread: a lock another held stays held
        raise SystemExit(f"trainyard zygote: {threading.active_count()} threads after the imports; not forking")
    if options.framework != "none":
        script = Path(options.script) if options.script else None
        if why := _preload(modules_for(options.framework, script)):
            print(f"trainyard zygote: {why}; this run's ranks start as new interpreters", file=sys.stderr, flush=True)
            os.execv(sys.executable, [sys.executable, "-m", "trainyard.backends.local.zygote", "--framework", "none"])
        _WARM.scripts = True
    _serve()


def _options(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainyard.backends.local.zygote")
    parser.add_argument("--framework", default="none", help="training.framework: what to import before forking")
    parser.add_argument("--script", default=None, help="the .py entrypoint, read by --framework auto")
    return parser.parse_args(argv)


def _preload(modules: list[str]) -> str | None:
    """Import ``modules`` (the script's framework); why this process may not fork any more, or None."""
    import torch

    driver = _cuda_driver_loaded()
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a framework not installed: the script will say so itself, in its rank
            return f"importing {name} failed ({type(exc).__name__}: {str(exc)[:200]})"
        if threading.active_count() != 1:
            names = ", ".join(t.name for t in threading.enumerate() if t is not threading.main_thread())
            return f"importing {name} started {threading.active_count() - 1} thread(s) ({names[:200]})"
        # torch's own flag, and the driver itself: torch.cuda.is_available() starts the driver without the flag.
        if torch.cuda.is_initialized() or (not driver and _cuda_driver_loaded()):
            return f"importing {name} initialised CUDA"
    return None


def _cuda_driver_loaded() -> bool:
    """Whether the CUDA driver library is mapped into this process (a framework that asked for a device)."""
    try:
        return "libcuda.so" in Path("/proc/self/maps").read_text()
    except OSError:
        return False


def _serve() -> None:
    children: dict[int, float] = {}  # pid -> when it was forked
    pending, reading = b"", True
    while reading or children:
        if reading and select.select([0], [], [], REAP_S)[0]:
            chunk = os.read(0, 65536)
            reading, pending = bool(chunk), pending + chunk
            if len(pending) > MAX_REQUEST and b"\n" not in pending:
                pending = b""  # no request is this long; what follows its end is refused as malformed
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                _fork(line, children)
        elif not reading:
            time.sleep(REAP_S)
        _reap(children)


if __name__ == "__main__":
    serve()
