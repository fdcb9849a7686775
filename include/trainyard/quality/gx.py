"""great-expectations plumbing shared by the data and metric gates.

GX is called directly (an ephemeral context, a pandas data source and a
whole-dataframe batch), not through the Airflow provider, so the gates stay
plain functions that tests and the CLI can run without Airflow. GX takes
seconds to import and DAG files import the gates indirectly, so it is only
imported when a gate runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pandas as pd


@dataclass(frozen=True)
class Check:
    """One expectation, the words an error uses for it, and how one offending row reads."""

    name: str
    expectation: Any
    detail: Callable[[dict[str, Any]], str] | None
    """None for a table-level check, where no single row is to blame."""


def import_gx() -> Any:
    """Import great-expectations quietly: its INFO logging is import-time noise in every task log."""
    gx_log = logging.getLogger("great_expectations")
    if gx_log.level == logging.NOTSET:  # a deployment that configured GX logging keeps its choice
        gx_log.setLevel(logging.WARNING)
    import great_expectations as gx

    # This one module pins its own logger to INFO (one line per context about a temporary docs
    # directory); let it follow the "great_expectations" level like the rest.
    logging.getLogger("great_expectations.data_context.types.base").setLevel(logging.NOTSET)
    return gx


class Suite:
    """Checks added in order; GX reorders results, so each carries its index in ``meta``."""

    def __init__(self, gx: Any):
        self.gx = gx
        self.checks: list[Check] = []

    def add(self, name: str, expectation: str, detail: Callable[[dict[str, Any]], str] | None, **kwargs: Any) -> None:
        made = getattr(self.gx.expectations, expectation)(
            description=name, meta={"trainyard_check": len(self.checks)}, **kwargs
        )
        self.checks.append(Check(name, made, detail))

    def validate(self, table: pd.DataFrame, name: str, index_column: str, shown: int) -> dict[str, Any]:
        """Run the suite over ``table`` in a fresh ephemeral context (a few ms; nothing touches disk)."""
        from great_expectations.data_context.types.base import ProgressBarsConfig

        context = self.gx.get_context(mode="ephemeral")
        # GX draws a tqdm bar per validation on stderr by default; in a task log that is noise.
        context.variables.progress_bars = ProgressBarsConfig(globally=False)
        asset = context.data_sources.add_pandas("trainyard").add_dataframe_asset(name)
        batch = asset.add_batch_definition_whole_dataframe("all").get_batch(batch_parameters={"dataframe": table})
        suite = self.gx.ExpectationSuite(name=f"trainyard_{name}")
        for check in self.checks:
            suite.add_expectation(check.expectation)
        # SUMMARY with an index column: the saved result names the first offending rows of each
        # expectation (and counts all of them) without listing every row.
        result_format = {
            "result_format": "SUMMARY",
            "unexpected_index_column_names": [index_column],
            "partial_unexpected_count": shown,
        }
        return batch.validate(suite, result_format=result_format).to_json_dict()

    def failed(self, result: dict[str, Any]) -> list[tuple[Check, dict[str, Any]]]:
        """The failed checks with their outcomes, in suite order."""
        failed = [r for r in result["results"] if not r["success"]]
        failed.sort(key=lambda r: r["expectation_config"]["meta"]["trainyard_check"])
        return [(self.checks[r["expectation_config"]["meta"]["trainyard_check"]], r) for r in failed]


def could_not_run(outcome: dict[str, Any]) -> str | None:
    """Why GX could not evaluate an expectation, or None if it could."""
    info = outcome["exception_info"]
    if info.get("raised_exception", True) is False:
        return None
    # A single expectation reports {"exception_message": ...}; a failed metric reports
    # {metric id: {"exception_message": ...}} instead.
    if "exception_message" in info:
        return str(info["exception_message"])
    return "; ".join(str(v.get("exception_message")) for v in info.values() if isinstance(v, dict)) or "unknown error"
