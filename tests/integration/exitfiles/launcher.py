"""The launcher: one torchrun agent per node, as the local backend starts it, under a shell that writes the
agent's exit code to ``<attempt>/exits/<node>.exit`` when it ends; the node's pid goes beside it. Everything is
found again from the plan, so another process attaches (``reattaches``), and the trigger reads the same files
(``attempt_status``)."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from trainyard.atomic import open_append, read_capped, write_text_atomic
from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.backends.local.launcher import free_port, node_env, process_tree, signal_all, torchrun_argv

# The shell leaves the agent's code under a temporary name and renames it: a reader sees all of it or nothing.
WRAPPER = '"$@"; code=$?; echo $code > "$0.tmp"; mv "$0.tmp" "$0"'


@dataclass(frozen=True)
class ExitFileHandle:
    plan: LaunchPlan

    @property
    def folder(self) -> Path:
        return self.plan.log_dir / "exits"


def attempt_status(folder: Path, nodes: list[str]) -> AttemptStatus:
    """Each node's state from its exit file (running without one, unless its process is gone: then failed)."""
    return AttemptStatus([node_status(folder, node) for node in nodes])


def node_status(folder: Path, node: str) -> NodeStatus:
    log = str(folder.parent / f"{node}.log")
    code = _read_int(folder / f"{node}.exit")
    if code is None and not _alive(_read_int(folder / f"{node}.pid")):
        code = _read_int(folder / f"{node}.exit")  # it may have ended between the two reads
        if code is None:
            return NodeStatus(node, "failed", None, log, reason="gone without an exit code", host=node)
    if code is None:
        return NodeStatus(node, "running", None, log, host=node)
    return NodeStatus(node, "succeeded" if code == 0 else "failed", code, log, host=node)


def _read_int(path: Path) -> int | None:
    try:
        return int(read_capped(path, 32))
    except (OSError, ValueError):  # not there yet, or not ours to believe: no code
        return None


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class ExitFileLauncher:
    reattaches = True

    def __init__(self, poll_s: float) -> None:
        self.poll_s = poll_s
        self.active: list[ExitFileHandle] = []

    def launch(self, plan: LaunchPlan) -> ExitFileHandle:
        handle = ExitFileHandle(plan)
        handle.folder.mkdir(parents=True, exist_ok=True)
        port = free_port()
        for index, node in enumerate(plan.nodes):
            argv = ["sh", "-c", WRAPPER, str(handle.folder / f"{node}.exit"), *torchrun_argv(plan, port, index)]
            with open_append(plan.log_dir / f"{node}.log") as out:
                proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=node_env(plan, node), start_new_session=True)  # fmt: skip
            write_text_atomic(handle.folder / f"{node}.pid", str(proc.pid))
        self.active.append(handle)
        return handle

    def describe(self, handle: ExitFileHandle) -> dict[str, Any]:
        """All the trigger needs: where the exit files lie, and how often to look."""
        return {"folder": str(handle.folder), "poll_s": self.poll_s}

    def attach(self, plan: LaunchPlan) -> ExitFileHandle:
        handle = ExitFileHandle(plan)
        self.active.append(handle)
        return handle

    def poll(self, handle: ExitFileHandle) -> AttemptStatus:
        status = attempt_status(handle.folder, handle.plan.nodes)
        for node in [n.slot for n in status.nodes if n.state != "running"]:
            _reap(_read_int(handle.folder / f"{node}.pid"))
        return status

    def cancel(self, handle: ExitFileHandle, grace_s: float | None = None) -> None:
        pids = [_read_int(handle.folder / f"{node}.pid") for node in handle.plan.nodes]
        tree = [p for pid in pids if pid is not None for p in process_tree(pid)]
        signal_all(tree, signal.SIGTERM)
        signal_all(tree, signal.SIGCONT)
        _, alive = psutil.wait_procs(tree, timeout=5 if grace_s is None else grace_s)
        signal_all(alive, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=5)
        for pid in pids:
            _reap(pid)
        if handle in self.active:
            self.active.remove(handle)

    def exclude(self, nodes: list[str]) -> list[str]:
        return []

    def cancel_all(self) -> None:
        for handle in list(self.active):
            self.cancel(handle)


def _reap(pid: int | None) -> None:
    """Collect an ended shell this process started (another process's is not ours to wait for)."""
    if pid is None:
        return
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass
