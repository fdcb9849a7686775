"""An OTLP/HTTP metrics receiver on 127.0.0.1: what an OpenTelemetry collector's ``otlp`` receiver takes in.

Each POST to ``/v1/metrics`` is decoded with the OpenTelemetry protocol's own messages
(``ExportMetricsServiceRequest``) and kept as an ``Export``: when it came, and every gauge point in it.
"""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest


@dataclass
class Export:
    at: float
    service: str
    points: dict[str, list[tuple[float, dict[str, str]]]] = field(default_factory=dict)
    """Metric name -> (value, attributes) of each gauge point."""

    def value(self, name: str) -> float | None:
        found = self.points.get(name)
        return found[-1][0] if found else None


def decode(body: bytes) -> Export:
    request = ExportMetricsServiceRequest()
    request.ParseFromString(body)
    export = Export(time.monotonic(), "")
    for resource_metrics in request.resource_metrics:
        for attr in resource_metrics.resource.attributes:
            if attr.key == "service.name":
                export.service = attr.value.string_value
        for scope in resource_metrics.scope_metrics:
            for metric in scope.metrics:
                for point in metric.gauge.data_points:
                    value = point.as_double if point.HasField("as_double") else float(point.as_int)
                    attrs = {a.key: a.value.string_value for a in point.attributes}
                    export.points.setdefault(metric.name, []).append((value, attrs))
    return export


class OtlpReceiver:
    """``with OtlpReceiver() as receiver:`` ... ``receiver.url`` ... ``receiver.exports``."""

    def __init__(self) -> None:
        self.exports: list[Export] = []
        self.refused: list[str] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/metrics" or self.headers.get("Content-Type") != "application/x-protobuf":
                    receiver.refused.append(f"{self.path} {self.headers.get('Content-Type')}")
                    self.send_response(404)
                else:
                    receiver.exports.append(decode(body))
                    self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/metrics"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
