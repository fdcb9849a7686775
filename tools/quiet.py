"""Run a command, then leave the machine quiet: ``make test`` runs its first phase through this.

The tests marked ``alone`` judge the machine's speed (the pressure test's verdicts, the hang detector's
timing). CI on a correct main once failed four of them at once right after the first phase, and passed
them a minute later: what the first phase leaves behind (training processes still exiting, a server a
fixture stopped late, the disk writing back gigabytes of checkpoints) shares the two cores with the
measurement. So this runs the command as a *child subreaper* (``PR_SET_CHILD_SUBREAPER``): every process
the command starts, however it detaches (a daemon's double fork, ``setsid``), stays our descendant when
its parent dies instead of going to init. When the command ends:

1. its leftovers get ``--grace`` seconds to end by themselves, then SIGTERM, then SIGKILL (each wait
   bounded); each is named, since a leftover is a leak some test should fix;
2. the disk's dirty pages are written back (``sync``, bounded);
3. the machine must be idle: at most ``--busy`` of its CPU time used by anything over ``--settle``
   seconds in a row, waited for at most ``--quiet-timeout`` seconds (then it says so and goes on: a
   busy machine is reported, not a failure of the command).

``python -m tools.quiet [options] -- COMMAND...``: exits with the command's status.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import subprocess
import sys
import time

import psutil

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Whether orphans of our descendants now come to us (Linux only; elsewhere they go to init as before)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _describe(process: psutil.Process) -> str:
    try:
        what = f"{process.pid} {' '.join(process.cmdline())[:160] or process.name()}"
    except psutil.Error:
        return f"{process.pid} (gone)"
    try:  # the test that started it, when pytest's variable was in the environment it was given
        started_by = process.environ().get("PYTEST_CURRENT_TEST")
    except psutil.Error:
        started_by = None
    return f"{what} (started during {started_by})" if started_by else what


def _reap_zombies() -> None:
    """Collect ended children (orphans reparented to us become our zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_reaping(command: list[str]) -> int:
    """Run ``command`` to its end, reaping every orphan that comes to us meanwhile, as init would: an orphan
    left a zombie stays in its process group, and a test that waits for a group to empty would wait forever."""
    proc = subprocess.Popen(command)
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # cannot happen while proc is ours; said rather than spun on
            return proc.wait()
        if pid == proc.pid:
            proc.returncode = os.waitstatus_to_exitcode(status)
            return proc.returncode


def _alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    _reap_zombies()
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except psutil.Error:
            pass
    return alive


def _wait_gone(processes: list[psutil.Process], seconds: float) -> list[psutil.Process]:
    deadline = time.monotonic() + seconds
    left = _alive(processes)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = _alive(left)
    return left


def end_leftovers(grace_s: float, say) -> int:
    """End every descendant still running; how many there were."""
    _reap_zombies()  # orphans that ended on their own came to us as zombies: not leftovers
    leftovers = _alive(psutil.Process().children(recursive=True))
    if not leftovers:
        return 0
    say(f"{len(leftovers)} process(es) outlived the command: " + "; ".join(_describe(p) for p in leftovers))
    began = time.monotonic()
    left = _wait_gone(leftovers, grace_s)
    # Which ended by themselves says whether it was a late exit (a server noticing its pipe closed) or a leak.
    if len(left) < len(leftovers):
        say(f"{len(leftovers) - len(left)} of them ended by themselves within {time.monotonic() - began:.1f} s")
    if left:
        say(f"{len(left)} still running after the {grace_s:g} s grace: ending them")
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for process in left:
            try:
                process.send_signal(sig)
            except psutil.Error:
                pass
        left = _wait_gone(left, 10)
        if not left:
            break
    for process in left:  # unkillable (uninterruptible I/O): said, not waited for forever
        say(f"still running after SIGKILL: {_describe(process)}")
    return len(leftovers)


def busy_fraction(seconds: float) -> float:
    """The fraction of the machine's CPU time spent busy (by anyone) over ``seconds``."""
    before = psutil.cpu_times()
    time.sleep(seconds)
    after = psutil.cpu_times()
    idle = (after.idle + getattr(after, "iowait", 0.0)) - (before.idle + getattr(before, "iowait", 0.0))
    total = sum(after) - sum(before)
    return 1.0 - idle / total if total > 0 else 0.0


def wait_quiet(busy: float, settle_s: float, timeout_s: float, say) -> bool:
    """Wait until the machine was at most ``busy`` busy for ``settle_s`` seconds in a row, at most ``timeout_s``."""
    started = time.monotonic()
    quiet_since: float | None = None
    last = 0.0
    while time.monotonic() - started < timeout_s:
        last = busy_fraction(1.0)
        now = time.monotonic()
        quiet_since = (quiet_since or now - 1.0) if last <= busy else None
        if quiet_since is not None and now - quiet_since >= settle_s:
            say(f"machine quiet after {now - started:.0f} s (busy {last:.0%})")
            return True
    say(f"machine still busy ({last:.0%}) after {timeout_s:.0f} s; going on: the next tests share it")
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quiet", description=__doc__.split("\n\n")[0])
    parser.add_argument("--grace", type=float, default=30, help="seconds a leftover process has to end by itself")
    parser.add_argument("--busy", type=float, default=0.25, help="the busiest the machine may be to count as quiet")
    parser.add_argument("--settle", type=float, default=3, help="seconds in a row it must be quiet")
    parser.add_argument("--quiet-timeout", type=float, default=90, help="the longest wait for quiet")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given")

    def say(text: str) -> None:
        print(f"tools.quiet: {text}", file=sys.stderr, flush=True)

    if not become_subreaper():
        say("not a subreaper here (not Linux?): leftovers that detached are not seen")
    # A Ctrl-C reaches the command from the terminal as it would without us: we only wait for it to end. (A
    # handler, not SIG_IGN, which the command would inherit.)
    signal.signal(signal.SIGINT, lambda *_: None)
    status = run_reaping(command)
    end_leftovers(args.grace, say)
    if status in (-signal.SIGINT, 2):  # interrupted (pytest's 2): nothing comes next to be quiet for
        return status
    try:
        subprocess.run(["sync"], timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired):
        say("sync did not finish within 120 s")
    wait_quiet(args.busy, args.settle, args.quiet_timeout, say)
    return status


if __name__ == "__main__":
    sys.exit(main())
