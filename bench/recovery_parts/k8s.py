"""The recovery bench's ``kubernetes`` configuration: the reference workload on the fake cluster.

``tests/integration/fake_k8s.py`` serves the Kubernetes API over HTTP and plays the Job controller, the
scheduler and the kubelets, running each pod's container (torchrun and the reference workload) as local
processes; the train stage drives it through the kubernetes backend as on a cluster, supervising in this
process (``deferrable: false``: the deferred driver's trigger polls add its ``poll_s`` to every figure,
and only a process that stays could host the store an in-place regroup needs). Two runs on 3 hosts and
a spare host: a pod's processes killed (the workload's kill drill, as the OOM killer or a crash), and
a host lost with its pod (``Kubelet.lose_node``: NotReady, its pods failed with reason NodeLost) once
the heartbeats reach the fault's step, the bench recording the fault's time first. ``path`` is the
path the backend took (relaunch until the kubernetes backend regroups in place).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from recovery_parts.configs import ROOT, Settings, finish, finish_relaunch, goals, not_here, relaunch_pair, summary
from recovery_parts.runs import MODEL, calibrated_step_ms, fault_plan, run_figures

from trainyard.pipeline import stages
from trainyard.pipeline.run import Run, open_run
from trainyard.protocol.heartbeat import read_heartbeats
from trainyard.protocol.shards import write_synthetic_corpus

sys.path.insert(0, str(ROOT / "tests" / "integration"))  # the fake cluster lives with the tests that use it
from fake_k8s import FakeKube, Kubelet, airflow_connection

NS = "bench"
HOSTS = ["gpu-a", "gpu-b", "gpu-c"]
SPARE = "gpu-d"
RESUME_GOAL_S = 5.0  # a relaunch on Kubernetes starts new pods: the goal is looser than the local 2 s
SPEC = """\
dataset: {{source: "file://{root}/cold", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes:
  count: 3
  min: 2
  backend: kubernetes
  kubernetes: {{image: "trainer:1", namespace: {ns}, connection: fake_cluster, poll_s: 0.2, deferrable: false}}
pressure_test: {{enabled: false}}
training:
  args: {args}
  max_steps: {steps}
  global_batch: 12
  micro_batch: 2
  checkpoint_every: {every}
  checkpoint_async: {background}
  heartbeat_timeout_s: {hb}
  progress_every_s: 0
checkpoint: {{hot: "file://{root}/ckpt", cold: "file://{root}/coldckpt"}}
recovery: {{max_attempts: 3, backoff_s: 0, in_place: {in_place}, snapshot_every: {snapshot_every}}}
drills: [{drills}]
"""


def kubernetes_runs(root: Path, settings: Settings) -> dict[str, Any]:
    """The pod-killed run's figures, with the host-lost run's under ``node_lost``."""
    step_ms = settings.step_ms or calibrated_step_ms(root / "calibration", settings.hb)
    plan = fault_plan(step_ms, settings.train_s)
    at = plan["fault_at"]
    pod = summary(_run(root / "pod", settings, plan, f"{{fault: kill, node: gpu-b, step: {at}}}"), plan,
                  f"drill: the pod on gpu-b SIGKILLed (its processes) at step {at}")  # fmt: skip
    lost = summary(_run(root / "node-lost", settings, plan, "", lose_at=at), plan,
                   f"by hand: host gpu-b lost (NotReady, its pod failed NodeLost) once a heartbeat reached step {at}")  # fmt: skip
    obj = {**pod, "node_lost": {**lost, "goals": goals(lost, RESUME_GOAL_S)}, "driver": "blocking (deferrable: false)"}
    return finish(obj, not_here("kubernetes", settings), RESUME_GOAL_S)


def kubernetes_relaunch(root: Path, settings: Settings) -> dict[str, Any]:
    """The pod-killed run on the relaunch path (``recovery.in_place: false``): with in-memory snapshots, and its
    ``baseline`` without them (``snapshot_every: 0``), in the same bench run."""
    step_ms = settings.step_ms or calibrated_step_ms(root / "calibration", settings.hb)
    plan = fault_plan(step_ms, settings.train_s)
    at = plan["fault_at"]

    def run(sub: str, every: int) -> dict[str, Any]:
        return _run(root / sub, settings, plan, f"{{fault: kill, node: gpu-b, step: {at}}}", in_place=False,
                    snapshot_every=every)  # fmt: skip

    fault = f"drill: the pod on gpu-b SIGKILLed (its processes) at step {at}, relaunched"
    obj = relaunch_pair(run, plan, fault, RESUME_GOAL_S)
    obj["driver"] = "blocking (deferrable: false)"
    return finish_relaunch(obj, not_here("kubernetes", settings), RESUME_GOAL_S)


def _run(root: Path, settings: Settings, plan: Mapping[str, int], drills: str, lose_at: int | None = None,
         in_place: bool = True, snapshot_every: int = 1) -> dict:  # fmt: skip
    write_synthetic_corpus(root / "cold", shards=2, tokens_per_shard=16_384)
    spec = root / "k8s.yaml"
    spec.write_text(
        SPEC.format(
            root=root,
            ns=NS,
            args=json.dumps(MODEL),
            steps=plan["steps"],
            every=plan["checkpoint_every"],
            background=str(settings.background).lower(),
            hb=settings.hb,
            drills=drills,
            in_place=str(in_place).lower(),
            snapshot_every=snapshot_every,
        )
    )
    run = open_run(spec, "bench", f"k8s-{time.time_ns()}", "2026-11-28")
    stages.stage_dataset(run)
    server = FakeKube().start()
    for name in [*HOSTS, SPARE]:
        server.add_node(name)
    os.environ["AIRFLOW_CONN_FAKE_CLUSTER"] = airflow_connection(server, root, NS)
    # The API client comes from the Airflow layer (the provider's hook and the connection), as in the task;
    # an Airflow home of the bench's own unless one is set, so nothing lands in ~/airflow.
    os.environ.setdefault("AIRFLOW_HOME", str(root.parent / "airflow"))
    # The fake kubelet's containers inherit this process's environment and share this machine's cores, as
    # the local backend's nodes do, which get one thread each (launcher.py): without it each of the 3 pods'
    # torch would take every core, and a step here took 6-8 s instead of ~0.3 s.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from trainyard.airflow.operators import launcher_for

    try:
        with Kubelet(server, NS, root / "kubelet", seed=0) as kubelet:
            ended = threading.Event()  # a host not yet lost when the stage ends is never lost
            loser = _lose_when(run, kubelet, "gpu-b", lose_at, ended) if lose_at is not None else None
            try:
                stages.train(run, HOSTS, launcher=launcher_for(run.spec.nodes), spares=[SPARE])
            finally:
                ended.set()
            if loser is not None:
                loser.join(timeout=5)
    finally:
        server.stop()
    return run_figures(run)


def _lose_when(run: Run, kubelet: Kubelet, host: str, step: int, ended: threading.Event) -> threading.Thread:
    """A thread that records the fault and takes ``host`` away once attempt 1's heartbeats reach ``step`` (or
    gives up when ``ended`` is set)."""

    def lose() -> None:
        while not ended.is_set():
            beats = read_heartbeats(run.dir / "attempt-1" / "heartbeat")
            reached = max((int(b.get("step") or 0) for b in beats.values()), default=0)
            if reached >= step:
                run.ledger.append("train", "drill_fired", fault="kill", node=host, step=reached)
                kubelet.lose_node(host)
                return
            ended.wait(0.02)

    thread = threading.Thread(target=lose, daemon=True)
    thread.start()
    return thread
