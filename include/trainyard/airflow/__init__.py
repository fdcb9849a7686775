"""The only Airflow-facing code: the DAG builder and the task adapters."""
