"""What staging returns: ``StagingResult``, the one record of a stage of a dataset to the hot tier.

``storage.staging.stage`` returns it and the ``stage_dataset`` stage returns it as it is (its XCom; see
``pipeline.results``, which lists it among the stages' results). Frozen JSON values only, and this module
imports nothing but the standard library: the DAG file imports it at parse time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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
    extra_files: int = 0
    """Of ``files``, those named in ``dataset.files`` (not shards), verified against the spec."""
    unstaged: int = 0
    """Files at the source that the format does not stage and ``dataset.files`` does not name."""
    warnings: list[str] = field(default_factory=list)
    """An optional file missing, unstaged files at the source: said in the task log and carried to the data check."""
