"""Rank 0's live training metrics, pushed to the OpenTelemetry collector the deployment already runs (what
they are, where they go and why push: ``trainyard.protocol.live_metrics``).

Without ``TRAINYARD_METRICS_OTLP`` nothing is sent and the SDK is never imported. The process that is rank 0
exports the values of its latest step at most once per ``progress_every_s`` (the reader's period, one second
at the least) and once more when it finishes; any other rank exports nothing, and a rank that stops being rank
0 at a regroup falls silent. A collector that is down costs the exporter's own thread a bounded wait, never a
training step.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from trainyard.checkpoint.format import MANIFEST, list_checkpoints
from trainyard.protocol.live_metrics import EXPORT_TIMEOUT_S, INSTRUMENTS, MIN_PERIOD_S, SERVICE
from trainyard.runtime.process import RunContext, rank, world_size

log = logging.getLogger("trainyard.workload")


def checkpoint_age(ctx: RunContext, now: Callable[[], float] = time.time) -> float | None:
    """Seconds since the newest committed checkpoint of the run's lineage was committed (its manifest written)."""
    found = list_checkpoints(ctx.checkpoint_dir)
    if not found:
        return None
    try:
        return max(0.0, now() - (found[-1] / MANIFEST).stat().st_mtime)
    except OSError:  # set aside between the listing and the stat
        return None


class LiveMetrics:
    """The gauges of ``INSTRUMENTS`` on a meter provider of its own (a script's own OpenTelemetry setup is left
    alone), read by a periodic OTLP/HTTP reader. ``observe`` keeps the latest step's values; ``silence`` drops
    them (this process is no longer rank 0); ``close`` exports the last values and stops."""

    def __init__(self, ctx: RunContext, endpoint: str, exporter: Any = None):
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.resources import Resource

        self.ctx = ctx
        self.values: dict[str, float] = {}
        self._lock = threading.Lock()
        self.attributes = {"pipeline": ctx.pipeline, "run_id": ctx.run_id, "node": ctx.node or ""}
        period_ms = 1000 * max(MIN_PERIOD_S, ctx.progress_every_s)
        reader = PeriodicExportingMetricReader(
            exporter or OTLPMetricExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S),
            export_interval_millis=period_ms,
            export_timeout_millis=1000 * EXPORT_TIMEOUT_S,
        )
        self.provider = MeterProvider(metric_readers=[reader], resource=Resource.create({"service.name": SERVICE}))
        meter = self.provider.get_meter("trainyard.training")
        for key, (name, unit, description) in INSTRUMENTS.items():
            meter.create_observable_gauge(name, callbacks=[self._callback(key)], unit=unit, description=description)

    def _callback(self, key: str) -> Callable[[Any], Iterable[Any]]:
        from opentelemetry.metrics import Observation

        def observe(options: Any) -> Iterable[Any]:
            with self._lock:
                value = self.values.get(key)
            if key == "checkpoint_age_seconds" and self.values:
                value = checkpoint_age(self.ctx)
            return [] if value is None else [Observation(value, self.attributes)]

        return observe

    def observe(self, step: int, metrics: Mapping[str, Any], world_size: int, generation: int) -> None:
        """The values of ``step`` (``metrics`` as a heartbeat carries them: ``loss``, ``step_ms``,
        ``tokens_per_s``, each where the script reports it), in a world of ``world_size`` ranks."""
        values = {"step": float(step), "world_size": float(world_size), "attempt": float(self.ctx.attempt),
                  "regroups": float(max(0, generation - 1))}  # fmt: skip
        for key, source, scale in (("loss", "loss", 1.0), ("step_seconds", "step_ms", 1e-3),
                                   ("tokens_per_second", "tokens_per_s", 1.0)):  # fmt: skip
            if isinstance(value := metrics.get(source), int | float) and not isinstance(value, bool):
                values[key] = float(value) * scale
        with self._lock:
            self.values = values

    def silence(self) -> None:
        with self._lock:
            self.values = {}

    def close(self) -> None:
        try:
            self.provider.shutdown(timeout_millis=1000 * EXPORT_TIMEOUT_S)
        except Exception as exc:  # never the reason a finished run fails
            log.warning("live metrics: the last export failed: %s", exc)


_live: LiveMetrics | None = None
_broken = False
_generation = 1


def at_generation(number: int) -> None:
    """This process trains in generation ``number`` of its attempt (``regroups`` counts the ones after the first)."""
    global _generation
    _generation = number


def report(ctx: RunContext, step: int, metrics: Mapping[str, Any]) -> None:
    """A step of this process (``runtime.heartbeat``): rank 0 keeps it for the next export; another rank, silent."""
    global _live, _broken
    if ctx.metrics_otlp is None or _broken:
        return
    if rank() != 0:
        if _live is not None:
            _live.silence()
        return
    if _live is None:
        try:
            _live = LiveMetrics(ctx, ctx.metrics_otlp)
        except Exception as exc:  # a broken SDK install costs the metrics, never the run
            log.warning("live metrics off: %s", exc)
            _broken = True
            return
        atexit.register(close)
        log.info("live metrics: rank 0 pushes to %s every %.0f s", _redacted(ctx.metrics_otlp),
                 max(MIN_PERIOD_S, ctx.progress_every_s))  # fmt: skip
    _live.observe(step, metrics, world_size(), _generation)


def _redacted(url: str) -> str:
    """Scheme, host and port only: a path may carry a token some receivers take there."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.hostname}{f':{parts.port}' if parts.port else ''}"


def close() -> None:
    """Export the last step's values now and stop (``runtime.finish``: an in-place rank ends by ``os._exit``,
    which runs no ``atexit``)."""
    global _live
    live, _live = _live, None
    if live is not None:
        live.close()
