"""Local elastic nodes forked from a zygote that imported torch once: real forks, real exit codes.

The zygote is started as the launcher starts it; each test forks real nodes of
the reference workload from it and checks what a launcher relies on: the
node's own environment and log, its exit code (a signal as a negative code),
a session of its own, and none of the task process's secrets in the fork.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from waiting import wait_for

from trainyard.backends.local.zygote_client import Zygote, usable
from trainyard.protocol import coordstore
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.sealing import new_secret
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery import storehost

pytestmark = pytest.mark.integration

ARGV = ["-m", "trainyard.workload", "--seq-len", "16", "--d-model", "16", "--n-layers", "1", "--n-heads", "2"]


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    os.environ["TRAINYARD_TEST_SECRET"] = "s3cr3t-of-the-task-process"  # the launcher's environment, not the zygote's
    try:
        shared = {"PATH": os.environ["PATH"], "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
        if "PYTHONPATH" in os.environ:  # the launcher passes it on too (backends.local.environ)
            shared["PYTHONPATH"] = os.environ["PYTHONPATH"]
        z = Zygote(shared)
    finally:
        del os.environ["TRAINYARD_TEST_SECRET"]
    yield z
    z.close()
    z.proc.wait(timeout=30)


def test_a_forked_node_runs_with_its_own_environment_log_and_exit_code(zygote: Zygote, tmp_path: Path) -> None:
    log = tmp_path / "node-0.log"
    # No TRAINYARD_DATA_DIR: the workload refuses to start, in one line, with exit code 2 (trainyard.workload's).
    node = zygote.spawn(ARGV, {"PATH": os.environ["PATH"], "TRAINYARD_NODE": "node-0"}, log)
    assert node.wait(timeout=60) == 2
    text = log.read_text()
    assert "trainyard.workload:" in text and "TRAINYARD_DATA_DIR" in text, text


def test_a_killed_node_reports_the_signal_and_lives_in_a_session_of_its_own(zygote: Zygote, tmp_path: Path) -> None:
    store, port = storehost.serve()  # no generation lists node-7: it waits as a spare
    keys = coordstore.node_keys(new_secret(), ["node-0", "node-7"])
    env = {
        "PATH": os.environ["PATH"],
        "OMP_NUM_THREADS": "1",
        "TRAINYARD_STORE": f"127.0.0.1:{port}",
        "TRAINYARD_NODE": "node-7",
        "TRAINYARD_STORE_KEY": keys["node-7"],
        "TRAINYARD_DATA_DIR": str(tmp_path / "data"),
        "TRAINYARD_CHECKPOINT_DIR": str(tmp_path / "ckpt"),
        "TRAINYARD_MAX_STEPS": "4",
        "TRAINYARD_GLOBAL_BATCH": "2",
    }
    write_synthetic_corpus(tmp_path / "data", shards=1, tokens_per_shard=1024)
    attempt = storehost.attempt_store(store, 1)
    coord = Coordinator(attempt, keys)
    coord.publish(coordstore.Generation(1, ["node-0"], micro_batch=2))  # not node-7
    node = zygote.spawn(ARGV, env, tmp_path / "node-7.log")

    def announced() -> bool:  # the node imported nothing: it connects, builds the model and announces itself
        assert node.poll() is None, (tmp_path / "node-7.log").read_text()
        return coord.spare_ready("node-7")

    # It announces itself as node-7: it runs with its node's environment, not the zygote's.
    wait_for(announced, 60, "node-7's spare announcement", every_s=0.1, context=(tmp_path / "node-7.log").read_text)
    # /proc/PID/environ shows the fork's original environment block: the zygote's, never the task's.
    environ = Path(f"/proc/{node.pid}/environ").read_bytes()
    assert b"TRAINYARD_TEST_SECRET" not in environ and keys["node-7"].encode() not in environ  # nor its store key
    assert os.getsid(node.pid) == node.pid  # its own session: the launcher ends it with its whole tree
    os.kill(node.pid, signal.SIGKILL)
    assert node.wait(timeout=30) == -signal.SIGKILL


def test_a_script_is_forked_only_from_a_zygote_that_imported_its_framework() -> None:
    assert usable(["-m", "trainyard.workload", "--d-model", "16"])
    assert usable(["-m", "torch.distributed.run", "--nnodes=2", "train.py"])  # torch's code, whatever its worker
    assert not usable(["train.py", "--d-model", "16"])  # training.framework: none
    assert not usable(["-m", "my_company.train"])
    assert usable(["train.py", "--d-model", "16"], scripts=True)
    assert usable(["-m", "my_company.train"], scripts=True)
    assert not usable(["-m"], scripts=True) and not usable(["./run.sh"], scripts=True)
