"""One Airflow DAG per pipeline spec in dags/pipelines/*.yaml (wiring only).

The word "DAG" above lets Airflow's safe-mode scan pick this file up.
"""

from pathlib import Path

from trainyard.airflow.dag_builder import build_dags

globals().update(build_dags(Path(__file__).parent / "pipelines"))
