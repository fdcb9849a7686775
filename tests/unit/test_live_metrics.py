"""Live training metrics: where the supervisor says they go, and what rank 0 (and only rank 0) sends.

The export over the wire, in real runs, is in tests/integration/test_in_place.py (a world that regroups twice)
and tests/integration/test_custom_dag.py (an ``airflow dags test`` run)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, MetricsData

from trainyard.protocol.env import TrainEnv
from trainyard.protocol.live_metrics import INSTRUMENTS, otlp_endpoint, prometheus_name
from trainyard.runtime import live_metrics

COLLECTOR = "http://otel-collector:4318"


@pytest.mark.parametrize(
    "environ,endpoint",
    [
        ({}, None),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": COLLECTOR}, f"{COLLECTOR}/v1/metrics"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": f"{COLLECTOR}/"}, f"{COLLECTOR}/v1/metrics"),
        # The signal's own variable is used as it is, and wins (the OpenTelemetry specification's rules).
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://a:4318", "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://b/m"}, "http://b/m"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": COLLECTOR, "OTEL_METRICS_EXPORTER": "none"}, None),
        # gRPC for the traces alone leaves the metrics on HTTP.
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": COLLECTOR, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}, f"{COLLECTOR}/v1/metrics"),
    ],
)  # fmt: skip
def test_the_endpoint_is_the_one_the_opentelemetry_variables_name(environ: dict, endpoint: str | None) -> None:
    assert otlp_endpoint(environ) == endpoint


@pytest.mark.parametrize(
    "environ,says",
    [
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "OTLP/HTTP"),
        ({"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "http://u:secret@c:4318/v1/metrics"}, "credentials"),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4318"}, "http(s) URL"),
    ],
)
def test_what_training_cannot_use_is_refused_with_the_fix(environ: dict, says: str) -> None:
    with pytest.raises(ValueError, match=r"OTEL_[A-Z_]+") as refused:
        otlp_endpoint(environ)
    assert says in str(refused.value) and "secret" not in str(refused.value)


@pytest.mark.parametrize(
    "environ",
    [
        {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://otlp.example.com/v1/metrics?api_key=secret"},
        {"OTEL_EXPORTER_OTLP_ENDPOINT": "https://otlp.example.com/secret3f9a8b7c6d5e4f3a"},
        {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://hooks.example.com/T0001/B0002/secretXYZ/v1/metrics"},
        {"OTEL_EXPORTER_OTLP_METRICS_ENDPOINT": "https://otlp.example.com/v1/metrics#secret"},
    ],
)
def test_a_token_in_the_endpoints_query_or_path_never_reaches_the_pods(environ: dict) -> None:
    """Issue 49, hole 12: the endpoint is written into every pod spec as a plain value, so it may hold no token."""
    with pytest.raises(ValueError, match=r"OTEL_[A-Z_]+ must be a plain collector URL") as refused:
        otlp_endpoint(environ)
    assert "secret" not in str(refused.value) and "Secret" in str(refused.value)


def test_the_contract_refuses_a_url_the_exporter_could_not_use(tmp_path: Path) -> None:
    base = {"TRAINYARD_DATA_DIR": str(tmp_path), "TRAINYARD_CHECKPOINT_DIR": str(tmp_path), "TRAINYARD_MAX_STEPS": "1"}
    env = TrainEnv(data_dir=tmp_path, checkpoint_dir=tmp_path, max_steps=1, metrics_otlp=f"{COLLECTOR}/v1/metrics")
    assert TrainEnv.from_env({**base, **env.to_env()}).metrics_otlp == f"{COLLECTOR}/v1/metrics"
    with pytest.raises(ValueError, match="TRAINYARD_METRICS_OTLP must be an http"):
        TrainEnv.from_env({**base, "TRAINYARD_METRICS_OTLP": "file:///etc/passwd"})


def test_prometheus_names_are_the_instruments_with_underscores() -> None:
    assert prometheus_name("loss") == "trainyard_train_loss"
    assert prometheus_name("checkpoint_age_seconds") == "trainyard_train_checkpoint_age_seconds"


class Kept(MetricExporter):
    """The exports, kept in memory: {instrument name: value} per export."""

    def __init__(self) -> None:
        super().__init__()  # as the OTLP one
        self.exports: list[dict[str, float]] = []

    def export(self, metrics_data: MetricsData, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        points = {}
        for resource in metrics_data.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        points[metric.name] = point.value
        self.exports.append(points)
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        pass


def test_rank_0_sends_its_last_step_and_falls_silent_when_it_is_no_longer_rank_0(tmp_path: Path) -> None:
    ctx = TrainEnv(data_dir=tmp_path, checkpoint_dir=tmp_path, max_steps=9, attempt=2, progress_every_s=3600,
                   metrics_otlp=f"{COLLECTOR}/v1/metrics")  # fmt: skip
    kept = Kept()
    live = live_metrics.LiveMetrics(ctx, ctx.metrics_otlp or "", exporter=kept)
    live.observe(4, {"loss": 2.5, "step_ms": 250.0, "tokens_per_s": 8000, "lr": 0.1}, world_size=8, generation=3)
    live.provider.force_flush()
    name = {key: spec[0] for key, spec in INSTRUMENTS.items()}
    assert kept.exports[-1] == {
        name["step"]: 4,
        name["loss"]: 2.5,
        name["step_seconds"]: 0.25,
        name["tokens_per_second"]: 8000,
        name["world_size"]: 8,
        name["attempt"]: 2,
        name["regroups"]: 2,
    }  # fmt: skip (no checkpoint yet: no age)
    sent = len(kept.exports)
    live.silence()  # a regroup made another process rank 0
    live.close()
    assert not any(kept.exports[sent:]), kept.exports[sent:]  # no stale value repeated as if current
