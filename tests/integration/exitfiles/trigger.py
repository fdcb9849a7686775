"""The trigger: reads the attempt's exit files (the launcher's own read) and the heartbeats between wakes, and
judges each look with the one look every driver shares. It takes the watch, and serializes it as is."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from exitfiles.launcher import attempt_status
from trainyard.recovery.deferred import AttemptWatch
from trainyard.recovery.look import AS_REPORTED, TIMEOUT, Reads, look, report

CLASSPATH = "exitfiles.trigger.ExitFileTrigger"


class ExitFileTrigger(BaseTrigger):
    def __init__(self, watch: AttemptWatch | Mapping[str, Any]) -> None:
        super().__init__()
        self.watch = watch if isinstance(watch, AttemptWatch) else AttemptWatch.from_json(dict(watch))

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return CLASSPATH, {"watch": self.watch.to_json()}

    async def run(self) -> AsyncIterator[TriggerEvent]:
        watch, view = self.watch, self.watch.view()
        folder, every_s = Path(watch.handle["folder"]), float(watch.handle["poll_s"])
        deadline, pace = time.monotonic() + watch.wake_s, watch.progress_log(time.time())
        while True:
            status = await asyncio.to_thread(attempt_status, folder, watch.nodes)  # file reads off the loop
            found = await asyncio.to_thread(view.detect, status)
            if sight := look(view, Reads(status, found)):
                yield TriggerEvent(report(AS_REPORTED[sight.what], watch.attempt, status, sight.reason, sight.nodes))
                return
            if pace is not None and (line := await asyncio.to_thread(pace.poll, time.time())):
                self.log.info("%s", line)
            if time.monotonic() >= deadline:
                yield TriggerEvent(report(TIMEOUT, watch.attempt, status, f"still running after {watch.wake_s:.0f} s"))
                return
            await asyncio.sleep(min(every_s, deadline - time.monotonic()))
