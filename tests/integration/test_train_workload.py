"""The reference workload under real torchrun: two local nodes on gloo, checkpoints, resume.

Each "node" is its own torchrun agent process (as the local launcher runs them)
joined by c10d rendezvous on 127.0.0.1. The model and corpus are tiny so the
whole module takes well under a minute and a half on two CPU cores.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import forks
import pytest

from trainyard.checkpoint import format as fmt
from trainyard.events.ledger import Ledger
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.protocol.records import failure_records
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.classify import Failure, NodeFailure, classify

pytestmark = pytest.mark.integration

GLOBAL_BATCH = 16
MICRO_BATCH = 4  # 2 ranks x 4 = 8 per pass: accumulation 2 on two nodes, 4 on one
MODEL_ARGS = ["--seq-len", "32", "--d-model", "32", "--n-heads", "2"]
RUN_TIMEOUT_S = 120


@dataclass
class Run:
    """Where one training run kept its files."""

    root: Path
    checkpoints: Path
    heartbeats: Path
    ledger: Path

    @classmethod
    def in_dir(cls, root: Path) -> Run:
        return cls(root, root / "ckpt", root / "hb", root / "events.jsonl")

    def losses(self) -> dict[int, float]:
        """Loss per step from the ledger's step events (a resumed run's later attempt wins)."""
        return {e["step"]: e["loss"] for e in Ledger(self.ledger).events("train", "step")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(data: Path, run: Run, node: int, **settings: object) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_", "TORCHELASTIC_"))}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",  # two ranks on two cores: no thread oversubscription
        TRAINYARD_DATA_DIR=str(data),
        TRAINYARD_CHECKPOINT_DIR=str(run.checkpoints),
        TRAINYARD_HEARTBEAT_DIR=str(run.heartbeats / f"node-{node}"),  # its own folder, as the launcher gives it
        TRAINYARD_EVENTS_DIR=str(Ledger(run.ledger).events_dir),
        TRAINYARD_RUN_ID=run.root.name,
        TRAINYARD_NODE=f"node-{node}",
        TRAINYARD_GLOBAL_BATCH=str(GLOBAL_BATCH),
        TRAINYARD_MICRO_BATCH=str(MICRO_BATCH),
        TRAINYARD_PROGRESS_EVERY_S="0",  # these tests compare losses step by step: a step event per step
    )
    env.update({f"TRAINYARD_{k.upper()}": str(v) for k, v in settings.items()})
    return env


def _torchrun_args(nodes: int, node: int, port: int, rdzv_id: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run",
        f"--nnodes={nodes}", "--nproc-per-node=1",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
        f"--rdzv-conf=is_host={1 if node == 0 else 0}", "--local-addr=127.0.0.1",
        "--max-restarts=0", "--monitor-interval=0.1",
        "-m", "trainyard.workload", *MODEL_ARGS,
    ]  # fmt: skip


def start(data: Path, run: Run, nodes: int, **settings: object) -> tuple[list[forks.Process], list[Path]]:
    """Start the workload on ``nodes`` local torchrun agents; their processes and log files."""
    run.root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    rdzv_id = f"{run.root.name}-{port}"
    logs = [run.root / f"node-{i}.{port}.log" for i in range(nodes)]
    # Each agent in a session of its own (so a hung run can be killed with its workers), forked as the launcher
    # forks a node (``forks``).
    procs = [forks.start(_torchrun_args(nodes, node, port, rdzv_id), _env(data, run, node, **settings), log)
             for node, log in enumerate(logs)]  # fmt: skip
    return procs, logs


def train(data: Path, run: Run, nodes: int, **settings: object) -> list[str]:
    """Run the workload on ``nodes`` local torchrun agents; return each node's output.

    Fails the test (with every node's log tail) unless all agents exit 0.
    """
    procs, logs = start(data, run, nodes, **settings)
    codes = [_wait(p) for p in procs]
    outputs = [log.read_text(errors="replace") for log in logs]
    detail = "\n".join(f"--- node-{i} (exit {c}) ---\n{o[-3000:]}" for i, (c, o) in enumerate(zip(codes, outputs)))
    assert codes == [0] * nodes, detail
    return outputs


def _wait(proc: forks.Process, timeout: float = RUN_TIMEOUT_S) -> int | None:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session we started: the agent and its worker
        proc.wait()
        return None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("data")
    write_synthetic_corpus(directory, shards=4, tokens_per_shard=16_384, vocab_size=256, seed=3)
    return directory


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """An uninterrupted 40-step run on two nodes, checkpointing every 10 steps."""
    run = Run.in_dir(tmp_path_factory.mktemp("reference"))
    train(corpus, run, nodes=2, max_steps=40, checkpoint_every=10, resume_from="latest")
    return run


def test_two_nodes_train_checkpoint_and_heartbeat(reference: Run) -> None:
    losses = reference.losses()
    assert sorted(losses) == list(range(1, 41))
    assert losses[1] == pytest.approx(5.545, abs=0.15)  # ~ln(256): a fresh model, not a resumed one
    assert losses[40] < losses[1] - 1.0, losses

    checkpoints = fmt.list_checkpoints(reference.checkpoints)
    assert [fmt.step_of(c) for c in checkpoints] == [10, 20, 30, 40]
    for ckpt in checkpoints:
        assert fmt.verify(ckpt) == []
        manifest = fmt.read_manifest(ckpt)
        assert (manifest["world_size"], manifest["global_batch"], manifest["micro_batch"]) == (2, 16, 4)
        assert manifest["metrics"]["loss"] == pytest.approx(losses[manifest["step"]])
        assert any(name.endswith(".distcp") for name in manifest["files"])
    saved = [e["step"] for e in Ledger(reference.ledger).events("train", "checkpoint_saved")]
    assert saved == [10, 20, 30, 40]

    # One writer per node: each node folder holds the node's beat and pulse, no file per rank.
    assert sorted(p.relative_to(reference.heartbeats).as_posix() for p in reference.heartbeats.rglob("*")) == [
        "node-0", "node-0/node.alive", "node-0/node.json", "node-1", "node-1/node.alive", "node-1/node.json",
    ]  # fmt: skip
    beats = read_heartbeats(reference.heartbeats)
    assert set(beats) == {"rank-0", "rank-1"}
    assert {b["folder"] for b in beats.values()} == {"node-0", "node-1"}
    assert all(b["status"] == "finished" and b["step"] == 40 for b in beats.values())


# What a checkpoint of the reference model (MODEL_ARGS: 2 blocks, d_model 32) holds, as the gloo/CPU
# workload wrote it before GPUs were supported: the CUDA path (bf16 autocast) must not change it.
_LAYERS = [f"blocks.{b}.{m}.{w}" for b in (0, 1) for m in ("ln1", "ln2", "mlp.0", "mlp.2", "proj", "qkv")
           for w in ("bias", "weight")] + ["ln_f.bias", "ln_f.weight", "pos_emb.weight", "tok_emb.weight"]  # fmt: skip
_GROUP_FIELDS = ("amsgrad", "betas", "capturable", "decoupled_weight_decay", "differentiable", "eps", "foreach",
                 "fused", "lr", "maximize", "params", "weight_decay")  # fmt: skip
CHECKPOINT_TENSORS = {
    *(f"train.model.{name}" for name in [*_LAYERS, "head.weight"]),  # the tied head is saved, its state is not
    *(f"train.optim.state.{name}.{s}" for name in _LAYERS for s in ("exp_avg", "exp_avg_sq", "step")),
}
CHECKPOINT_VALUES = {f"train.optim.param_groups.{g}.{f}" for g in (0, 1) for f in _GROUP_FIELDS}


def test_a_checkpoint_holds_the_same_keys_and_dtypes_as_before(reference: Run) -> None:
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = dcp.FileSystemReader(str(fmt.step_dir(reference.checkpoints, 40))).read_metadata().state_dict_metadata
    tensors = {k for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
    assert (tensors, set(entries) - tensors) == (CHECKPOINT_TENSORS, CHECKPOINT_VALUES)
    assert {entries[k].properties.dtype for k in tensors} == {torch.float32}  # type: ignore[union-attr]


def test_resume_reproduces_the_uninterrupted_run(corpus: Path, reference: Run, tmp_path: Path) -> None:
    run = Run.in_dir(tmp_path / "interrupted")
    train(corpus, run, nodes=2, max_steps=20, checkpoint_every=100)  # stops at 20; saves the last step
    assert [fmt.step_of(c) for c in fmt.list_checkpoints(run.checkpoints)] == [20]

    train(corpus, run, nodes=2, max_steps=25, checkpoint_every=100, resume_from="latest")

    resumed = list(Ledger(run.ledger).events("train", "resumed"))
    assert [(e["step"], e["from_world_size"], e["world_size"]) for e in resumed] == [(20, 2, 2)]
    expected, got = reference.losses(), run.losses()
    for step in range(21, 26):
        assert got[step] == pytest.approx(expected[step], abs=1e-5), step


def test_checkpoint_from_two_nodes_resumes_on_one(corpus: Path, reference: Run, tmp_path: Path) -> None:
    run = Run.in_dir(tmp_path / "scaled-down")
    source = fmt.step_dir(reference.checkpoints, 20)
    train(corpus, run, nodes=1, max_steps=23, checkpoint_every=100, resume_from=source)

    resumed = next(Ledger(run.ledger).events("train", "resumed"))
    assert (resumed["path"], resumed["from_world_size"], resumed["world_size"]) == (str(source), 2, 1)
    # Same global batch, same samples per step: only the summation order differs (accumulation 4 vs 2).
    expected, got = reference.losses(), run.losses()
    for step in (21, 22, 23):
        assert got[step] == pytest.approx(expected[step], abs=1e-4), step
    assert fmt.read_manifest(fmt.step_dir(run.checkpoints, 23))["world_size"] == 1


def test_explicit_invalid_checkpoint_is_refused(corpus: Path, reference: Run, tmp_path: Path) -> None:
    damaged = tmp_path / "step_000010"
    shutil.copytree(fmt.step_dir(reference.checkpoints, 10), damaged)
    (damaged / "__1_0.distcp").write_bytes(b"corrupt")
    run = Run.in_dir(tmp_path / "refused")
    env = _env(corpus, run, 0, max_steps=12, resume_from=damaged)

    # One process, no torchrun: the workload's own single-process mode is enough here.
    result = subprocess.run(
        [sys.executable, "-m", "trainyard.workload", *MODEL_ARGS],
        env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
    )  # fmt: skip

    assert result.returncode == 1, result.stdout + result.stderr
    assert "CheckpointInvalid" in result.stderr and "__1_0.distcp: size mismatch" in result.stderr
    assert not run.losses()  # refused before training a single step


def test_a_long_runs_steps_are_summarised_and_exact_at_checkpoints(corpus: Path, tmp_path: Path) -> None:
    run = Run.in_dir(tmp_path / "summarised")
    env = _env(corpus, run, 0, max_steps=25, checkpoint_every=10, progress_every_s=30)
    result = subprocess.run(
        [sys.executable, "-m", "trainyard.workload", *MODEL_ARGS],
        env=env,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )  # one process: the writer is rank 0's either way
    assert result.returncode == 0, result.stderr[-3000:]

    steps = list(Ledger(run.ledger).events("train", "step"))
    # The first step at once, then one event per checkpoint (the 30 s interval never elapses), the last step.
    assert [(e.get("first_step", e["step"]), e["step"]) for e in steps] == [(1, 1), (2, 10), (11, 20), (21, 25)]
    for e in steps[1:]:
        assert e["steps"] == e["step"] - e["first_step"] + 1
        assert e["loss_min"] <= e["loss_mean"] <= e["loss_max"] and e["step_ms_min"] <= e["step_ms_max"]
        manifest = fmt.read_manifest(fmt.step_dir(run.checkpoints, e["step"]))
        assert manifest["metrics"]["loss"] == e["loss"]  # exact at every checkpoint


def test_background_saves_hold_what_blocking_saves_hold(corpus: Path, reference: Run, tmp_path: Path) -> None:
    run = Run.in_dir(tmp_path / "background")
    train(corpus, run, nodes=2, max_steps=20, checkpoint_every=5, checkpoint_async=1)

    expected, got = reference.losses(), run.losses()
    assert [got[s] for s in range(1, 21)] == [expected[s] for s in range(1, 21)]  # saving never touched training
    saved = list(Ledger(run.ledger).events("train", "checkpoint_saved"))
    assert [e["step"] for e in saved] == [5, 10, 15, 20]
    assert all(0 <= e["blocked_s"] <= e["seconds"] for e in saved)
    assert not list(run.checkpoints.glob("*.tmp"))  # the last save committed before the run finished
    for step in (10, 20):
        # The state was copied when save() returned, before the next steps changed it: the rank
        # files are byte for byte those of the blocking save at the same step.
        shards = {k: v for k, v in fmt.read_manifest(fmt.step_dir(run.checkpoints, step))["files"].items()
                  if k.endswith(".distcp")}  # fmt: skip
        blocking = fmt.read_manifest(fmt.step_dir(reference.checkpoints, step))["files"]
        assert shards and all(blocking[k] == v for k, v in shards.items()), step

    train(corpus, run, nodes=2, max_steps=25, checkpoint_every=100, checkpoint_async=1, resume_from="latest")
    assert [e["step"] for e in Ledger(run.ledger).events("train", "resumed")] == [20]
    got = run.losses()
    for step in range(21, 26):
        assert got[step] == pytest.approx(expected[step], abs=1e-5), step


def test_a_rank_whose_peer_dies_mid_save_fails_at_once(corpus: Path, tmp_path: Path) -> None:
    """A save every step keeps one in flight. Were the survivors to wait for it on the way out,
    their save threads could wait on each other in a collective until gloo's 30-minute timeout."""
    run = Run.in_dir(tmp_path / "peer-dies")
    drill = json.dumps([{"fault": "kill", "node": "node-1", "step": 8}])
    procs, logs = start(
        corpus,
        run,
        nodes=3,
        max_steps=40,
        checkpoint_every=1,
        checkpoint_async=1,
        drills=drill,
        global_batch=12,
        micro_batch=2,
    )
    codes = [_wait(p, timeout=60) for p in procs]
    for code, log in zip(codes[::2], logs[::2]):  # node-0 and node-2
        assert code not in (0, None), log.read_text(errors="replace")[-3000:]
    committed = fmt.list_checkpoints(run.checkpoints)
    assert committed and all(fmt.step_of(c) < 8 and fmt.verify(c) == [] for c in committed)


def test_a_rank_that_dies_of_an_exception_leaves_a_record_that_classify_trusts(corpus: Path, tmp_path: Path) -> None:
    run = Run.in_dir(tmp_path / "oom")
    drill = json.dumps([{"fault": "oom", "node": "node-1", "step": 3}])
    procs, logs = start(corpus, run, nodes=2, max_steps=20, drills=drill)
    codes = [_wait(p, timeout=60) for p in procs]
    tails = [log.read_text(errors="replace")[-5000:] for log in logs]
    assert codes[1] not in (0, None), tails[1]

    records = {r.node: r for r in failure_records(run.heartbeats, ["node-0", "node-1"])}
    oom = records["node-1"]
    assert (oom.kind, oom.type, oom.host) == ("oom", "MemoryError", socket.gethostname())  # no TRAINYARD_HOST set
    assert oom.message == "drill: out of memory at step 3 on node-1"
    assert oom.rank in (0, 1) and (run.heartbeats / "node-1" / f"failure-rank-{oom.rank}.json").is_file()
    # node-0's rank saw its peer vanish, if it lived to say so (its agent may have ended it first): a symptom.
    assert "node-0" not in records or records["node-0"].kind == "transient", records

    nodes = [NodeFailure(f"node-{i}", "failed", code, "", tail) for i, (code, tail) in enumerate(zip(codes, tails))]
    found = classify(Failure(1, "crash", nodes, last_step=2, records=sorted(records.values(), key=lambda r: r.time)))
    assert (found.kind, found.culprits) == ("oom", ["node-1"])
    assert found.evidence.endswith("MemoryError: drill: out of memory at step 3 on node-1 (its failure record)")

    # Each process wrote its own event file; the reader merges them.
    writers = sorted(p.name for p in Ledger(run.ledger).events_dir.iterdir())
    assert f"attempt-1.node-1.rank-{oom.rank}.jsonl" in writers, writers
    fired = list(Ledger(run.ledger).events("train", "drill_fired"))
    assert [(e["fault"], e["node"], e["step"]) for e in fired] == [("oom", "node-1", 3)]
