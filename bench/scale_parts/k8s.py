"""The Kubernetes trigger's poll beside an attempt of N pods, on the tests' fake API server.

``trigger_poll_cpu_ms``: the CPU of one poll of the deferred train task's trigger
(``KubernetesAttemptTrigger.poll``: the pods as its watch keeps them, one read of the Job on the
client it keeps, then ``attempt_status``), on the event loop's thread (the fake server answers on
threads of its own, not counted), every pod running. Goal: at 512 pods <= 50 ms, growing at most
linearly. ``trigger_sync_cpu_ms``: what the trigger pays once when it starts (each deferral): the
client, the one list of every pod (each deserialized into the client's model) and the first poll.

``launch_overhead_s``: the launcher's ``launch`` of a relaunched attempt (PodGroup-less: Service and Indexed
Job, whatever the size; the Job controller makes the pods). ``launch_in_place_s``: an in-place
attempt's (its store's Secret, Service and pod, then one pod per node). Wall time against the fake
server on this machine; the scheduler's and kubelets' part of "all pods running" is the cluster's, not
measured here. The burn-in's stage time of the same curve: ``scale_parts.burnin``.
"""

from __future__ import annotations

import asyncio
import secrets
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from trainyard.airflow.triggers import KubernetesAttemptTrigger
from trainyard.backends.base import LaunchPlan
from trainyard.backends.kubernetes.launcher import KubernetesLauncher
from trainyard.protocol.env import TrainEnv
from trainyard.recovery.deferred import AttemptWatch
from trainyard.spec import KubernetesSpec

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # the fake cluster lives with the tests that use it
from fake_k8s import FakeKube  # noqa: E402

NS = "trainyard"
POLLS = 5


def trigger_poll(n: int, root: Path) -> dict[str, Any]:
    fake = FakeKube().start()
    try:
        home = root / f"k8s-{n}"
        nodes = [f"k8s-{i}" for i in range(n)]
        plan = LaunchPlan(
            "scale", 1, nodes, 1, "trainyard.workload", [],
            TrainEnv(home / "hot", home / "ckpt", 10, events_dir=home / "events.d"), home / "attempt-1",
        )  # fmt: skip
        launcher = KubernetesLauncher(fake.client(), KubernetesSpec(image="registry.local/trainer:1", namespace=NS))
        started = time.perf_counter()
        name = launcher.launch(plan).name
        launch_ms = (time.perf_counter() - started) * 1e3
        for i, pod in enumerate(fake.spawn_job_pods(NS, name)):
            fake.set_pod(NS, pod, "Running", node=nodes[i], state={"running": {"startedAt": "2026-12-04T00:00:00Z"}})
        config = home / "kubeconfig"
        config.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": fake.url}}],
            "users": [{"name": "fake", "user": {"token": "t"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": NS}}],
        }))  # fmt: skip
        watch = AttemptWatch(1, 0.0, {"namespace": NS, "name": name, "poll_s": 10.0}, nodes, len(nodes), "", 0)
        trigger = KubernetesAttemptTrigger(watch, str(config))

        async def polls() -> tuple[float, list[float]]:
            cpu = []
            start = time.thread_time()
            async with trigger.watching():
                await trigger.poll()  # the first: the one list of the pods, the watch from its version
                sync = (time.thread_time() - start) * 1e3
                for _ in range(POLLS):
                    await asyncio.sleep(0.05)  # the watch's thread in the fake server settles
                    start = time.thread_time()
                    status = await trigger.poll()
                    cpu.append((time.thread_time() - start) * 1e3)
                    assert status.state == "running" and len(status.nodes) == n, status
            return sync, cpu

        sync, cpu = asyncio.run(polls())
        # After the trigger, its watch ended (the fake server notices a client gone only when it writes, and
        # would look at every pod at each change meanwhile): the pods made next are not the trigger's.
        fake.end_watches()
        in_place_ms = launch_in_place(launcher, plan, home)
    finally:
        fake.stop()
    return {
        "nodes": n,
        "trigger_poll_cpu_ms": round(statistics.median(cpu), 1),
        "trigger_sync_cpu_ms": round(sync, 1),
        "launch_overhead_s": round(launch_ms / 1e3, 4),
        "launch_in_place_s": round(in_place_ms / 1e3, 3),
    }


def launch_in_place(launcher: KubernetesLauncher, plan: LaunchPlan, home: Path) -> float:
    """Milliseconds of an in-place attempt's launch: its store (Secret of the nodes' keys, Service,
    coordinator pod), then a pod per node, each its own API call."""
    in_place = replace(
        plan, attempt=2, log_dir=home / "attempt-2", store_keys={n: secrets.token_hex(32) for n in plan.nodes}
    )
    in_place = replace(
        in_place, train_env=replace(in_place.train_env, store=launcher.store_endpoint(in_place), attempt=2)
    )
    started = time.perf_counter()
    launcher.serve_store(in_place)
    launcher.launch(in_place)
    return (time.perf_counter() - started) * 1e3
