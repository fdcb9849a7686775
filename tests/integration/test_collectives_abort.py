"""A real two-process gloo generation loses a peer: the survivor's collective fails as a failed collective,
``collectives.abort`` tears the broken group down, and a second abort finds nothing left.

The test process hosts the store; both ranks are plain processes formed through ``collectives.form``
exactly as ``Membership.form`` forms a generation. The peer dies (``os._exit``) right after the group forms.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.integration

RANK = r"""
import json, os, sys
from datetime import timedelta
import torch
import torch.distributed as dist
from trainyard.runtime import collectives, device

rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=60))
plan = collectives.form(dist.PrefixStore("g1/pg", store), rank, 2, 300.0, device.current({"LOCAL_RANK": "0"}))
dist.barrier()
if rank == 1:
    os._exit(9)  # the peer dies between two collectives, as a killed node does
result = {"backend": plan.backend}
try:
    for _ in range(100):  # its first all-reduce may still meet the peer's open socket; a later one cannot
        dist.all_reduce(torch.ones(1))
    result["failed"] = False
except Exception as exc:
    result.update(failed=True, error=f"{type(exc).__name__}: {exc}"[:300],
                  collective=collectives.is_collective_error(exc))
result["abort"] = collectives.abort(plan.backend)
result["initialized_after"] = dist.is_initialized()
result["again"] = collectives.abort(plan.backend)
print(json.dumps(result), flush=True)
"""


def test_a_gloo_survivor_fails_fast_and_its_group_is_torn_down_once() -> None:
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=60))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(rank), str(store.port)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in (0, 1)
    ]
    try:
        out, err = procs[0].communicate(timeout=120)  # waiting out the collective timeout (300 s) fails here
        assert procs[1].wait(timeout=60) == 9
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert procs[0].returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["backend"] == "gloo"
    assert result["failed"] is True, result
    assert result["collective"] is True, result["error"]
    assert result["abort"] == "destroyed"
    assert result["initialized_after"] is False
    assert result["again"] == "gone"
