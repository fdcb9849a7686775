"""Start a test's ``python -m ...`` process as the local backend starts a node: a fork of its zygote.

The suite is bound by CPU on CI's two cores, and a process that imports torch, torchrun
and the reference workload spends ~8 s of CPU doing it before its first step. Where a
test starts what the zygote has imported (``zygote.usable``: the reference workload, or a
torchrun agent, whose workers of the reference workload are forks in turn), ``start``
forks it from one zygote per test process instead: the same command, environment and
process tree, a session of its own, its output in ``log``. Anything else is a new process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path

from trainyard.backends.local import zygote_client as zygote

Process = zygote.Forked | subprocess.Popen[bytes]
"""What ``start`` returns."""
_zygote: zygote.Zygote | None = None
_lock = threading.Lock()


def start(argv: list[str], env: Mapping[str, str], log: Path) -> Process:
    """Run ``argv`` (``sys.executable`` first) with exactly ``env``, in a session of its own, its output (stdout
    and stderr) written to ``log`` from its start. Popen's ``poll``, ``wait``, ``returncode`` and ``pid`` either way."""
    global _zygote
    log.write_bytes(b"")
    if argv[0] == sys.executable and zygote.usable(argv[1:]):
        with _lock:
            if _zygote is None or not _zygote.alive():
                _zygote = zygote.Zygote(os.environ)
            forks = _zygote
        try:
            return forks.spawn(argv[1:], env, log)
        except RuntimeError as exc:
            print(f"tests: {exc}; starting {argv[1:3]} as a new process", file=sys.stderr)
    with open(log, "ab") as out:
        return subprocess.Popen(argv, env=dict(env), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
