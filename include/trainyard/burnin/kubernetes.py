"""The burn-in pod of a candidate, as the pressure test builds it: its protocol arguments and key in the
backend's pod (``trainyard.backends.kubernetes.probes.probe_pod``).

The pressure test starts these pods through the Kubernetes backend's
``ProbeSite`` (``trainyard.burnin.launch.probe_nodes``); a node it evicts is
marked by the backend (``Backend.exclude``: the ``evicted_label``, and with
``evict_with: taint`` a NoSchedule taint of the same key), which the training
Job's required node affinity keeps its pods off.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.backends.backend import ProbeRun
from trainyard.backends.kubernetes.models import k8s
from trainyard.backends.kubernetes.probes import probe_pod
from trainyard.burnin.args import NO_DRILL, Drill
from trainyard.burnin.launch import probe_of
from trainyard.spec import KubernetesSpec, PressureTestSpec

if TYPE_CHECKING:  # burnin.protocol imports torch; the orchestrator has it, this module's callers may not
    from trainyard.burnin.protocol import Schedule


def build_burnin_pod(
    node: str,
    *,
    run_id: str,
    store: str,
    schedule: Schedule,
    cfg: PressureTestSpec,
    spec: KubernetesSpec,
    scratch: str,
    timeout_s: float,
    key: str,
    drill: Drill = NO_DRILL,
    launcher: tuple[str, str] | None = None,
) -> k8s.V1Pod:
    """The burn-in pod of candidate ``node`` (a Kubernetes node name); ``store`` is the orchestrator's host:port.

    ``run_id`` names the pod, so it must be unique across pipelines (``Run.holder``,
    ``dag_id/run_id``); ``timeout_s`` is the node's protocol timeout (``--timeout``);
    ``key`` the node's per-run key, in its environment (never in its arguments);
    ``launcher`` the account no pod may run as (see ``pods.pod_account``).
    """
    run = ProbeRun(run_id, store, scratch, timeout_s)
    probe = probe_of(node, run, schedule, cfg, key, drill, Path(scratch))  # a pod's log stays in the cluster
    return probe_pod(node, probe.args, probe.env, run=run, spec=spec, launcher=launcher)
