"""Airflow plugin: the training-runs view. Wiring only; the app is ``trainyard.airflow.views``.

Registered by the installed package's ``airflow.plugins`` entry point (``pip install trainyard``: nothing to
copy). Where trainyard is not installed as a package (an Astro project, whose ``include/`` is on the path),
``plugins/trainyard_views.py`` registers the same class from the plugins folder; ``registered_by_package``
keeps the two from registering it twice.

The API server mounts the app at ``/trainyard``; two external views put it in
the UI: "Training runs" in the Browse menu (every run, per DAG), and a
"Training run" tab on each DAG run's page (that run). ``href`` values are
relative (no leading slash) so a base URL or proxy prefix is kept; the UI
fills ``{DAG_ID}`` and ``{RUN_ID}`` URL-encoded.
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

from airflow.plugins_manager import AirflowPlugin

from trainyard.airflow.views import URL_PREFIX, app

NAME = "trainyard"
_HREF = URL_PREFIX.lstrip("/")


class TrainyardViewsPlugin(AirflowPlugin):
    name = NAME
    # Class attributes, as AirflowPlugin declares them (its plugins manager reads them from the class).
    fastapi_apps: list[Any] = [  # noqa: RUF012
        {"app": app, "url_prefix": URL_PREFIX, "name": "trainyard training runs"}
    ]
    external_views: list[Any] = [  # noqa: RUF012
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


def registered_by_package() -> bool:
    """Whether an installed trainyard distribution registers the plugin through its entry point."""
    return any(ep.value.startswith(f"{__name__}:") for ep in entry_points(group="airflow.plugins", name=NAME))
