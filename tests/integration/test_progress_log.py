"""Progress lines of a deferred (Kubernetes) ``train`` task in its log files, through real Airflow components.

The local backend's lines are checked in the train task's log file of a run under the scheduler
(test_backfill.py); the line itself is table-tested in tests/unit/test_progress.py.

``airflow dags test`` alone runs every task (and a deferred task's trigger)
inside its own process and writes no task log file: the lines go to its
stdout only. ``airflow dags test --use-executor`` hands each task to the
executor (the LocalExecutor here), whose supervised task process writes
``logs/dag_id=.../run_id=.../task_id=.../attempt=N.log`` through the
Execution API of an api-server; a deferred task's trigger then runs in a
triggerer, which writes the trigger's lines beside it, to
``attempt=N.log.trigger.<triggerer job id>.log`` (the UI reads both as the
task's log). The deployment: an api-server and a triggerer, on 127.0.0.1.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from airflow_helpers import (
    ROOT, TASKS, Service, airflow, airflow_env, api_healthy, free_port, reap_leftovers, service_settings,
    start_service, stop_services, task_logs, task_states, wait_until,
)
from fake_k8s import FakeKube, Kubelet, airflow_connection

from trainyard.shards import write_synthetic_corpus

pytestmark = pytest.mark.integration
DATE = "2026-11-28"
NS = "ml"
NODES = ["gpu-a", "gpu-b"]
MAX_STEPS = 60
LINE = re.compile(
    r"^progress: attempt (?P<attempt>\d+), world size (?P<world>\d+), step (?P<step>\d+|-)/(?P<target>\d+).*"
    r", loss (?P<loss>\S+), (?P<rate>\S+) steps/s, (?P<tokens>\S+) tokens/s, ETA (?P<eta>\S+),"
    r" last valid checkpoint (?P<ckpt>\S+?)(?:, newest saved (?P<saved>\S+) \(not yet validated\))?$"
)
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes: {nodes}
pressure_test: {{enabled: false}}
training:
  args: {{seq-len: 32, d-model: 32, n-heads: 2, lr: 0.01}}
  max_steps: {steps}
  global_batch: 8
  micro_batch: 4
  checkpoint_every: 20
  progress_every_s: 0.5
checkpoint: {{hot: "file://{root}/{name}-ckpt", cold: "file://{root}/{name}-coldckpt"}}
"""
K8S = ("{count: 2, min: 1, backend: kubernetes, kubernetes: {image: 'trainer:1', namespace: ml, connection: fake_cluster,"
       " poll_s: 0.2}}")


@pytest.fixture
def deployment(tmp_path: Path, metadata_db: dict[str, str]) -> Iterator[tuple[dict[str, str], FakeKube, Path]]:
    root = tmp_path
    fake = FakeKube().start()
    for name in NODES:
        fake.add_node(name)
    dags = root / "dags"
    (dags / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", dags)
    write_synthetic_corpus(root / "cold", shards=2, tokens_per_shard=16_384)
    (dags / "pipelines" / "k8s_progress.yaml").write_text(SPEC.format(root=root, nodes=K8S, steps=MAX_STEPS,
                                                                      name="k8s_progress"))
    env = airflow_env(root / "home", dags, AIRFLOW_CONN_FAKE_CLUSTER=airflow_connection(fake, root, NS), **service_settings(free_port()), **metadata_db)
    port = env["AIRFLOW__API__PORT"]
    services: list[Service] = [
        start_service(env, "api-server", ["airflow", "api-server", "--apps", "execution", "-H", "127.0.0.1",
                                          "-p", port, "-w", "1"], root / "services"),
        start_service(env, "triggerer", ["airflow", "triggerer", "--skip-serve-logs"], root / "services"),
    ]
    try:
        wait_until(lambda: api_healthy(env), 180, "the api-server", services=services)
        yield env, fake, root
    finally:
        stop_services(services)
        fake.stop()
        assert reap_leftovers(env) == []


def dags_test(env: dict[str, str], dag_id: str) -> None:
    done = airflow(env, "dags", "test", "--use-executor", dag_id, DATE)
    states = {t: s for t, (s, _) in task_states(env, dag_id, DATE).items()}
    assert states == dict.fromkeys(TASKS, "success"), (done.stdout[-3000:] + done.stderr[-3000:]
                                                       + task_logs(env, dag_id))


def train_log(env: dict[str, str], dag_id: str, pattern: str) -> list[dict[str, Any]]:
    """The JSON records of the train task's log files matching ``pattern`` (``attempt=1.log``...), in order."""
    root = Path(env["AIRFLOW_HOME"]) / "logs" / f"dag_id={dag_id}"
    files = sorted(root.glob(f"run_id=*/task_id=train/{pattern}"))
    assert files, f"no train task log {pattern} under {root}: {sorted(p.name for p in root.rglob('*'))}"
    records = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.startswith("{")]
    return sorted(records, key=lambda r: r["timestamp"])


def progress_lines(records: list[dict[str, Any]]) -> list[re.Match[str]]:
    return [m for r in records if (m := LINE.match(str(r.get("event", ""))))]


def assert_progress(lines: list[re.Match[str]], world_size: int) -> None:
    """Lines of attempt 1 at the run's target, steps rising, rates and ETA known."""
    assert {(m["attempt"], m["world"], m["target"]) for m in lines} == {("1", str(world_size), str(MAX_STEPS))}
    steps = [int(m["step"]) for m in lines if m["step"] != "-"]
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] > steps[0], steps
    rated = [m for m in lines if m["rate"] != "-" and float(m["rate"]) > 0]
    assert rated, [m.string for m in lines]
    # The spec names seq-len: 8 sequences x 32 tokens a step.
    assert all(float(m["tokens"].replace(",", "")) == pytest.approx(256 * float(m["rate"]), rel=0.01, abs=1)
               for m in rated)
    assert all(m["eta"] != "-" and float(m["loss"]) > 0 for m in rated)


def checkpoints(lines: list[re.Match[str]], field: str) -> set[str]:
    return {m[field] for m in lines if m[field] and re.fullmatch(r"step_\d{6}", m[field])}


def test_the_deferred_kubernetes_train_task_logs_progress_from_the_triggerer(
        deployment: tuple[dict[str, str], FakeKube, Path]) -> None:
    env, fake, root = deployment
    with Kubelet(fake, NS, NODES, root / "kubelet"):
        dags_test(env, "k8s_progress")
    task = train_log(env, "k8s_progress", "attempt=1.log")
    assert any(str(r.get("event", "")).startswith("Pausing task as DEFERRED") for r in task), "no deferral"
    # The trigger's lines are in the triggerer's file of the task's log, tagged with the task instance.
    trigger = train_log(env, "k8s_progress", "attempt=1.log.trigger.*.log")
    lines = progress_lines(trigger)
    assert_progress(lines, world_size=2)
    assert {r["task_id"] for r in trigger if LINE.match(str(r.get("event", "")))} == {"train"}
    # A deferred task judges checkpoints when it wakes (wake_every_s, 300 s here, longer than the run): until
    # then the trigger names the newest committed one as not yet validated, never as valid.
    assert checkpoints(lines, "saved") & {"step_000020", "step_000040"}, [m.string for m in lines]
    assert {m["ckpt"] for m in lines} == {"none"}
