"""OpenLineage: what each stage read and wrote, as the OpenLineage provider's operator facets.

Data platforms collect lineage with OpenLineage; Airflow's OpenLineage provider asks each finished task's
operator for ``get_openlineage_facets_on_complete`` and sends what it returns through the configured
transport (``[openlineage] transport``: HTTP to Marquez, Kafka, a file, the console). trainyard's stages
answer with the datasets of the pipeline's chain, so the graph reads source -> staged copy -> checkpoint
-> published copy:

| stage | inputs | outputs |
| --- | --- | --- |
| stage_dataset | the cold source (``dataset.source``, rendered) | the staged copy on the hot tier |
| check_dataset | the staged copy | |
| train | the staged copy | the checkpoint it ended with |
| check_checkpoint | that checkpoint | |
| publish | that checkpoint | its write-once cold copy |

Names follow OpenLineage's naming: a local path is namespace ``file`` and the absolute path; an object
store is namespace ``s3://bucket`` and the key. Nothing is sent when OpenLineage is not configured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


@dataclass(frozen=True)
class Lineage:
    """The URIs a stage read and wrote in this run."""

    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)


def dataset_name(uri: str) -> tuple[str, str]:
    """OpenLineage's (namespace, name) of a URI or a local path."""
    parts = urlsplit(uri)
    if parts.scheme in ("", "file"):
        return "file", parts.path or uri
    return f"{parts.scheme}://{parts.netloc}", parts.path.lstrip("/")


def operator_lineage(lineage: Lineage | None) -> Any:
    """The provider's ``OperatorLineage`` of ``lineage``; None when the stage recorded none (it failed)."""
    if lineage is None:
        return None
    from airflow.providers.common.compat.openlineage.facet import Dataset
    from airflow.providers.openlineage.extractors import OperatorLineage

    def datasets(uris: list[str]) -> list[Any]:
        return [Dataset(namespace=ns, name=name) for ns, name in map(dataset_name, uris)]

    return OperatorLineage(inputs=datasets(lineage.inputs), outputs=datasets(lineage.outputs))
