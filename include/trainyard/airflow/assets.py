"""The Airflow Assets trainyard pipelines produce."""

from __future__ import annotations

from airflow.sdk import Asset


def checkpoint_asset(dag_id: str) -> Asset:
    """Updated by a pipeline's publish task with each valid checkpoint it publishes.

    Downstream evaluation DAGs schedule on it; each event's extra carries the
    published URI, the step and the run id.
    """
    return Asset(name=f"trainyard.{dag_id}.checkpoint", uri=f"trainyard://checkpoints/{dag_id}")
