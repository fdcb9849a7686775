"""A backend of the tests' own defers end to end, built from docs/architecture.md's "add a backend" recipe alone.

``exitfiles`` (a package beside this file, not in the library) is a backend that defers: its launcher starts each
node as a local torchrun agent that leaves an exit file, its ``describe`` hands an opaque handle, and its trigger
polls the exit files and the heartbeats. The test registers it where the recipe says (the registry, the spec's
backend names) and runs the train task as Airflow runs a deferred operator: it defers on the backend's trigger
(rebuilt from what ``serialize`` stored, as the triggerer does), resumes on its event, defers on the backoff's
time trigger after the fault, and finishes. Nothing of the library names the backend.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow.sdk.exceptions import TaskDeferred
from exitfiles.backend import NAME, ExitFileBackend
from exitfiles.trigger import ExitFileTrigger

from trainyard.airflow import tasks
from trainyard.airflow.operators import TrainOperator
from trainyard.backends import registry
from trainyard.checkpoint.format import read_manifest
from trainyard.pipeline import stages
from trainyard.pipeline.results import TrainResult
from trainyard.pipeline.run import open_run
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.recovery.deferred import AttemptWatch
from trainyard.spec import models

pytestmark = pytest.mark.integration

NODES = ["node-0", "node-1"]
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes: {{count: 2, min: 1, backend: exitfiles}}
pressure_test: {{enabled: false}}
training:
  args: {{seq-len: 32, d-model: 32, n-heads: 2, lr: 0.01}}
  max_steps: 20
  global_batch: 8
  micro_batch: 2
  checkpoint_every: 5
  heartbeat_timeout_s: 30
  startup_grace_s: 90
  progress_every_s: 1
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
recovery: {{max_attempts: 3, backoff_s: 0.2}}
drills: [{{fault: oom, node: node-1, step: 12}}]
"""


@pytest.fixture
def exitfiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recipe's registration: the backend under its name, and the name among the spec's."""
    monkeypatch.setattr(models, "BACKENDS", (*models.BACKENDS, NAME))
    monkeypatch.setitem(registry.BACKENDS, NAME, lambda nodes, client, connect: ExitFileBackend(nodes))


def first_event(trigger: Any, limit_s: float = 240) -> dict[str, Any]:
    async def wait() -> dict[str, Any]:
        async for event in trigger.run():
            return event.payload
        raise AssertionError("the trigger ended without an event")

    return asyncio.run(asyncio.wait_for(wait(), timeout=limit_s))


def rebuilt(trigger: Any) -> Any:
    """The trigger as the triggerer gets it: from what ``serialize`` stored in the metadata DB, as JSON."""
    classpath, data = trigger.serialize()
    module, _, name = classpath.rpartition(".")
    return getattr(importlib.import_module(module), name)(**json.loads(json.dumps(data)))


def deferred_operator(op: TrainOperator, context: dict[str, Any]) -> tuple[TrainResult, list[str], list[Any]]:
    """Run ``op`` as Airflow runs a deferred operator: each deferral's trigger to its event, then the method it
    named; returns the result, what each deferral reported, and the triggers deferred on."""
    seen: list[str] = []
    triggers: list[Any] = []
    call = lambda: op.execute(context)  # noqa: E731
    while True:
        try:
            result = call()
        except TaskDeferred as deferred:
            triggers.append(deferred.trigger)
            if deferred.method_name == "backoff_over":
                assert isinstance(deferred.trigger, DateTimeTrigger)
                first_event(deferred.trigger)
                seen.append("backoff")
                call = lambda: op.backoff_over(context, None)  # noqa: E731
                continue
            assert deferred.method_name == "attempt_event"
            event = first_event(rebuilt(deferred.trigger))
            seen.append(event["status"])
            call = lambda event=event: op.attempt_event(context, event)  # noqa: E731
            continue
        assert isinstance(result, TrainResult)
        return result, seen, triggers


def test_a_backend_of_the_tests_own_defers_through_the_recipe_end_to_end(
    exitfiles: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_synthetic_corpus(tmp_path / "cold", shards=2, tokens_per_shard=16_384)
    spec = tmp_path / "exitfiles.yaml"
    spec.write_text(SPEC.format(root=tmp_path))
    run = open_run(spec, "exitfiles", f"deferred-{time.monotonic_ns()}", "2026-11-28")
    stages.stage_dataset(run)
    op = TrainOperator(task_id="train", spec=str(run.spec_path), run_file=str(run.dir / "spec.json"), nodes=NODES)
    context = {"dag": SimpleNamespace(dag_id=run.dag_id), "run_id": run.run_id}
    monkeypatch.setattr(tasks, "get_current_context", lambda: context)  # what Airflow's task runner makes current

    result, seen, triggers = deferred_operator(op, context)

    # The task deferred on the backend's trigger, woke on its events, waited out the backoff on a time trigger.
    assert seen == ["failed", "backoff", "succeeded"], seen
    watches = [t.watch for t in triggers if isinstance(t, ExitFileTrigger)]
    assert [w.attempt for w in watches] == [1, 2]
    first: AttemptWatch = watches[0]
    # The watch carries the spec's watch settings and the backend's wake; the handle is the launcher's, opaque.
    assert (first.heartbeat_timeout_s, first.startup_grace_s, first.wake_s) == (30, 90, ExitFileBackend.wake_every_s)
    assert first.handle == {"folder": str(run.dir / "attempt-1" / "exits"), "poll_s": 0.2}
    # The fault the trigger saw was judged by the task that woke: the OOM of node-1, retried with half the batch.
    [classified] = list(run.ledger.events("train", "failure_classified"))
    assert classified["kind"] == "oom" and classified["culprits"] == ["node-1"]
    [decision] = list(run.ledger.events("train", "decision"))
    assert decision["micro_batch"] == 1
    assert [e["status"] for e in run.ledger.events("train", "attempt_event")] == ["failed", "succeeded"]
    assert result.attempts == 2 and read_manifest(Path(result.checkpoint or "")).get("step") == 20
    # Every node of both attempts ended: nothing the backend started outlives the run.
    pids = [int(p.read_text()) for p in run.dir.glob("attempt-*/exits/*.pid")]
    assert len(pids) == 4 and not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
