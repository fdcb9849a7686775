"""The training-runs view from the plugins folder, for deployments where trainyard is not an installed package.

An installed trainyard registers the plugin itself (entry point ``airflow.plugins``), and a second
registration would show in the UI as a plugin import error: then this file defines nothing.
"""

from __future__ import annotations

from trainyard.airflow.plugin import TrainyardViewsPlugin, registered_by_package

if registered_by_package():
    del TrainyardViewsPlugin
