"""A user's script on the relaunch path is forked warm: real torchrun agents, real forks, real exit codes.

The local launcher starts 1 node (a torchrun agent forked from the zygote) running a small plain script with
``training.framework: hf``. What a new interpreter would give the script must hold in the fork (argv,
``sys.path[0]``, ``__main__``, the working folder, the environment), and so must how it ends (a
``SystemExit`` code, an uncaught exception's traceback and exit 1); what shows it IS a fork of the agent's fork
server: its parent is not the agent but a child of the agent, and transformers was imported before the
script's first line. With ``framework: none``, or a framework whose import starts a thread (said once), the same
script is torchrun's new interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from waiting import wait_for

from trainyard.backends.base import LaunchPlan
from trainyard.backends.local.launcher import LocalLauncher, free_port, torchrun_argv
from trainyard.backends.local.zygote_client import Zygote
from trainyard.protocol.env import TrainEnv

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    preloaded = "transformers" in sys.modules  # before this script imports anything of its own
    import helper  # beside the script: found through sys.path[0], as python script.py finds it
    with open(f"/proc/{os.getppid()}/stat") as stat:
        gppid = int(stat.read().rsplit(")", 1)[1].split()[1])
    with open(os.path.join(sys.argv[2], "rank-" + os.environ["RANK"] + ".json"), "w") as out:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), "gppid": gppid, "preloaded": preloaded, "argv": sys.argv,
                   "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__, "file": __file__,
                   "helper": helper.WHERE, "node": os.environ.get("TRAINYARD_NODE")}, out)
    mode = sys.argv[1]
    if mode == "wait":  # a node killed while it trains: a SIGTERM handler (a preemption notice) must not run
        import signal, time
        signal.signal(signal.SIGTERM, lambda *_: open(os.path.join(sys.argv[2], "sigterm"), "w").close())
        time.sleep(120)
    if mode == "exit":
        sys.exit(3)
    if mode == "raise":
        def deep():
            raise ValueError("the script's own error")
        deep()
    """
)


def plan(root: Path, mode: str, framework: str) -> LaunchPlan:
    (root / "out").mkdir(parents=True, exist_ok=True)
    return LaunchPlan(
        run_id=root.name,
        attempt=1,
        nodes=["node-0"],
        procs_per_node=2,
        entrypoint=str(root / "code" / "train.py"),
        framework=framework,
        args=[mode, str(root / "out")],
        log_dir=root / "attempt-1",
        train_env=TrainEnv(data_dir=root, checkpoint_dir=root / "ckpt", max_steps=1, heartbeat_dir=root / "hb"),
    )


def run(root: Path, mode: str, framework: str = "hf") -> tuple[int, str, list[dict], int]:
    """Launch, wait for the node's agent; its exit code, the node's log, what each rank wrote, the agent's pid."""
    code = root / "code"
    code.mkdir(parents=True, exist_ok=True)
    (code / "train.py").write_text(SCRIPT)
    (code / "helper.py").write_text("WHERE = __file__\n")
    launcher, p = LocalLauncher(), plan(root, mode, framework)
    handle = launcher.launch(p)
    try:
        agent = handle.procs["node-0"]
        ended = agent.wait(timeout=120)
    finally:
        launcher.cancel(handle)
        launcher.close()
    ranks = [json.loads(f.read_text()) for f in sorted((root / "out").glob("rank-*.json"))]
    return ended, (p.log_dir / "node-0.log").read_text(), ranks, agent.pid


def test_a_scripts_workers_are_forks_of_the_agents_fork_server_and_see_a_new_interpreter(tmp_path: Path) -> None:
    code, log, ranks, agent = run(tmp_path, "ok")
    assert code == 0, log
    assert len(ranks) == 2, log
    script = tmp_path / "code" / "train.py"
    for rank in ranks:
        assert rank["preloaded"], "transformers was not imported before the script: not a warm fork"
        # The worker's parent is the fork server, the agent's child; torchrun's own workers are the agent's children.
        assert rank["ppid"] != agent and rank["gppid"] == agent, "not a fork of the agent's fork server"
        assert rank["name"] == "__main__" and rank["file"] == str(script)
        assert rank["argv"] == [str(script), "ok", str(tmp_path / "out")]
        assert rank["path0"] == str(script.parent) and rank["helper"] == str(script.parent / "helper.py")
        assert rank["cwd"] == str(script.parent) and rank["node"] == "node-0"


def test_without_a_framework_the_workers_are_new_interpreters(tmp_path: Path) -> None:
    code, log, ranks, agent = run(tmp_path, "ok", framework="none")
    assert code == 0, log
    assert len(ranks) == 2 and not any(r["preloaded"] for r in ranks), ranks
    assert all(r["ppid"] == agent for r in ranks), ranks  # torchrun's own children


def test_a_scripts_exit_code_reaches_the_agent_as_a_new_interpreters_would(tmp_path: Path) -> None:
    code, log, ranks, _ = run(tmp_path, "exit")
    assert len(ranks) == 2 and all(r["preloaded"] for r in ranks), log
    assert code == 1, log  # torchrun's agent fails the node when a worker does
    assert "exitcode  : 3" in log, log  # torchrun's report of the worker's own code


def test_an_uncaught_exception_prints_the_scripts_traceback_and_exits_1(tmp_path: Path) -> None:
    code, log, ranks, _ = run(tmp_path, "raise")
    assert len(ranks) == 2 and all(r["preloaded"] for r in ranks), log
    assert code == 1 and "exitcode  : 1" in log, log
    assert "ValueError: the script's own error" in log, log
    traceback = log.split("Traceback (most recent call last):", 1)[1].split("ValueError")[0]
    # As python train.py prints it: the script's frames only, not the zygote's or runpy's.
    assert f'File "{tmp_path / "code" / "train.py"}", line' in traceback and "in deep" in traceback, traceback
    assert "zygote" not in traceback and "runpy" not in traceback, traceback


THREADED = """
import sys
import trainyard.preload as preload
preload.TABLE["hf"] = preload.Preload(("starts_a_thread",), reveals=())  # a framework that is not fork-safe
sys.argv = ["zygote", "--framework", "hf"]
from trainyard.backends.local.zygote import serve
serve()
"""


def test_a_framework_whose_import_starts_a_thread_leaves_the_workers_cold_and_says_why_once(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), daemon=True, name='pool').start()\n"
    )
    p = plan(tmp_path, "ok", "hf")
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "train.py").write_text(SCRIPT)
    (tmp_path / "code" / "helper.py").write_text("WHERE = __file__\n")
    env = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TRAINYARD_NODE": "node-0"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "lib"), os.environ.get("PYTHONPATH", "")])
    zygote = Zygote(env, argv=[sys.executable, "-c", THREADED])
    try:
        p.log_dir.mkdir(parents=True)
        agent = zygote.spawn(torchrun_argv(p, free_port(), 0)[1:], env, p.log_dir / "node-0.log", tmp_path / "code")
        assert agent.wait(timeout=120) == 0, (p.log_dir / "node-0.log").read_text()
    finally:
        zygote.close()
        zygote.proc.wait(timeout=30)
    ranks = [json.loads(f.read_text()) for f in sorted((tmp_path / "out").glob("rank-*.json"))]
    assert len(ranks) == 2 and all(r["ppid"] == agent.pid and not r["preloaded"] for r in ranks), ranks
    said = [line for line in capfd.readouterr().err.splitlines() if "trainyard zygote:" in line]
    assert len(said) == 1 and "importing starts_a_thread started 1 thread(s) (pool)" in said[0], said


def test_a_worker_dies_with_its_killed_node_and_runs_no_sigterm_handler(tmp_path: Path) -> None:
    """A drill's or a host's kill of the node's agent group (the fork server with it) ends its workers as it would
    a node: SIGKILL, never the SIGTERM a script reads as a preemption notice (torchrun's own workers get none)."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "train.py").write_text(SCRIPT)
    (code / "helper.py").write_text("WHERE = __file__\n")
    launcher, p = LocalLauncher(), plan(tmp_path, "wait", "hf")
    handle = launcher.launch(p)
    try:
        wait_for(lambda: len(list((tmp_path / "out").glob("rank-*.json"))) == 2, 120, "both ranks", every_s=0.1)
        ranks = [json.loads(f.read_text()) for f in (tmp_path / "out").glob("rank-*.json")]
        assert all(r["preloaded"] for r in ranks), ranks
        os.killpg(os.getpgid(handle.procs["node-0"].pid), signal.SIGKILL)  # as runtime.drills kills a node
        assert handle.procs["node-0"].wait(timeout=30) == -signal.SIGKILL
        wait_for(lambda: not any(psutil.pid_exists(r["pid"]) for r in ranks), 30, "the workers' end", every_s=0.1)
    finally:
        launcher.cancel(handle)
        launcher.close()
    assert not (tmp_path / "out" / "sigterm").exists()
