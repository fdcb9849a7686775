"""``tools.quiet``, which ``make test`` runs its first phase through: nothing the command started outlives it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from waiting import wait_for

from tools import quiet

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def run_quiet(tmp_path: Path, script: str, *options: str, bound_s: float = 120) -> subprocess.CompletedProcess[str]:
    """``script`` under ``tools.quiet``; ``subprocess.TimeoutExpired`` if it has not ended within ``bound_s``."""
    return subprocess.run(
        [sys.executable, "-m", "tools.quiet", "--quiet-timeout", "0", *options, "--", sys.executable, "-c", script],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=bound_s,
    )


# A detached grandchild, as a daemon or a fixture's server that was never stopped: its own session, its parent gone.
DETACHED = """
import subprocess, sys
p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True)
open({pid_file!r}, 'w').write(str(p.pid))
sys.exit({status})
"""


@pytest.mark.parametrize("status", [0, 3])
def test_a_detached_leftover_is_named_and_ended_and_the_status_kept(tmp_path: Path, status: int) -> None:
    pid_file = tmp_path / "pid"
    # Bounded well below the sleeper's ten minutes: the grace, then SIGTERM ends it.
    done = run_quiet(tmp_path, DETACHED.format(pid_file=str(pid_file), status=status), "--grace", "1", bound_s=60)
    pid = int(pid_file.read_text())
    assert done.returncode == status, done.stderr
    assert "1 process(es) outlived the command" in done.stderr and f"{pid} " in done.stderr, done.stderr
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_leftover_that_ends_within_its_grace_is_not_signalled(tmp_path: Path) -> None:
    script = (
        "import subprocess, sys;"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(1); print(\"ended by itself\")'],"
        " start_new_session=True)"
    )
    done = run_quiet(tmp_path, script, "--grace", "30")
    assert done.returncode == 0, done.stderr
    assert "ended by itself" in done.stdout  # it ran to its end: no SIGTERM cut it short


# A child in a group of its own whose parent (a middle process) is gone, so it is an orphan; the command then waits
# for the group to empty, as the launcher's cancel test does. Unreaped, the orphan would stay a zombie in it.
ORPHAN = """
import os, subprocess, sys, time
middle = subprocess.Popen([sys.executable, '-c', 'import subprocess, sys; p = subprocess.Popen([sys.executable,'
                           ' "-c", "import time; time.sleep(1)"], start_new_session=True); print(p.pid)'],
                          stdout=subprocess.PIPE, text=True)
group = int(middle.communicate()[0])
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        sys.exit(0)
    time.sleep(0.05)
sys.exit(4)
"""


def test_an_orphan_that_ends_is_reaped_while_the_command_runs(tmp_path: Path) -> None:
    done = run_quiet(tmp_path, ORPHAN)
    assert done.returncode == 0, done.stderr  # 4: its group never emptied (a zombie of ours stayed in it)


def test_a_command_that_leaves_nothing_says_nothing(tmp_path: Path) -> None:
    done = run_quiet(tmp_path, "print('hi')")
    assert done.returncode == 0 and "outlived" not in done.stderr, done.stderr


def test_the_busy_fraction_sees_a_busy_core() -> None:
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 60\nwhile time.time() < end: pass"]
    )
    try:
        # one spinning core of this machine's cores, give or take what else runs (and once it has started)
        wait_for(lambda: quiet.busy_fraction(1.0) >= 0.6 / psutil.cpu_count(), 30, "a spinning core to look busy")
    finally:
        spinner.kill()
        spinner.wait()
