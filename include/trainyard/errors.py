"""Errors named by what to do about them (docs/architecture.md, rule 9).

The Airflow layer maps each class to fail-fast or retry; the CLI prints them as
one line. None of them should ever surface as a bare traceback.
"""

from __future__ import annotations


class TrainyardError(Exception):
    """Base class: a problem trainyard can explain in one sentence."""


class SpecError(TrainyardError):
    """The pipeline spec is wrong: fix the file. Carries one line per problem."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class DataError(TrainyardError):
    """The dataset is unusable (missing, empty, corrupt shard): fix the data."""


class ContentChanged(DataError):
    """A file's bytes are not the ones its caller expected (they changed since they were hashed): nothing was
    stored from it."""


class NodeUnhealthy(TrainyardError):
    """Too few nodes passed the pressure test to train."""


class CheckpointInvalid(TrainyardError):
    """A checkpoint failed validation; it must not be resumed from or published."""


class TransientError(TrainyardError):
    """Worth retrying as is: a server outage, a connection reset."""


class LineageBusy(TrainyardError):
    """Another run of the pipeline is training on the same checkpoints: wait for it to finish."""


class UsageError(TrainyardError):
    """A command line names something that is not there or not what the command takes (exit 2): fix the call."""


class InfrastructureError(TrainyardError):
    """S3, credentials, the network or Airflow failed a command (exit 3): fix them or wait, then run again."""


class TrainingFailed(TrainyardError):
    """A training attempt failed; ``kind`` says how, ``evidence`` says why we think so."""

    def __init__(self, message: str, kind: str = "unknown", evidence: str = ""):
        self.kind = kind
        self.evidence = evidence
        super().__init__(message)


# Which errors a retry cannot fix. The Airflow adapter fails these fast. A TrainingFailed that
# reaches it was already retried, scaled down or rolled back as far as the recovery policy allows.
FAIL_FAST = (SpecError, DataError, NodeUnhealthy, CheckpointInvalid, LineageBusy, TrainingFailed)
