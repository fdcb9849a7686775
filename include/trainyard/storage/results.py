"""What staging returns: ``StagingResult``, the one record of a stage of a dataset to the hot tier.

``storage.staging.stage`` returns it and the ``stage_dataset`` stage returns it as it is (its XCom; see
``pipeline.results``, which lists it among the stages' results). Frozen JSON values only, and this module
imports nothing but the standard library: the DAG file imports it at parse time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StagingResult:
    """``stage_dataset``: the cold objects copied to the hot tier."""

    hot_dir: str
    files: int
    bytes_total: int
    transferred: int
    """Files copied this time (the rest were staged and unchanged)."""
    bytes_transferred: int
    seconds: float
