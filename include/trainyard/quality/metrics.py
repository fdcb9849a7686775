"""The metric gate: a checkpoint's training history meets the spec's expectations.

Two forms of the same rules. ``metric_problems`` is plain Python and takes
microseconds, so the background validator runs it on every checkpoint while
training. ``check_metrics`` runs the rules as a great-expectations suite over
the loss history for the checkpoint gate and saves GX's result in the run
folder, where the import cost (seconds) does not slow training.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainyard.atomic import write_json_atomic
from trainyard.quality.gx import Suite, could_not_run, import_gx
from trainyard.spec import MetricExpectations

RESULT_FILE = "metric_quality.json"
SHOWN = 10
MAX_LOSS_FIELD = "checkpoint.expectations.max_loss"
"""Where a loss limit comes from unless its caller names another source (``trainyard ckpt verify --max-loss``)."""
History = Sequence[tuple[int, float]]
"""(step, loss) pairs in step order, up to the checkpoint's step."""


def spike_ratios(history: History, window: int) -> list[float | None]:
    """Each step's loss over the median of the ``window`` steps before it (None for the first steps)."""
    losses = [loss for _, loss in history]
    ratios: list[float | None] = []
    for i, loss in enumerate(losses):
        before = [x for x in losses[max(0, i - window) : i] if math.isfinite(x)]
        median = statistics.median(before) if len(before) >= 2 else None
        ratios.append(loss / median if median and math.isfinite(loss) else None)
    return ratios


def metric_problems(
    history: History, step: int, loss: float | None, expect: MetricExpectations, max_loss_from: str = MAX_LOSS_FIELD
) -> list[str]:
    """Why the checkpoint of ``step`` (with ``loss``) fails ``expect``; empty when it passes. ``max_loss_from``
    names where ``expect.max_loss`` came from, so a problem blames what the user can change."""
    problems = []
    if loss is None or not math.isfinite(loss):
        problems.append(f"loss at step {step} is {loss}, not a finite number")
    elif expect.max_loss is not None and loss > expect.max_loss:
        problems.append(f"loss {loss:.4f} at step {step} is above {max_loss_from} {expect.max_loss}")
    upto = [(s, v) for s, v in history if s <= step and v is not None]
    bad = [s for s, v in upto if not math.isfinite(v)]
    if bad:
        problems.append(f"loss was not finite at step(s) {', '.join(map(str, bad[:SHOWN]))}")
    if expect.max_spike_ratio is not None:
        spikes = [
            (s, r)
            for (s, _), r in zip(upto, spike_ratios(upto, expect.spike_window))
            if r and r > expect.max_spike_ratio
        ]
        if spikes:
            shown = ", ".join(f"step {s} ({r:.1f}x)" for s, r in spikes[:SHOWN])
            problems.append(f"loss spiked above {expect.max_spike_ratio}x its running median at {shown}")
    return problems


def check_metrics(history: History, step: int, expect: MetricExpectations, result_dir: Path | None = None) -> list[str]:
    """The same rules as a great-expectations suite over the history; the result is saved in ``result_dir``."""
    import pandas as pd

    upto = [(s, v) for s, v in history if s <= step]
    table = pd.DataFrame(
        {
            "step": [s for s, _ in upto],
            "loss": [v for _, v in upto],
            "finite": [math.isfinite(v) for _, v in upto],
            "spike_ratio": spike_ratios(upto, expect.spike_window),
        }
    )
    suite = Suite(import_gx())
    suite.add(
        "loss recorded for the checkpoint's step",
        "ExpectColumnValuesToBeInSet",
        None,
        column="step",
        value_set=[step],
        row_condition=f"step=={step}",
        condition_parser="pandas",
    )
    suite.add(
        "loss finite at every step",
        "ExpectColumnValuesToBeInSet",
        lambda row: f"step {row['step']} ({row['loss']})",
        column="finite",
        value_set=[True],
    )
    if expect.max_loss is not None:
        suite.add(
            f"loss at the checkpoint at most {MAX_LOSS_FIELD} {expect.max_loss}",
            "ExpectColumnValuesToBeBetween",
            lambda row: f"step {row['step']} (loss {row['loss']:.4f})",
            column="loss",
            max_value=expect.max_loss,
            row_condition=f"step=={step}",
            condition_parser="pandas",
        )
    if expect.max_spike_ratio is not None:
        suite.add(
            f"no loss spike above {expect.max_spike_ratio}x the running median of {expect.spike_window} steps",
            "ExpectColumnValuesToBeBetween",
            lambda row: f"step {row['step']} ({row['spike_ratio']:.1f}x)",
            column="spike_ratio",
            max_value=expect.max_spike_ratio,
        )
    result = suite.validate(table, "loss_history", "step", SHOWN)
    if result_dir is not None:
        write_json_atomic(Path(result_dir) / RESULT_FILE, result)
    if not upto or step not in {s for s, _ in upto}:
        return [f"no loss recorded for step {step} in the run ledger"]
    rows = {row["step"]: row for row in table.to_dict("records")}
    return [_problem(check, outcome, rows) for check, outcome in suite.failed(result)]


def _problem(check: Any, outcome: dict[str, Any], rows: dict[int, dict[str, Any]]) -> str:
    if (reason := could_not_run(outcome)) is not None:
        return f"{check.name}: could not be evaluated ({reason})"
    steps = [item["step"] for item in outcome["result"].get("partial_unexpected_index_list", [])]
    if check.detail is None or not steps:
        return check.name
    return f"{check.name}: " + ", ".join(check.detail(rows[s]) for s in steps[:SHOWN])
