"""The pressure test's launch, the same on every backend: one probe per candidate, started by the backend.

This module gives each candidate its arguments (``trainyard.burnin.args``) and
its per-run key (``trainyard.burnin.sealing``), hosts the store they meet on,
has the backend's ``ProbeSite`` start them (processes here, pods on a cluster)
and drives them through ``trainyard.burnin.protocol``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.backends.backend import Probe, ProbeRun, ProbeSite
from trainyard.burnin.args import Drill, node_args
from trainyard.burnin.sealing import KEY_ENV, node_key, run_secret
from trainyard.spec import PressureTestSpec

if TYPE_CHECKING:  # burnin.protocol imports torch: loaded when a test runs, not by building a pod
    from trainyard.burnin.protocol import BurnInRun, Schedule
    from trainyard.burnin.verdict import Recheck


def probe_of(
    node: str, run: ProbeRun, schedule: Schedule, cfg: PressureTestSpec, key: str, drill: Drill, log: Path
) -> Probe:
    """What candidate ``node`` runs: its protocol arguments, and its key in its environment (never in its args)."""
    args = node_args(node, run.store, schedule, cfg, run.scratch, run.timeout_s, drill)
    return Probe(node, args, {KEY_ENV: key}, log)


def probe_nodes(
    site: ProbeSite,
    names: Sequence[str],
    cfg: PressureTestSpec,
    scratch: Path | str,
    log_dir: Path,
    drills: Mapping[str, tuple[str, float]],
    recheck: Callable[[BurnInRun], Recheck] | None = None,
    run_id: str = "",
) -> BurnInRun:
    """Probe every node of ``names`` on ``site``; ``drills`` maps a node to (fault, factor) for rehearsals.

    ``run_id`` names a backend's objects (pods), unique across pipelines.
    """
    from trainyard.burnin.protocol import STARTUP_S, Schedule, host_store, run_protocol

    plan = Schedule.of(cfg, len(names), site.shared)
    store = host_store(site.bind)
    run = ProbeRun(run_id, f"{site.reach()}:{store.port}", str(scratch), plan.budget(cfg))
    secret = run_secret()
    keys = {node: node_key(secret, node) for node in names}
    probes = [
        probe_of(node, run, plan, cfg, keys[node], Drill(*drills.get(node, ("none", 0.0))), log_dir / f"{node}.log")
        for node in names
    ]
    candidates = site.start(probes, run)
    startup_s = site.startup_s(STARTUP_S, cfg.timeout_s)
    return run_protocol(store, candidates, cfg, startup_s, keys, recheck, shared=site.shared)
