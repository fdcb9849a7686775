"""OpenLineage names of the URIs a stage reads and writes, and the facets a stage operator returns."""

from __future__ import annotations

from trainyard.airflow.lineage import Lineage, dataset_name, operator_lineage
from trainyard.airflow.operators import PublishOperator


def test_names_follow_openlineage_naming() -> None:
    assert dataset_name("/data/hot/tokens/2026-11-28") == ("file", "/data/hot/tokens/2026-11-28")
    assert dataset_name("file:///data/cold/tokens") == ("file", "/data/cold/tokens")
    assert dataset_name("s3://trainyard-cold/tokens/2026-11-28") == ("s3://trainyard-cold", "tokens/2026-11-28")


def test_an_operator_returns_its_recorded_lineage_and_nothing_before() -> None:
    op = PublishOperator(task_id="publish", spec="unused.yaml", gate=None)
    assert op.get_openlineage_facets_on_complete(None) is None  # it never ran: nothing to claim
    op.lineage = Lineage(["/ckpt/step_000004"], ["s3://cold/checkpoints/p/step_000004.ab12"])
    facets = op.get_openlineage_facets_on_complete(None)
    assert [(d.namespace, d.name) for d in facets.inputs] == [("file", "/ckpt/step_000004")]
    assert [(d.namespace, d.name) for d in facets.outputs] == [("s3://cold", "checkpoints/p/step_000004.ab12")]
    assert operator_lineage(None) is None
