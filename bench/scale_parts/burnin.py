"""The pressure test's stage time with N candidate nodes, on the tests' fake API server.

``burnin_s``: the whole stage (``pipeline.burnin.burn_in``: the cluster's candidates and kinds read, one
burn-in pod per node created, the store, the protocol's rounds, the verdict, the fleet history written, the pods
deleted) beside N candidates that answer every instruction after the time it grants. ``burnin_overhead_s``: that
minus the probing time the schedule grants (``pressure_test.duration_s``): what the orchestration itself costs.

The candidates are light: threads of this process that speak the node's own protocol (``burnin.node.protocol``:
its store, its signed instructions and answers) but whose probes sleep the time they are given and report a
healthy node's figures (a real probe is a process importing torch and running matmuls; 512 of them cannot share
two cores). A light kubelet thread binds each burn-in pod to its node, marks it running and starts its candidate
from the pod's own arguments and key.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any

from trainyard.burnin import node
from trainyard.burnin.sealing import KEY_ENV
from trainyard.pipeline.run import open_run
from trainyard.pipeline.stages import burn_in

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "integration"))  # the fake cluster lives with the tests that use it
from fake_k8s import FakeKube  # noqa: E402
from light_nodes import LIGHT, candidate  # noqa: E402

NS = "trainyard"
DURATION_S = 8.0
SPEC = """\
dataset: {{source: "file:///unused", name: tokens, hot: "file://{root}/hot"}}
runs_root: file://{root}/runs
nodes:
  count: {n}
  min: 1
  backend: kubernetes
  kubernetes: {{image: "trainer:1", namespace: {ns}, node_selector: {{pool: train}}, store_host: 127.0.0.1}}
pressure_test: {{duration_s: {duration}, collective_sizes_kb: [64]}}
training: {{max_steps: 1, global_batch: {n}, micro_batch: 1, checkpoint_every: 1}}
"""


class LightKubelet:
    """Binds each new burn-in pod to its node, marks it running and starts its light candidate."""

    def __init__(self, fake: FakeKube):
        self.fake = fake
        self.started: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> LightKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)  # a bound: its loop checks the stop every 0.05 s

    def _loop(self) -> None:
        while not self._stop.wait(0.05):
            for pod in self.fake.items("api/v1", "pods", NS):
                name = pod["metadata"]["name"]
                if name in self.started:
                    continue
                self.started.add(name)
                container = pod["spec"]["containers"][0]
                env = {e["name"]: e.get("value", "") for e in container.get("env", [])}
                host = pod["metadata"]["annotations"]["trainyard.io/node"]
                self.fake.set_pod(NS, name, "Running", node=host, state={"running": {}})
                args = [a.replace("$$", "$") for a in container["args"]]
                threading.Thread(target=candidate, args=(args, env[KEY_ENV]), daemon=True).start()


def stage_time(n: int, root: Path, duration_s: float = DURATION_S) -> dict[str, Any]:
    """The stage beside ``n`` light candidates, granting ``duration_s`` of probing (smaller in ``--smoke``)."""
    for name, probe in LIGHT.items():  # node.protocol looks its probes up at each call
        setattr(node, name, probe)
    logging.getLogger("trainyard").setLevel(logging.WARNING)  # the verdict's table of every node
    home = root / f"burnin-{n}"
    home.mkdir(parents=True)
    fake = FakeKube().start()
    try:
        for i in range(n):
            fake.add_node(f"k8s-{i}", {"pool": "train"})
        spec = home / "p.yaml"
        spec.write_text(SPEC.format(root=home, n=n, ns=NS, duration=duration_s))
        run = open_run(spec, "scale", f"burnin-{n}", "2026-12-04")
        with LightKubelet(fake):
            started = time.monotonic()
            result = burn_in(run, fake.client())
            seconds = time.monotonic() - started
        assert len(result.healthy) == n, (
            f"{n - len(result.healthy)} of {n} not healthy: {sorted(result.evicted.items())[:3]}"
        )
        assert fake.items("api/v1", "pods", NS) == [], "burn-in pods left behind"
    finally:
        fake.stop()
    return {"burnin_s": round(seconds, 2), "burnin_overhead_s": round(seconds - duration_s, 2)}
