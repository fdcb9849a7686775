"""The pressure test on local candidate nodes: one process each, on this machine.

The processes are the local backend's (``trainyard.backends.local.probes``);
what they run and the key each signs with are the pressure test's
(``trainyard.burnin.launch``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from trainyard.backends.local import probes
from trainyard.burnin.launch import probe_nodes
from trainyard.burnin.protocol import BurnInRun
from trainyard.burnin.sealing import KEY_ENV
from trainyard.burnin.verdict import Recheck
from trainyard.spec import PressureTestSpec


def candidate_env(
    node: str, key: str, parent: Mapping[str, str] | None = None, gpus: str | None = None
) -> dict[str, str]:
    """What a local candidate's process sees: the allowed part of the worker's environment, its name, its key,
    and its GPUs where the spec splits them (see ``trainyard.backends.local.probes.candidate_env``)."""
    return probes.candidate_env(node, {KEY_ENV: key}, parent, gpus)


def run_burn_in(
    candidates: list[str],
    cfg: PressureTestSpec,
    scratch: Path,
    log_dir: Path,
    drills: dict[str, tuple[str, float]],
    recheck: Callable[[BurnInRun], Recheck] | None = None,
    *,
    gpus_per_node: int = 0,
) -> BurnInRun:
    """Probe every candidate on this host; ``drills`` maps a node to (fault, factor) for rehearsals;
    ``gpus_per_node`` (``nodes.gpus_per_node``) gives each candidate its own GPUs, as training will."""
    return probe_nodes(probes.LocalProbes(gpus_per_node), candidates, cfg, scratch, log_dir, drills, recheck)
