"""Failure records: what a dying rank says about itself, read defensively and trusted first by classify."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainyard.backends.base import AttemptStatus, LaunchPlan, NodeStatus
from trainyard.backends.local.launcher import node_env
from trainyard.errors import CheckpointInvalid, DataError, SpecError, TrainingFailed
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.records import (
    MAX_BYTES,
    MAX_MESSAGE,
    FailureRecord,
    failure_records,
    reading,
    record_name,
    write_record,
)
from trainyard.recovery.classify import Failure, NodeFailure, classify
from trainyard.recovery.watch import failed, host_records
from trainyard.runtime import failures as runtime

NODES = ["node-0", "node-1"]


def _chained(cause: BaseException, then: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException:
            raise then  # noqa: B904 - the implicit context is the point
    except BaseException as exc:
        return exc


# Real messages of torch 2.x, gloo, NCCL and CUDA, and of trainyard's own workload and drills.
READINGS = [
    (MemoryError("drill: out of memory at step 3 on node-1"), "oom"),
    (
        torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.15 GiB of which 1.19 GiB is free."
        ),
        "oom",
    ),
    (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 15.78 GiB total capacity)"), "oom"),
    (TrainingFailed("loss is nan at step 5", kind="diverged"), "diverged"),
    (FloatingPointError("non-finite loss at step 7"), "diverged"),
    (DataError("shards use vocab_size 512 but the model has --vocab-size 256"), "data_error"),
    (SpecError(["global_batch 10 is not a multiple of micro_batch 4 x 2 ranks"]), "user_error"),
    (CheckpointInvalid("TRAINYARD_RESUME_FROM=/ck/step_000010: __1_0.distcp: size mismatch"), "user_error"),
    (
        RuntimeError(
            "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:33529"
        ),
        "transient",
    ),
    (
        RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting "
            "1800000ms for recv operation to complete"
        ),
        "transient",
    ),
    (
        dist.DistBackendError(
            "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, remote "
            "process exited or there was a network error"
        ),
        "transient",
    ),
    (dist.DistNetworkError("failed to recv, got 0 bytes"), "transient"),
    (_chained(ConnectionResetError(104, "Connection reset by peer"), KeyError("optim")), "transient"),
    (RuntimeError("CUDA error: uncorrectable ECC error encountered"), "node_lost"),
    (RuntimeError("drill: exception in user code at step 3 on node-1"), "user_error"),
    (ZeroDivisionError("division by zero"), "user_error"),
]


@pytest.mark.parametrize(("exc", "kind"), READINGS, ids=[f"{type(e).__name__}-{k}" for e, k in READINGS])
def test_the_runtime_reads_its_own_exception(exc: BaseException, kind: str) -> None:
    assert reading(exc) == kind


def _write(folder: Path, file_rank: int, **fields: object) -> Path:
    """A record as a rank of node-1 writes it, into its node's folder ``folder`` (``<attempt hb>/node-1``)."""
    record = {"kind": "oom", "rank": file_rank, "node": "node-1", "host": "gpu-7", "type": "MemoryError",
              "message": "out of memory", "time": 100.0 + file_rank, **fields}  # fmt: skip
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / record_name(file_rank)
    path.write_text(json.dumps(record))
    return path


def test_records_are_read_earliest_first(tmp_path: Path) -> None:
    _write(tmp_path / "node-0", 3, time=50.0, node="node-0", kind="transient")
    _write(tmp_path / "node-1", 1, message="x" * 5000)
    (tmp_path / "node-1" / "rank-1.json").write_text("{}")  # a heartbeat, not a record
    got = failure_records(tmp_path, NODES)
    assert [(r.rank, r.kind) for r in got] == [(3, "transient"), (1, "oom")]
    assert got[1] == FailureRecord("oom", 1, "node-1", "gpu-7", "MemoryError", "x" * MAX_MESSAGE, 101.0)
    assert failure_records(tmp_path / "missing", NODES) == []


@pytest.mark.parametrize(
    ("plant", "says"),
    [
        (lambda p: p.write_text("{not json"), "Expecting property name"),
        (lambda p: p.write_bytes(b" " * (MAX_BYTES + 1)), f"larger than {MAX_BYTES} bytes"),
        (lambda p: p.write_text("[1]"), "not a JSON object"),
        (lambda p: _write(p.parent, 2, kind="meteor"), "kind 'meteor' is not one of"),
        (lambda p: _write(p.parent, 2, rank=0), "is not the file's rank 2"),
        (lambda p: _write(p.parent, 2, time="now"), "time is not a number"),
        (lambda p: _write(p.parent, 2, time=10**400), "time is not a number"),  # not an OverflowError
        (lambda p: _write(p.parent, 2, message=["a"]), "message is not a string"),
        (lambda p: _write(p.parent, 2, node="node-0"), "names node 'node-0' but lies in node-1's folder"),
        (lambda p: p.symlink_to(_write(p.parent, 4)), "is a symbolic link"),
        (lambda p: os.mkfifo(p), "not a regular file"),  # and the reader does not wait on it
        (lambda p: p.write_text("[" * 3000), "nested deeper than the parser's recursion allows"),
    ],
)
def test_a_bad_record_is_skipped_with_a_warning(
    tmp_path: Path, plant: object, says: str, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "node-1" / record_name(2)
    path.parent.mkdir()
    plant(path)  # type: ignore[operator]
    got = failure_records(tmp_path, NODES)
    assert all(r.rank != 2 for r in got)
    assert says in caplog.text


def test_a_nested_record_is_evidence_for_host_records_not_a_crash(tmp_path: Path) -> None:
    """3 KB of brackets in one rank's record: once a RecursionError out of the supervisor's read of the records."""
    _write(tmp_path / "node-0", 0, node="node-0", kind="transient")
    (tmp_path / "node-1").mkdir()
    (tmp_path / "node-1" / record_name(1)).write_text("[" * 3000)
    status = AttemptStatus([NodeStatus(n, "failed", host=n) for n in NODES])
    refused: list[str] = []
    got = host_records(tmp_path, status, refused)
    assert [(r.rank, r.node) for r in got] == [(0, "node-0")]
    assert refused == [
        f"node-1/{record_name(1)} refused (failure record is not JSON (nested deeper than the parser's recursion allows))"
    ]


def _failure(records: list[FailureRecord], *nodes: NodeFailure) -> Failure:
    return Failure(attempt=1, trigger="crash", nodes=list(nodes), last_step=12, records=records)


PEER_GONE = (
    "[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
    "[127.0.0.1]:33529"
)


def test_classify_trusts_a_root_cause_record_before_the_logs() -> None:
    oom = FailureRecord("oom", 1, "node-1", "gpu-7", "MemoryError", "drill: out of memory at step 3 on node-1", 2.0)
    peer = FailureRecord("transient", 0, "node-0", "gpu-3", "RuntimeError", PEER_GONE, 2.5)
    found = classify(
        _failure(
            [oom, peer],
            NodeFailure("node-0", "failed", 1, "", PEER_GONE),
            NodeFailure("node-1", "failed", 1, "", "ChildFailedError: trainyard.workload FAILED"),
        )
    )
    assert (found.kind, found.culprits) == ("oom", ["node-1"])
    assert found.evidence == "node-1 rank 1: MemoryError: drill: out of memory at step 3 on node-1 (its failure record)"


def test_a_transient_record_is_a_symptom_and_the_lost_peer_is_still_found() -> None:
    peer = FailureRecord("transient", 0, "node-0", "node-0", "RuntimeError", PEER_GONE, 2.5)
    found = classify(
        _failure([peer], NodeFailure("node-0", "failed", 1, "", PEER_GONE), NodeFailure("node-1", "failed", -9))
    )
    assert (found.kind, found.culprits) == ("node_lost", ["node-1"])


def test_a_record_naming_a_node_outside_the_attempt_is_ignored() -> None:
    forged = FailureRecord("oom", 0, "node-7", "node-7", "MemoryError", "out of memory", 1.0)
    found = classify(_failure([forged], NodeFailure("node-0", "failed", -9)))
    assert (found.kind, found.culprits) == ("node_lost", ["node-0"])


def test_a_diverged_record_gives_the_step_and_blames_no_node() -> None:
    nan = FailureRecord("diverged", 0, "node-0", "node-0", "TrainingFailed", "loss is nan at step 17", 1.0)
    found = classify(_failure([nan], NodeFailure("node-0", "failed", 1)))
    assert (found.kind, found.culprits, found.step) == ("diverged", [], 17)


def test_record_failure_writes_once_and_never_raises(tmp_path: Path) -> None:
    ctx = TrainEnv(tmp_path, tmp_path, 5, heartbeat_dir=tmp_path / "hb" / "node-1", node="node-1", host="gpu-7")
    saved = runtime._recorded
    try:
        runtime._recorded = False
        path = runtime.record_failure(DataError("shard 3 is empty"), ctx)
        assert path == tmp_path / "hb" / "node-1" / "failure-rank-0.json"
        assert runtime.record_failure(MemoryError("later"), ctx) is None  # the first failure is the one
        [record] = failure_records(tmp_path / "hb", ["node-1"])
        assert (record.kind, record.host, record.type, record.message) == ("data_error", "gpu-7", "DataError",
                                                                           "shard 3 is empty")  # fmt: skip
        runtime._recorded = False
        blocked = TrainEnv(tmp_path, tmp_path, 5, heartbeat_dir=path / "not-a-folder")
        assert runtime.record_failure(RuntimeError("x"), blocked) is None
    finally:
        runtime._recorded = saved


def test_a_script_using_the_runtime_leaves_a_record_when_an_exception_escapes(tmp_path: Path) -> None:
    script = textwrap.dedent("""
        from trainyard import runtime
        ctx = runtime.context()
        raise ValueError("bad shape in user code")
    """)
    env = {**os.environ, "TRAINYARD_DATA_DIR": str(tmp_path), "TRAINYARD_CHECKPOINT_DIR": str(tmp_path),
           "TRAINYARD_MAX_STEPS": "3", "TRAINYARD_HEARTBEAT_DIR": str(tmp_path / "hb" / "node-0"),
           "TRAINYARD_NODE": "node-0",
           "RANK": "0"}  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "ValueError: bad shape in user code" in result.stderr  # the traceback as ever
    [record] = failure_records(tmp_path / "hb", ["node-0"])
    assert asdict(record) | {"time": 0, "host": ""} == {
        "kind": "user_error", "rank": 0, "node": "node-0", "host": "", "type": "ValueError",
        "message": "bad shape in user code", "time": 0,
    }  # fmt: skip


def _local_attempt(tmp_path: Path) -> tuple[LaunchPlan, AttemptStatus]:
    plan = LaunchPlan("r", 1, NODES, 4, "trainyard.workload", [],
                      TrainEnv(tmp_path, tmp_path, 5, heartbeat_dir=tmp_path / "hb"), tmp_path)  # fmt: skip
    status = AttemptStatus([NodeStatus("node-0", "failed", 1, host="node-0"), NodeStatus("node-1", "running",
                                                                                          host="node-1")])  # fmt: skip
    return plan, status


def test_a_rank_cannot_blame_another_node_with_its_record(tmp_path: Path) -> None:
    """A rank of node-0 writes ``failure-rank-7.json`` naming node-1, where the launcher tells node-0's processes
    to write: the record is refused (and is evidence), classify blames no one for it; node-1 is not excluded."""
    plan, status = _local_attempt(tmp_path)
    node0 = Path(node_env(plan, "node-0", {})["TRAINYARD_HEARTBEAT_DIR"])
    forged = FailureRecord("node_lost", 7, "node-1", "node-1", "RuntimeError", "uncorrectable ECC error", 1.0)
    write_record(node0, forged)
    seen = failed(plan, status, plan.heartbeat_dir, "crash", [], "node-0 exited 1", at=2.0)
    assert seen.failure.records == [] and "node-1" not in classify(seen.failure).culprits
    assert "node-0/failure-rank-7.json refused (names node 'node-1'" in seen.reason


def test_an_honest_record_still_blames_its_own_node(tmp_path: Path) -> None:
    plan, status = _local_attempt(tmp_path)
    node0 = Path(node_env(plan, "node-0", {})["TRAINYARD_HEARTBEAT_DIR"])
    write_record(node0, FailureRecord("oom", 1, "node-0", "node-0", "MemoryError", "out of memory", 1.0))
    seen = failed(plan, status, plan.heartbeat_dir, "crash", [], "node-0 exited 1", at=2.0)
    assert [r.node for r in seen.failure.records] == ["node-0"] and seen.reason == "node-0 exited 1"
    assert (classify(seen.failure).kind, classify(seen.failure).culprits) == ("oom", ["node-0"])
