"""The backend: the local backend's nodes, pool and probes, with attempts a trigger can be left to watch."""

from __future__ import annotations

from exitfiles.launcher import ExitFileLauncher
from trainyard.backends.local.backend import LocalBackend

NAME = "exitfiles"


class ExitFileBackend(LocalBackend):
    name = NAME
    defers = True
    wake_every_s: float | None = 120.0
    """Far from any phase of the test's run, which takes seconds: the trigger, not a wake, sees the ends."""
    trigger: str | None = "exitfiles.trigger.ExitFileTrigger"

    def launcher(self) -> ExitFileLauncher:  # type: ignore[override]
        return ExitFileLauncher(poll_s=0.2)
