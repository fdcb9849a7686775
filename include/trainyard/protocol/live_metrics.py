"""Live training metrics on the wire: their names, and where the training processes push them.

Airflow 3 sends its own metrics through OpenTelemetry to a collector the deployment runs, configured with the
standard ``OTEL_EXPORTER_OTLP_*`` variables (its ``[metrics] otel_host`` and ``otel_port`` are deprecated); the
collector is scraped by Prometheus or forwards on. Rank 0 of a training run pushes to that same collector over
OTLP/HTTP (``trainyard.runtime.live_metrics``), so one dashboard shows a pipeline's stages and its training
(``docker/observability/``). Push rather than a Prometheus endpoint to scrape: rank 0 is a process (on Kubernetes, a
pod) that lives for one attempt, on a node no scrape configuration knows. The supervisor resolves the endpoint
from its own environment (``otlp_endpoint``) and hands it on as ``TRAINYARD_METRICS_OTLP``.

On Prometheus (the collector's exporter, ``add_metric_suffixes: false``) a name's dots become underscores:
``trainyard.train.loss`` is ``trainyard_train_loss``, labelled ``pipeline``, ``run_id`` and ``node``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit

SERVICE = "trainyard-training"
# key of ``LiveMetrics.values`` -> (instrument name, unit, description). Gauges: each is the latest value.
INSTRUMENTS: dict[str, tuple[str, str, str]] = {
    "step": ("trainyard.train.step", "1", "the last step trained"),
    "loss": ("trainyard.train.loss", "1", "the loss of the last step"),
    "step_seconds": ("trainyard.train.step_seconds", "s", "how long the last step took"),
    "tokens_per_second": ("trainyard.train.tokens_per_second", "1/s", "tokens trained per second, last step"),
    "world_size": ("trainyard.train.world_size", "1", "ranks training now"),
    "attempt": ("trainyard.train.attempt", "1", "the attempt (1, then one more per relaunch)"),
    "regroups": ("trainyard.train.regroups", "1", "generations formed in place in this attempt after its first"),
    "checkpoint_age_seconds": (
        "trainyard.train.checkpoint_age_seconds", "s", "seconds since the newest committed checkpoint",
    ),
}  # fmt: skip
MIN_PERIOD_S = 1.0
EXPORT_TIMEOUT_S = 5.0  # one export, and the last one at exit: a collector that is down never holds the process


def otlp_endpoint(environ: Mapping[str, str]) -> str | None:
    """Where the training processes push their metrics: the OTLP/HTTP metrics URL that ``environ`` (the
    supervisor's) configures for OpenTelemetry, resolved as the SDK resolves it; None where it configures none.

    ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT`` is used as it is, ``OTEL_EXPORTER_OTLP_ENDPOINT`` gets ``/v1/metrics``
    (the OpenTelemetry specification's rules); ``OTEL_METRICS_EXPORTER=none`` sends none. ``ValueError`` with the
    fix for what the training processes cannot use: gRPC (they speak OTLP/HTTP), a URL that is not http(s), or
    one with credentials in it (it travels in their environment and in pod specs)."""
    if environ.get("OTEL_METRICS_EXPORTER", "").strip().lower() == "none":
        return None
    if specific := environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip():
        name, url = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", specific
    elif base := environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        name, url = "OTEL_EXPORTER_OTLP_ENDPOINT", base.rstrip("/") + "/v1/metrics"
    else:
        return None
    protocol = environ.get("OTEL_EXPORTER_OTLP_METRICS_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    if protocol.strip().lower() == "grpc":
        raise ValueError(
            "OTEL_EXPORTER_OTLP_PROTOCOL is grpc, but training pushes its live metrics over OTLP/HTTP: set "
            "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT to the collector's HTTP receiver (http://collector:4318/v1/metrics),"
            " or OTEL_METRICS_EXPORTER=none to send none"
        )
    return otlp_url(name, url)


def otlp_url(name: str, url: str) -> str:
    """``url`` if it is an http(s) URL with a host and no credentials in it; else ``ValueError`` naming ``name``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{name} must be an http(s) URL of an OTLP receiver (http://collector:4318/v1/metrics)")
    if parts.username or parts.password:  # it travels in the training processes' environment and pod specs
        raise ValueError(f"{name} must not hold credentials: the collector beside the nodes takes it without")
    # A token in the query or the path would be just as plain in every pod spec. Refused rather than moved
    # into a Secret: the ranks push to a collector beside the nodes, which needs no credentials, and the
    # collector holds the backend's (its exporter's headers); nothing secret then reaches the pods at all.
    if parts.query or parts.fragment or not all(_PLAIN.match(part) for part in parts.path.split("/") if part):
        raise ValueError(
            f"{name} must be a plain collector URL (no query string, a path of short lowercase words such as"
            " /v1/metrics): it is written into the training processes' environment and every pod spec, so a token"
            " in it would be too; point it at a collector beside the nodes that takes metrics without one, and"
            " give that collector the backend's token (its exporter's headers, from a Secret)"
        )
    return url


# A path part a collector's route uses (``v1``, ``metrics``, ``otlp``); longer, mixed-case or digit-heavy
# parts are what tokens look like. A heuristic: the query string, where tokens usually go, is refused whole.
_PLAIN = re.compile(r"(?=(?:[^0-9]*[0-9]){0,4}[^0-9]*\Z)[a-z0-9._-]{1,24}\Z")


def prometheus_name(key: str) -> str:
    """The name an instrument of ``INSTRUMENTS`` has on Prometheus, through the collector."""
    return INSTRUMENTS[key][0].replace(".", "_")
