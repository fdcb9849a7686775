"""Training on the kubernetes backend, deferred, end to end against an API server over HTTP.

The train task's two halves (``TrainStage.begin`` and
``TrainStage.resume``) are driven the way Airflow drives the deferred
``TrainOperator``: launch, then wait on the operator's own trigger
(``trigger_for``: the provider's async hook through an Airflow connection),
then hand each event back, until a result or a failure. ``fake_k8s.Kubelet``
runs every pod's container -- torchrun with the reference workload -- as
local processes, so the ranks really train, checkpoint, fail and resume.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import os
import random
import re
import shutil
import threading
import time
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow_helpers import ROOT, TASKS, airflow, airflow_env, run_state, task_states, wait_until
from fake_k8s import FakeKube, Kubelet, airflow_connection

from trainyard.airflow import tasks
from trainyard.airflow.operators import TrainOperator, backoff_trigger, launcher_for, trigger_for
from trainyard.airflow.triggers import KubernetesAttemptTrigger
from trainyard.checkpoint.format import read_manifest
from trainyard.events.ledger import Ledger
from trainyard.pipeline import stages
from trainyard.pipeline.results import BurnInResult, TrainResult
from trainyard.pipeline.run import Run, defers, open_run
from trainyard.pipeline.train import TrainStage
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.deferred import AttemptWatch, Backoff
from trainyard.recovery.look import reported
from trainyard.recovery.observations import BackoffOver, Reported

pytestmark = pytest.mark.integration

NS = "ml"
NODES = ["gpu-a", "gpu-b"]
SPARE = "gpu-c"
SEED = int(os.environ.get("TRAINYARD_FAKE_K8S_SEED", "0"))  # the fake scheduler's placements
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes:
  count: 2
  min: 1
  backend: kubernetes
  kubernetes: {{image: "trainer:1", namespace: {ns}, connection: fake_cluster, poll_s: 0.2, wake_every_s: {wake}}}
pressure_test: {{enabled: false}}
training:
  args: {{seq-len: 32, d-model: 32, n-heads: 2, lr: 0.01}}
  max_steps: 20
  global_batch: 8
  micro_batch: 2
  checkpoint_every: 5
  heartbeat_timeout_s: 6
  progress_every_s: 1
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
recovery: {{max_attempts: 3, backoff_s: {backoff}, in_place: {in_place}}}
drills: {drills}
"""


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    server = FakeKube().start()
    for name in [*NODES, SPARE]:  # more nodes than the plan: unpinned pods could land on the spare
        server.add_node(name)
    monkeypatch.setenv("AIRFLOW_CONN_FAKE_CLUSTER", airflow_connection(server, tmp_path, NS))
    yield server
    server.stop()


# The task's wake-up (a ``timeout`` event) far from any phase of these runs, which take seconds: the tests
# assert on the events the trigger saw, and a wake-up that came first on a slow machine would let the task
# see the pods' end itself (as it should) instead of the trigger.
WAKE_S = 120


def run_with(
    tmp_path: Path,
    drills: str,
    backoff_s: float = 0.2,
    in_place: str = "false",
    max_steps: int = 20,
    heartbeat_timeout_s: int = 6,
) -> Run:
    """A run of ``SPEC``; ``in_place``: the recovery section's value (these tests are about the relaunch path
    unless they say otherwise, whichever the default)."""
    write_synthetic_corpus(tmp_path / "cold", shards=2, tokens_per_shard=16_384)
    spec = tmp_path / "k8s.yaml"
    text = SPEC.format(root=tmp_path, ns=NS, drills=drills, backoff=backoff_s, wake=WAKE_S, in_place=in_place)
    text = text.replace("heartbeat_timeout_s: 6", f"heartbeat_timeout_s: {heartbeat_timeout_s}")
    spec.write_text(text.replace("max_steps: 20", f"max_steps: {max_steps}"))
    run = open_run(spec, "k8s", f"deferred-{time.monotonic_ns()}", "2026-11-28")
    stages.stage_dataset(run)
    return run


def first_event(trigger: Any, limit_s: float = 2 * WAKE_S) -> dict[str, Any]:
    async def wait() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(wait(), timeout=limit_s))


def triggered(trigger: Any) -> dict[str, Any]:
    """The trigger's first event, run as the triggerer runs it: rebuilt from what ``serialize`` stored."""
    classpath, data = trigger.serialize()  # what the triggerer gets from the metadata DB
    module, _, name = classpath.rpartition(".")
    rebuilt = getattr(importlib.import_module(module), name)(**json.loads(json.dumps(data)))
    return first_event(rebuilt)


def deferred_train(run: Run, spares: list[str] | None = None) -> tuple[TrainResult, list[str]]:
    """What Airflow does with the deferred operator: each half in a fresh launcher, as in a fresh process."""
    assert defers(run.spec.nodes)
    spares = list(spares or [])
    outcome = TrainStage(run, NODES, launcher_for(run.spec.nodes), spares).begin()
    seen = []
    while not isinstance(outcome, TrainResult):
        if isinstance(outcome, Backoff):  # the backoff is a deferral too: on a time trigger, not a sleep
            first_event(backoff_trigger(run, outcome))  # the provider's DateTimeTrigger, run as the triggerer would
            seen.append("backoff")
            news: Reported | BackoffOver = BackoffOver(time.time())
        else:
            event = triggered(trigger_for(run, AttemptWatch.from_json(json.loads(json.dumps(outcome.to_json())))))
            seen.append(event["status"])
            news = reported(event)
        outcome = TrainStage(run, NODES, launcher_for(run.spec.nodes), spares).resume(news)
    return outcome, seen


def evicted(fake: FakeKube) -> list[str]:
    return sorted(
        n["metadata"]["name"]
        for n in fake.items("api/v1", "nodes")
        if n["metadata"].get("labels", {}).get("trainyard.io/evicted") == "true"
    )


def train_events(run: Run, name: str) -> list[dict[str, Any]]:
    return list(run.ledger.events("train", name))


def test_an_oom_pod_is_retried_with_half_the_micro_batch_and_the_run_finishes(fake: FakeKube, tmp_path: Path) -> None:
    run = run_with(tmp_path, "[{fault: oom, node: gpu-b, step: 12}]")
    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED):
        result, seen = deferred_train(run)
    assert seen[-1] == "succeeded" and seen[seen.index("failed") + 1] == "backoff"
    [classified] = train_events(run, "failure_classified")
    assert classified["kind"] == "oom" and classified["culprits"] == ["gpu-b"]
    [decision] = train_events(run, "decision")
    assert decision["micro_batch"] == 1
    starts = train_events(run, "attempt_start")
    assert [(s["attempt"], s["nodes"], s["micro_batch"]) for s in starts] == [(1, NODES, 2), (2, NODES, 1)]
    # The failed pod's log was kept as the evidence classify read.
    assert any("MemoryError" in p.read_text() for p in (run.dir / "attempt-1").glob("*.log"))
    manifest = read_manifest(Path(result.checkpoint))
    assert manifest["step"] == 20 and result.attempts == 2 and result.target_step == 20
    # Every checkpoint was judged by the wake-up sweeps, the final one included.
    judged = {Path(e["path"]).name for e in train_events(run, "checkpoint_validated")}
    assert Path(result.checkpoint).name in judged
    assert [e["event"] for e in run.ledger.events("train") if e["event"].startswith("stage_")] == [
        "stage_start",
        "stage_end",
    ]
    assert fake.items("apis/batch/v1", "jobs", NS) == [] and fake.items("api/v1", "services", NS) == []
    assert evicted(fake) == []  # an OOM is the job's fault, not the node's
    assert stages.check_checkpoint(run, result.checkpoint, 20).step == 20


def test_a_deferred_run_records_the_train_stage_as_a_blocking_one_does(fake: FakeKube, tmp_path: Path) -> None:
    """The one stage recorder: the deferred task, in a new process at every wake, writes the train stage's
    events as the blocking one does (test_recovery's ``recovery_path``): start, resume point, recovery path,
    figures, end with the result, each once."""
    run = run_with(tmp_path, "[]")
    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED):
        result, seen = deferred_train(run)
    assert seen[-1] == "succeeded"
    [path] = train_events(run, "recovery_path")  # these tests pin the relaunch path (run_with's in_place)
    assert path["in_place"] is False and path["why_not"] == "recovery.in_place is false"
    recorded = [e["event"] for e in run.ledger.events("train") if e["event"] in STAGE_RECORD]
    assert recorded == ["stage_start", "resume_point", "recovery_path", "recovery_figures", "stage_end"]
    [end] = train_events(run, "stage_end")
    assert end["result"] == asdict(result) and end["seconds"] > 0


# The train stage's own record (not the attempts' events), in the order both drivers write it.
STAGE_RECORD = ("stage_start", "resume_point", "recovery_path", "recovery_figures", "stage_end", "stage_failed")


def processes_of(run: Run) -> list[psutil.Process]:
    """Live processes started for this run (the launcher gives each its events folder)."""
    found = []
    for proc in psutil.process_iter():
        try:
            mine = proc.environ().get("TRAINYARD_EVENTS_DIR") == str(run.ledger.events_dir)
            if mine and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def test_a_hung_rank_is_seen_by_the_trigger_and_the_run_scales_down(fake: FakeKube, tmp_path: Path) -> None:
    run = run_with(tmp_path, "[{fault: hang, node: gpu-b, step: 12}]")
    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED):
        result, seen = deferred_train(run)
        # The deleted pods' processes are gone, the stopped worker of the hung one too.
        wait_until(lambda: not processes_of(run), 5, "the run's processes to end", every_s=0.1)
    assert "hang" in seen and seen[-1] == "succeeded" and "backoff" in seen
    [classified] = train_events(run, "failure_classified")
    assert classified["kind"] == "hang" and classified["culprits"] == ["gpu-b"]
    [decision] = train_events(run, "decision")
    assert decision["action"] == "scale_down" and decision["new_nodes"] == ["gpu-a"]
    assert read_manifest(Path(result.checkpoint))["world_size"] == 1
    assert fake.items("api/v1", "pods", NS) == []  # the hung attempt's pods were deleted with its Job
    # The node left out is marked as the pressure test marks a weak one: no later pod lands there.
    assert evicted(fake) == ["gpu-b"]
    assert [e["nodes"] for e in train_events(run, "nodes_marked")] == [["gpu-b"]]


def test_the_train_task_defers_in_a_real_airflow_run(fake: FakeKube, tmp_path: Path) -> None:
    """``airflow dags test`` runs the trigger inline: the operator defers, resumes on the event, and finishes."""
    dags = tmp_path / "dags"
    (dags / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", dags)
    write_synthetic_corpus(tmp_path / "cold", shards=2, tokens_per_shard=16_384)
    (dags / "pipelines" / "k8s_train.yaml").write_text(
        SPEC.format(root=tmp_path, ns=NS, drills="[]", backoff=0.2, wake=WAKE_S, in_place="false")
    )
    env = airflow_env(tmp_path / "home", dags, AIRFLOW_CONN_FAKE_CLUSTER=os.environ["AIRFLOW_CONN_FAKE_CLUSTER"])
    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED):
        done = airflow(env, "dags", "test", "k8s_train", "2026-11-28")
    Path("/tmp/k8s_dags_test.log").write_text(done.stdout + done.stderr)
    out = done.stdout[-4000:] + done.stderr[-4000:]
    assert {t: s for t, (s, _) in task_states(env, "k8s_train", "2026-11-28").items()} == dict.fromkeys(
        TASKS, "success"
    ), out
    assert run_state(env, "k8s_train", "2026-11-28") == "success"
    [run_dir] = (tmp_path / "runs" / "k8s_train").iterdir()
    ledger = Ledger.in_dir(run_dir)
    # Only the resumed half of the task writes attempt_event: the operator did defer and come back.
    assert [e["status"] for e in ledger.events("train", "attempt_event")][-1] == "succeeded"
    assert [e["attempt"] for e in ledger.events("train", "attempt_start")] == [1]
    assert fake.items("apis/batch/v1", "jobs", NS) == []
    # The trigger ran inline, in this process: its progress lines went to dags test's own output (there is
    # no task log file without an executor; under a triggerer they go to the task log's
    # ``attempt=N.log.trigger.<id>.log`` beside it, and the task logs a line itself at each wake).
    steps = [
        int(s) for s in re.findall(r"progress: attempt 1, world size 2, step (\d+)/20 ", done.stdout + done.stderr)
    ]
    assert steps and steps == sorted(steps), out


class TaskInstance:
    """The slice of Airflow's task instance the train operator reads: burn-in's choice."""

    def xcom_pull(self, task_ids: str) -> BurnInResult:
        return BurnInResult(healthy=NODES, spare=[])


def test_a_backoff_defers_on_a_time_trigger_instead_of_sleeping_in_the_worker(
    fake: FakeKube, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The operator as Airflow runs it: after the OOM, the task defers on a ``DateTimeTrigger`` for the backoff
    (no worker slot sleeps through it), at most until its next wake (which renews the lease); a wake before
    the backoff is over defers again, and nothing is launched until it is."""
    from airflow.sdk.exceptions import TaskDeferred

    run = run_with(tmp_path, "[{fault: oom, node: gpu-b, step: 12}]", backoff_s=5 * WAKE_S)
    op = TrainOperator(
        task_id="train",
        spec=str(run.spec_path),
        run_file=str(run.dir / "spec.json"),
        nodes=TaskInstance().xcom_pull("burn_in"),
    )
    context = {"ti": TaskInstance(), "dag": SimpleNamespace(dag_id=run.dag_id), "run_id": run.run_id}
    # What Airflow's task runner makes current while an operator runs: the run_file XCom is checked against it.
    monkeypatch.setattr(tasks, "get_current_context", lambda: context)
    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED):
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(context)
        while deferred.value.method_name == "attempt_event":
            assert isinstance(deferred.value.trigger, KubernetesAttemptTrigger)
            event = triggered(deferred.value.trigger)
            with pytest.raises(TaskDeferred) as deferred:
                op.attempt_event(context, event)
    assert event["status"] == "failed"
    [decision] = train_events(run, "decision")
    assert decision["action"] == "retry" and decision["delay_s"] == 5 * WAKE_S
    waited = deferred.value
    assert waited.method_name == "backoff_over" and isinstance(waited.trigger, DateTimeTrigger)
    until = waited.trigger.moment.timestamp()
    assert until < decision["ts"] + 5 * WAKE_S and until <= time.time() + WAKE_S  # the wake comes first
    assert [s["attempt"] for s in train_events(run, "attempt_start")] == [1]  # nothing launched during the wait
    with pytest.raises(TaskDeferred) as again:  # woken before the backoff is over: wait on, on a time trigger
        op.backoff_over(context, None)
    assert again.value.method_name == "backoff_over" and isinstance(again.value.trigger, DateTimeTrigger)
    assert [s["attempt"] for s in train_events(run, "attempt_start")] == [1]
    assert fake.items("apis/batch/v1", "jobs", NS) == []  # the failed attempt's Job is gone meanwhile


def test_a_lost_host_is_marked_and_replaced_by_the_spare_under_random_placement(fake: FakeKube, tmp_path: Path) -> None:
    """A host goes away mid-run with its pod (NodeLost), wherever the scheduler had put which rank: that host,
    not a slot's name, is blamed, marked on the cluster and replaced by the spare, and the run finishes."""
    run = run_with(tmp_path, "[]")
    lost: dict[str, Any] = {}

    def lose_a_host(kubelet: Kubelet) -> None:
        beats = run.dir / "attempt-1" / "heartbeat"
        wait_until(lambda: max((b.get("step", 0) for b in read_heartbeats(beats).values()), default=0) >= 3, 120,
                   "attempt 1 to train a few steps", every_s=0.1)  # fmt: skip
        hosts = sorted({kubelet.placed[name] for name in kubelet.placed})
        lost["host"] = random.Random(SEED).choice(hosts)
        lost["pods"] = kubelet.lose_node(lost["host"])
        lost["first"] = set(kubelet.placed)

    with Kubelet(fake, NS, tmp_path / "kubelet", seed=SEED) as kubelet:
        loser = threading.Thread(target=lose_a_host, args=(kubelet,))
        loser.start()
        result, seen = deferred_train(run, [SPARE])
        loser.join()
        later = {kubelet.placed[name] for name in set(kubelet.placed) - lost["first"]}
    host = lost["host"]
    (survivor,) = [n for n in NODES if n != host]
    assert lost["pods"] and "failed" in seen and seen[-1] == "succeeded"
    [classified] = train_events(run, "failure_classified")
    assert classified["kind"] == "node_lost" and classified["culprits"] == [host]
    [decision] = train_events(run, "decision")
    assert decision["action"] == "scale_down" and decision["new_nodes"] == [survivor, SPARE]
    assert evicted(fake) == [host]  # the real host is marked: no later pod of any run lands there
    assert [e["nodes"] for e in train_events(run, "nodes_marked")] == [[host]]
    assert later == {survivor, SPARE}  # attempt 2's pods ran on the hosts it was pinned to
    manifest = read_manifest(Path(result.checkpoint))
    assert manifest["step"] == 20 and manifest["world_size"] == 2 and result.attempts == 2
