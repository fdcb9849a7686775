"""Reports invalid specs in dags/pipelines/ as an Airflow import error of this file.

It builds no DAG. Kept apart from pipelines.py because Airflow hides every DAG
of a file that has an import error: one broken spec must not hide the others.
"""

from pathlib import Path

from trainyard.airflow.dag_builder import raise_spec_problems

raise_spec_problems(Path(__file__).parent / "pipelines")
