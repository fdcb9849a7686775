"""What the data gate returns: ``DataCheckResult``, the one record of a dataset that met its expectations.

``quality.dataset.check_dataset`` returns it and the ``check_dataset`` stage returns it as it is (its XCom;
see ``pipeline.results``, which lists it among the stages' results). Frozen JSON values only, and this
module imports nothing but the standard library: the DAG file imports it at parse time, and the gate
itself (GX, pandas, numpy) takes seconds to import.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DataCheckResult:
    """``check_dataset``: the staged files met the spec's expectations."""

    shards: int
    """Files of the dataset's format (``*.tok`` shards, token arrays, text files)."""
    non_empty: int
    tokens: int
    vocab_size: int
    """Token formats: the largest header vocab_size (``tok``) or largest token id + 1 (``numpy``); text: 0."""
    expectations: int
    """How many expectations great-expectations evaluated (all passed)."""
    seconds: float
    """Wall time of the check, GX import included (the bulk of it on a cold process)."""
    result: str | None
    """Where the GX validation result was saved, if anywhere."""
    format: str = "tok"
    """``dataset.format``: what ``shards`` counts."""
    documents: int = 0
    """Text formats: the documents sampled and checked."""
    extra_files: list[str] = field(default_factory=list)
    """The ``dataset.files`` found staged and as the spec says (size, sha256); not counted in ``shards``."""
    warnings: list[str] = field(default_factory=list)
    """What the check passed despite: an optional file missing, files left unstaged at the source (staging's)."""
