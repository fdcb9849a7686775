"""A node's burn-in report as the flat figures the verdict judges (``burnin.verdict``).

A report holds the host probes, the GPU's figures under ``gpu`` and, from
the pairwise link test, a bandwidth per partner; ``flatten`` makes one flat
mapping of them (the best link as ``LINK``), ``combine`` one report from a
node's turns (medians of rates, the worst turn of the GPU's counters), and
``round_figures`` every node's figures of one round. Pure.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Figures = Mapping[str, float]

LINK = "link_gbps"
"""The per-node figure of the pairwise link test: the best bandwidth the node reached with any partner.

A node with a slow link is slow with every partner; a healthy node is fast
with at least one, so the best pair localizes a slow link where one
all-reduce only says the ring is slow.
"""

GPU_FIGURES = {  # node report's "gpu" key -> flat figure
    "bf16_tflops": "bf16_tflops",
    "bf16_fraction_of_peak": "bf16_fraction_of_peak",
    "temperature_c": "gpu_temp_c",
    "ecc_uncorrected": "gpu_ecc_uncorrected",
    "throttle_mask": "gpu_throttle_mask",
}


def flatten(local: Mapping[str, Any] | None, links: Mapping[str, float] | None = None) -> dict[str, float]:
    """A node's report as flat figures: the host probes, the GPU's where it has one, and its best link."""
    local = local or {}
    flat = {k: float(v) for k, v in local.items() if k != "gpu" and _number(v)}
    gpu = local.get("gpu") or {}
    flat.update({name: float(gpu[key]) for key, name in GPU_FIGURES.items() if _number(gpu.get(key))})
    if links and len(links) >= 2:  # with one partner, a slow pair cannot say whose link it is
        flat[LINK] = max(links.values())
    return flat


def combine(reports: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One report from a node's turns: the median of each rate; for the GPU's counters the worst turn."""
    out: dict[str, Any] = dict(reports[-1])
    for key, value in reports[-1].items():
        if _number(value):
            out[key] = statistics.median(r[key] for r in reports if _number(r.get(key)))
    gpus = [r["gpu"] for r in reports if isinstance(r.get("gpu"), Mapping)]
    if gpus:
        gpu = dict(gpus[-1])
        for key, worst in GPU_WORST.items():
            values = [g[key] for g in gpus if _number(g.get(key))]
            if values:
                gpu[key] = worst(values)
        for key in ("bf16_tflops", "bf16_fraction_of_peak"):
            if values := [g[key] for g in gpus if _number(g.get(key))]:
                gpu[key] = statistics.median(values)
        out["gpu"] = gpu
    return out


def _or(values: list[Any]) -> int:
    mask = 0
    for v in values:
        mask |= int(v)
    return mask


GPU_WORST: dict[str, Callable[[list[Any]], Any]] = {"temperature_c": max, "ecc_uncorrected": max, "throttle_mask": _or}


def round_figures(
    local: Mapping[str, Mapping[str, Any]], links: Mapping[str, Mapping[str, float]]
) -> dict[str, dict[str, float]]:
    """Every node's flat figures of one round, from its local report and its link test."""
    return {n: flatten(local.get(n), links.get(n)) for n in sorted({*local, *links})}


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
