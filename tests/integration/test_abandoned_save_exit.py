"""A script that ends normally after a regroup abandoned a save in flight exits 0, not by SIGABRT.

The save's daemon thread is blocked in a collective of the buried group; its peer's exit (the survivors finish
together) fails that collective while the interpreter finalizes, and a thread returning then aborts the
process ("terminate called without an active exception"). ``runtime.checkpoints.outlive`` (which
``Checkpointer.abandon`` calls) waits for it at ``atexit`` instead. Real processes and a real gloo group;
the peer exits at several moments of the survivor's exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from trainyard.backends.local.launcher import free_port

pytestmark = pytest.mark.integration

SCRIPT = textwrap.dedent(
    """
    import datetime, os, sys, threading, time
    import torch, torch.distributed as dist
    from trainyard.runtime.checkpoints import outlive
    rank, delay = int(os.environ["RANK"]), float(sys.argv[1])
    store = dist.TCPStore("127.0.0.1", int(os.environ["PORT"]), 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    saves = dist.new_group(backend="gloo")
    dist.barrier()
    if rank == 0:  # a peer that never joins the save and exits just after the survivor began to
        time.sleep(1.0 + delay)
        os._exit(0)
    blocked = threading.Thread(target=lambda: dist.all_reduce(torch.ones(4), group=saves), daemon=True)
    blocked.start()
    graveyard = [saves]  # as a regroup buries it: destroying it would wait for the thread
    dist.destroy_process_group()
    outlive(blocked)
    time.sleep(1.0)  # then the script ends, normally
    """
)


@pytest.mark.parametrize("delay", [0.05, 0.2])
def test_a_survivor_with_a_save_blocked_on_a_peer_exits_cleanly(tmp_path: Path, delay: float) -> None:
    script = tmp_path / "survivor.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PORT": str(free_port()), "GLOO_SOCKET_IFNAME": "lo"}
    peer = subprocess.Popen([sys.executable, str(script), str(delay)], env={**env, "RANK": "0"})
    survivor = subprocess.run([sys.executable, str(script), str(delay)], env={**env, "RANK": "1"},
                              capture_output=True, text=True, timeout=120)  # fmt: skip
    peer.wait(timeout=60)
    assert "terminate called" not in survivor.stderr, survivor.stderr
    assert survivor.returncode == 0, survivor.stderr
