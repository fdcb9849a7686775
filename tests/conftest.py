"""Test-wide isolation: Airflow and trainyard homes in a temporary folder.

Set before anything imports Airflow, so no test touches a developer's
``~/airflow`` or the project's ``.airflow``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_HOME = Path(tempfile.mkdtemp(prefix="trainyard-tests-"))
os.environ["AIRFLOW_HOME"] = str(_HOME / "airflow")
os.environ["TRAINYARD_HOME"] = str(_HOME / "trainyard")
os.environ["AIRFLOW__CORE__DAGS_FOLDER"] = str(ROOT / "dags")
os.environ["AIRFLOW__CORE__LOAD_EXAMPLES"] = "False"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
