"""The fleet history: what every pressure test measured, one small file per node under the hot tier.

``<hot root>/.fleet/<node>.json`` holds the node's kind (on Kubernetes its
instance type and GPU product; locally this host), its last ``KEEP`` runs
(flat figures, verdict, whether a drill faked them) and when it was last
evicted and why. Only the orchestrator writes these files, whole and
atomically; a file that cannot be read is reported and ignored, never fatal:
history helps a verdict, it must not block one.

The verdict uses the history two ways: as the reference of a small or wholly
bad batch (``fleet_reference``), and as the cool-down of an evicted node
(``cooling``, ``due``): it sits out ``pressure_test.cooldown_h``, then a later
pressure test re-tests it and re-admits it when it passes.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainyard.atomic import read_json, write_json_atomic
from trainyard.events.ledger import safe_name

if TYPE_CHECKING:
    from trainyard.burnin.verdict import Verdict

log = logging.getLogger(__name__)

FLEET_DIR = ".fleet"
"""The history's folder under the hot root."""
KEEP = 20
"""Runs kept per node: enough for a stable median, small enough to follow a node's drift."""
MIN_SAMPLES = 3
"""Fewer healthy figures than this make no reference."""
HEALTHY = ("train", "spare")


@dataclass
class NodeHistory:
    node: str
    kind: str
    runs: list[dict[str, Any]] = field(default_factory=list)
    evicted_at: float | None = None
    """Epoch seconds of the last eviction that counts (not a drill's); ``None`` once re-admitted."""
    reason: str = ""

    def healthy_figures(self) -> list[dict[str, float]]:
        """Figures of runs it passed without a drill: what this node looks like when well."""
        return [r["figures"] for r in self.runs if r.get("verdict") in HEALTHY and not r.get("drill")]


def fleet_reference(histories: Iterable[NodeHistory], kind: str) -> dict[str, float]:
    """Probe -> median of every healthy figure of nodes of ``kind`` (probes with ``MIN_SAMPLES`` or more)."""
    values: dict[str, list[float]] = {}
    for history in histories:
        if history.kind != kind:
            continue
        for figures in history.healthy_figures():
            for probe, value in figures.items():
                values.setdefault(probe, []).append(value)
    return {p: statistics.median(v) for p, v in values.items() if len(v) >= MIN_SAMPLES}


class Fleet:
    """The history folder of one hot tier."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, node: str) -> Path:
        return self.root / f"{safe_name(node)}.json"

    def read(self, node: str) -> NodeHistory | None:
        path = self.path(node)
        return self._load(path, node) if path.exists() else None

    def all(self) -> list[NodeHistory]:
        if not self.root.is_dir():
            return []
        return [h for h in (self._load(path) for path in sorted(self.root.glob("*.json"))) if h is not None]

    def _load(self, path: Path, node: str | None = None) -> NodeHistory | None:
        """The history in ``path`` (``node``'s, where named); unreadable or another node's: logged, ``None``."""
        try:
            data = read_json(path)
            return _parse(data, str(data["node"]) if node is None else node)
        except (OSError, ValueError, TypeError, KeyError) as exc:
            log.warning("fleet history %s is unreadable (%s); left out", path, exc)
            return None

    def references(self, kinds: Iterable[str]) -> dict[str, dict[str, float]]:
        histories = self.all()
        return {kind: fleet_reference(histories, kind) for kind in set(kinds)}

    def cooling(self, nodes: Iterable[str], now: float, cooldown_s: float) -> dict[str, float]:
        """Node -> when its cool-down ends, for nodes still sitting out an eviction."""
        out = {}
        for node in nodes:
            history = self.read(node)
            if history and history.evicted_at is not None and now < history.evicted_at + cooldown_s:
                out[node] = history.evicted_at + cooldown_s
        return out

    def due(self, nodes: Iterable[str], now: float, cooldown_s: float) -> list[str]:
        """Nodes evicted once whose cool-down is over: this pressure test re-tests them."""
        return [
            n for n in nodes if (h := self.read(n)) and h.evicted_at is not None and now >= h.evicted_at + cooldown_s
        ]

    def record(
        self,
        node: str,
        kind: str,
        *,
        at: float,
        run_id: str,
        figures: Mapping[str, float] | None,
        verdict: str,
        reason: str = "",
        drill: str = "",
    ) -> NodeHistory:
        """Add this pressure test's outcome for ``node``; an eviction that is not a drill starts its cool-down."""
        history = self.read(node) or NodeHistory(node, kind)
        history.kind = kind
        history.runs = [
            *history.runs,
            {
                "at": iso(at),
                "run": run_id,
                "figures": {k: v for k, v in (figures or {}).items() if math.isfinite(v)},
                "verdict": verdict,
                **({"reason": reason} if reason else {}),
                **({"drill": drill} if drill else {}),
            },
        ][-KEEP:]
        if verdict == "evicted" and not drill:
            history.evicted_at, history.reason = at, reason
        elif verdict in HEALTHY:
            history.evicted_at, history.reason = None, ""
        self.root.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path(node), _dump(history))
        return history


def iso(epoch: float) -> str:
    """Epoch seconds as the history writes them (UTC, seconds)."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


def _epoch(text: str | None) -> float | None:
    return None if text is None else datetime.fromisoformat(text).timestamp()


def _dump(history: NodeHistory) -> dict[str, Any]:
    return {
        "node": history.node,
        "kind": history.kind,
        "runs": history.runs,
        "evicted_at": None if history.evicted_at is None else iso(history.evicted_at),
        "reason": history.reason,
    }


def _parse(data: Any, node: str) -> NodeHistory:
    if not isinstance(data, dict) or data.get("node") != node:
        raise ValueError(f"not the history of {node}")
    runs = [r for r in data.get("runs", []) if isinstance(r, dict) and isinstance(r.get("figures"), dict)]
    for run in runs:  # figures of a file someone edited by hand: numbers only
        run["figures"] = {
            str(k): float(v)
            for k, v in run["figures"].items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
        }
    return NodeHistory(
        node, str(data.get("kind", "")), runs[-KEEP:], _epoch(data.get("evicted_at")), str(data.get("reason", ""))
    )


def record_verdict(
    fleet: Fleet,
    verdict: Verdict,
    kinds: Mapping[str, str],
    *,
    at: float,
    run_id: str,
    drills: Mapping[str, tuple[str, float]],
) -> None:
    """Every candidate's outcome of one pressure test; a drilled node's figures are kept apart from the reference."""
    for node, figures in verdict.figures.items():
        state = verdict.state(node)
        drill = ":".join(map(str, drills[node])) if node in drills else ""
        if figures is None and drill:
            continue  # a drill's crash or hang says nothing of the node
        fleet.record(
            node,
            kinds.get(node, ""),
            at=at,
            run_id=run_id,
            figures=figures,
            verdict=state,
            reason=verdict.evicted.get(node, ""),
            drill=drill,
        )
