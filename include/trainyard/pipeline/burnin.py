"""The pressure-test stage: test every candidate node, keep the best healthy ones, mark the evicted."""

from __future__ import annotations

import logging
import socket
import time
from datetime import UTC, datetime
from typing import Any

from trainyard.burnin.fleet import FLEET_DIR, Fleet, iso, record_verdict
from trainyard.burnin.judge import Judge
from trainyard.burnin.local import run_burn_in
from trainyard.burnin.protocol import BurnInRun, drills_from
from trainyard.burnin.table import format_table
from trainyard.burnin.verdict import Verdict, rules_of
from trainyard.errors import NodeUnhealthy, SpecError
from trainyard.pipeline.recorder import recorded
from trainyard.pipeline.run import Run
from trainyard.spec import KubernetesSpec


def candidates(run: Run) -> list[str]:
    return [f"node-{i}" for i in range(run.spec.nodes.count + run.spec.nodes.spare)]


log = logging.getLogger(__name__)


@recorded("burn_in")
def burn_in(run: Run, cluster: Any | None = None) -> dict[str, Any]:
    """Pressure-test every candidate node and keep the best ``nodes.count`` healthy ones.

    ``cluster`` is a ``kubernetes`` API client, needed with the kubernetes backend:
    candidates are then cluster nodes, and the evicted ones are marked there.
    A node evicted earlier sits out ``cooldown_h``, then is re-tested here and
    re-admitted when it passes. Every outcome goes into the fleet history.
    """
    cfg, nodes = run.spec.pressure_test, run.spec.nodes
    if not cfg.enabled:  # untested nodes; on Kubernetes still real ones, the hosts the pods are pinned to
        names = _cluster_candidates(run, cluster)[1] if nodes.backend == "kubernetes" else candidates(run)
        return {"healthy": names[: nodes.count], "spare": names[nodes.count :], "skipped": True}
    fleet, now, cooldown_s = Fleet(run.hot_root / FLEET_DIR), time.time(), cfg.cooldown_h * 3600
    drills = drills_from(cfg)
    if nodes.backend == "kubernetes":
        from trainyard.backends.kubernetes.cooldown import due_for_retest
        from trainyard.backends.kubernetes.kinds import node_kinds
        from trainyard.burnin.kubernetes import run_burn_in_k8s  # the kubernetes SDK: only for this backend

        core, names = _cluster_candidates(run, cluster)
        kube = _kube(run)
        retest = due_for_retest(core, kube, cooldown_s, datetime.fromtimestamp(now, UTC))
        names = [*names, *(n for n in retest if n not in names)]
        judge = Judge(
            rules_of(cfg), nodes.count, (kinds := node_kinds(core, names)), fleet.references(kinds.values()), False
        )
        probed = run_burn_in_k8s(
            core,
            names,
            cfg,
            kube,
            run.dir.name,
            str(run.hot_root / ".burnin"),
            drills,
            kube.store_host or socket.gethostbyname(socket.gethostname()),
            judge.recheck,
        )
    else:
        everyone = candidates(run)
        sitting_out = fleet.cooling(everyone, now, cooldown_s)
        for node, until in sitting_out.items():
            log.info("%s sits out its cool-down until %s (fleet history %s)", node, iso(until), fleet.path(node))
        names = [n for n in everyone if n not in sitting_out]
        retest = fleet.due(names, now, cooldown_s)
        kinds = dict.fromkeys(names, local_kind())
        judge = Judge(rules_of(cfg), nodes.count, kinds, fleet.references(kinds.values()), True)
        if sitting_out:
            run.ledger.append("burn_in", "sitting_out", nodes={n: iso(u) for n, u in sitting_out.items()})
        probed = run_burn_in(
            names, cfg, run.hot_root, run.dir / "burn-in", drills, judge.recheck, gpus_per_node=nodes.gpus_per_node
        )
    verdict = judge.verdict(names, probed)
    table = format_table(verdict, judge.rules)
    log.info("pressure test verdict (%.1f s):\n%s", probed.seconds, table)
    _record_verdict(run, fleet, judge, verdict, probed, now, drills)
    readmitted = [n for n in retest if n not in verdict.evicted]
    if nodes.backend == "kubernetes":
        from trainyard.backends.kubernetes.marks import label_evicted, unlabel

        if verdict.evicted:
            marked = label_evicted(
                core, list(verdict.evicted), kube.evicted_label, kube.evict_with, reasons=verdict.evicted
            )
            run.ledger.append("burn_in", "nodes_marked", nodes=marked, label=kube.evicted_label)
        if readmitted:
            unlabel(core, readmitted, kube.evicted_label)
    if retest:
        run.ledger.append(
            "burn_in", "nodes_retested", readmitted=readmitted, evicted=[n for n in retest if n in verdict.evicted]
        )
    if len(verdict.healthy) < nodes.min:
        raise NodeUnhealthy(f"only {len(verdict.healthy)} healthy node(s), nodes.min is {nodes.min}:\n{table}")
    return {
        "healthy": verdict.healthy,
        "evicted": verdict.evicted,
        "spare": verdict.spare,
        "suspects": verdict.suspects,
        "cleared": verdict.cleared,
        "readmitted": readmitted,
        "references": {k: {p: r.value for p, r in refs.items()} for k, refs in verdict.references.items()},
    }


def _record_verdict(
    run: Run,
    fleet: Fleet,
    judge: Judge,
    verdict: Verdict,
    probed: BurnInRun,
    now: float,
    drills: dict[str, tuple[str, float]],
) -> None:
    """Each node's figures of both rounds and its fate, in the ledger and in the fleet history."""
    for node, f in verdict.figures.items():
        state = verdict.state(node)
        reason = verdict.evicted.get(node, "")
        run.ledger.append(
            "burn_in",
            "node_verdict",
            node=node,
            kind=judge.kinds.get(node, ""),
            figures=f,
            again=verdict.again.get(node),
            beside_reference=verdict.beside.get(node) or None,
            suspect=verdict.suspects.get(node, ""),
            collective=probed.collective.get(node),
            links=probed.links.get(node),
            verdict=state,
            reason=reason,
        )
    record_verdict(fleet, verdict, judge.kinds, at=now, run_id=run.dir.name, drills=drills)
    # One row of references and thresholds for the report: the batch's most common kind's.
    kinds = list(judge.kinds.values())
    refs = verdict.references.get(max(set(kinds), key=kinds.count), {}) if kinds else {}
    run.ledger.append(
        "burn_in",
        "thresholds",
        references=verdict.as_dict()["references"],
        reference_values={p: r.value for p, r in refs.items()},
        thresholds={r.probe: r.threshold(refs[r.probe].value) for r in judge.rules if r.probe in refs},
        suspects=verdict.suspects,
        cleared=verdict.cleared,
        seconds=probed.seconds,
    )


def local_kind() -> str:
    """Local candidates are slices of this host: their history is this host's."""
    return f"local:{socket.gethostname()}"


def _kube(run: Run) -> KubernetesSpec:
    """``nodes.kubernetes`` of a Kubernetes run (the spec's models fill it in whenever the backend is kubernetes)."""
    kube = run.spec.nodes.kubernetes
    if kube is None:
        raise SpecError([f"{run.spec_path}: nodes.kubernetes: missing; the kubernetes backend needs it"])
    return kube


def _cluster_candidates(run: Run, cluster: Any | None) -> tuple[Any, list[str]]:
    from kubernetes import client as k8s

    from trainyard.backends.kubernetes.marks import candidate_nodes

    if cluster is None:
        require_local(run)
    core = k8s.CoreV1Api(cluster)
    want = run.spec.nodes.count + run.spec.nodes.spare
    names = candidate_nodes(core, _kube(run), want)
    if len(names) < run.spec.nodes.min:
        raise NodeUnhealthy(
            f"the cluster has {len(names)} usable node(s) (node_selector, not evicted); nodes.min is"
            f" {run.spec.nodes.min}"
        )
    return core, names


def require_local(run: Run) -> None:
    if run.spec.nodes.backend != "local":
        raise SpecError(
            [
                f"{run.spec_path}: nodes.backend: kubernetes needs a launcher from the Airflow layer"
                " (the train task builds one from nodes.kubernetes.connection)"
            ]
        )
