"""Airflow plugin: the training-runs view. Wiring only; the app is ``trainyard.airflow.views``.

The API server mounts the app at ``/trainyard``; two external views put it in
the UI: "Training runs" in the Browse menu (every run, per DAG), and a
"Training run" tab on each DAG run's page (that run). ``href`` values are
relative (no leading slash) so a base URL or proxy prefix is kept; the UI
fills ``{DAG_ID}`` and ``{RUN_ID}`` URL-encoded.
"""

from __future__ import annotations

from typing import Any, ClassVar

from airflow.plugins_manager import AirflowPlugin

from trainyard.airflow.views import URL_PREFIX, app

_HREF = URL_PREFIX.lstrip("/")


class TrainyardViewsPlugin(AirflowPlugin):
    name = "trainyard"
    fastapi_apps: ClassVar[list[dict[str, Any]]] = [
        {"app": app, "url_prefix": URL_PREFIX, "name": "trainyard training runs"}
    ]
    external_views: ClassVar[list[dict[str, Any]]] = [
        {
            "name": "Training runs",
            "href": f"{_HREF}/",
            "destination": "nav",
            "category": "browse",
            "url_route": "trainyard",
        },
        {
            "name": "Training run",
            "href": f"{_HREF}/runs/{{DAG_ID}}/{{RUN_ID}}",
            "destination": "dag_run",
            "url_route": "trainyard-run",
        },
    ]
