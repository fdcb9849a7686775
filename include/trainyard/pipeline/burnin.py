"""The pressure-test stage: test every candidate node, keep the best healthy ones, mark the evicted."""

from __future__ import annotations

import logging
import time
from typing import Any

from trainyard.backends.backend import Backend
from trainyard.backends.registry import Connect, backend_for
from trainyard.burnin.fleet import FLEET_DIR, Fleet, iso, record_verdict
from trainyard.burnin.judge import Judge
from trainyard.burnin.launch import probe_nodes
from trainyard.burnin.protocol import BurnInRun, drills_from
from trainyard.burnin.table import format_table
from trainyard.burnin.verdict import Verdict, rules_of
from trainyard.errors import NodeUnhealthy
from trainyard.pipeline.recorder import recorded
from trainyard.pipeline.results import BurnInResult
from trainyard.pipeline.run import Run

log = logging.getLogger(__name__)


@recorded("burn_in")
def burn_in(run: Run, cluster: Any | None = None, connect: Connect | None = None) -> BurnInResult:
    """Pressure-test every candidate node and keep the best ``nodes.count`` healthy ones.

    ``cluster`` is a ``kubernetes`` API client (or ``connect`` makes one from ``nodes.kubernetes``), needed with
    the kubernetes backend:
    candidates are then cluster nodes, and the evicted ones are marked there.
    A node evicted earlier sits out ``cooldown_h``, then is re-tested here and
    re-admitted when it passes. Every outcome goes into the fleet history.
    """
    cfg, nodes = run.spec.pressure_test, run.spec.nodes
    backend = backend_for(nodes, cluster, connect=connect)
    if not cfg.enabled:  # untested nodes; on Kubernetes still real ones, the hosts the pods are pinned to
        names = backend.candidates()
        return BurnInResult(healthy=names[: nodes.count], spare=names[nodes.count :], skipped=True)
    fleet, now, cooldown_s = Fleet(run.hot_root / FLEET_DIR), time.time(), cfg.cooldown_h * 3600
    drills = drills_from(cfg)
    pool = backend.pool(fleet, now, cooldown_s)
    for node, until in pool.sitting_out.items():
        log.info("%s sits out its cool-down until %s (fleet history %s)", node, iso(until), fleet.path(node))
    if pool.sitting_out:
        run.ledger.append("burn_in", "sitting_out", nodes={n: iso(u) for n, u in pool.sitting_out.items()})
    names, retest, site = pool.names, pool.retest, backend.probe_site()
    kinds = backend.kinds(names)
    judge = Judge(rules_of(cfg), nodes.count, kinds, fleet.references(kinds.values()), site.shared)
    probed = probe_nodes(
        site, names, cfg, site.scratch(run.hot_root), run.dir / "burn-in", drills, judge.recheck, run_id=run.dir.name
    )
    verdict = judge.verdict(names, probed)
    table = format_table(verdict, judge.rules)
    log.info("pressure test verdict (%.1f s):\n%s", probed.seconds, table)
    _record_verdict(run, fleet, judge, verdict, probed, now, drills)
    readmitted = [n for n in retest if n not in verdict.evicted]
    _mark(run, backend, verdict, readmitted)
    if retest:
        run.ledger.append(
            "burn_in", "nodes_retested", readmitted=readmitted, evicted=[n for n in retest if n in verdict.evicted]
        )
    if len(verdict.healthy) < nodes.min:
        raise NodeUnhealthy(f"only {len(verdict.healthy)} healthy node(s), nodes.min is {nodes.min}:\n{table}")
    return BurnInResult(
        healthy=verdict.healthy,
        evicted=verdict.evicted,
        spare=verdict.spare,
        suspects=verdict.suspects,
        cleared=verdict.cleared,
        readmitted=readmitted,
        references={k: {p: r.value for p, r in refs.items()} for k, refs in verdict.references.items()},
    )


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


def _mark(run: Run, backend: Backend, verdict: Verdict, readmitted: list[str]) -> None:
    """Keep later runs off the evicted nodes, and let the re-admitted ones back (a backend with marks)."""
    if verdict.evicted and backend.marks is not None:
        marked = backend.exclude(list(verdict.evicted), reasons=verdict.evicted)
        run.ledger.append("burn_in", "nodes_marked", nodes=marked, label=backend.marks)
    if readmitted:
        backend.readmit(readmitted)
