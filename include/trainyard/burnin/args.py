"""The arguments of one candidate's ``python -m trainyard.burnin.node``, local process or pod alike.

No ``kubernetes`` SDK here: the local pressure test builds the same arguments.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from trainyard.spec import PressureTestSpec

if TYPE_CHECKING:  # burnin.protocol imports torch; the orchestrator has it, this module's callers may not
    from trainyard.burnin.protocol import Schedule


@dataclass(frozen=True)
class Drill:
    fault: str = "none"
    factor: float = 0.0


NO_DRILL = Drill()


def node_args(
    node: str,
    store: str,
    schedule: Schedule,
    cfg: PressureTestSpec,
    scratch: str,
    timeout_s: float,
    drill: Drill = NO_DRILL,
) -> list[str]:
    """Arguments of ``python -m trainyard.burnin.node``: the same ones ``burnin.local`` passes."""
    return [
        "--node",
        node,
        "--store",
        store,
        "--collective-s",
        str(schedule.collective_s),
        "--size",
        str(cfg.matmul_size),
        "--membw-mb",
        str(cfg.membw_mb),
        "--disk-mb",
        str(cfg.disk_mb),
        "--sizes-kb",
        ",".join(map(str, cfg.collective_sizes_kb)),
        "--scratch",
        scratch,
        "--timeout",
        str(timeout_s),
        "--fault",
        drill.fault,
        "--factor",
        str(drill.factor),
    ]
