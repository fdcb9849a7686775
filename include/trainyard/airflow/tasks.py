"""Task adapters: Airflow context in, a library stage out, errors mapped.

Each adapter opens the run from the context Airflow passes and calls one
function of ``trainyard.stages``. Errors a retry cannot fix (a bad spec, bad
data, too few healthy nodes, an invalid checkpoint) fail the task with no
retry; the rest fail it normally, so the task's retries apply.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from airflow.sdk import Connection, get_current_context
from airflow.sdk.exceptions import AirflowFailException

from trainyard import stages
from trainyard.airflow.assets import checkpoint_asset
from trainyard.errors import FAIL_FAST
from trainyard.report.summary import format_summary, summarize
from trainyard.run import Run, open_run
from trainyard.spec import KubernetesSpec
from trainyard.storage.s3 import S3Settings, settings_for

log = logging.getLogger(__name__)


def _s3_settings(conn_id: str) -> S3Settings:
    """S3 endpoint and keys from an Airflow connection (type aws, ``endpoint_url`` in extra)."""
    return settings_for(Connection.get(conn_id))


def open_from_context(spec_path: str) -> Run:
    ctx = get_current_context()
    return open_run(spec_path, ctx["dag"].dag_id, ctx["run_id"], ctx["ds"], dict(ctx["params"]), connections=_s3_settings)


@contextmanager
def mapped_errors() -> Iterator[None]:
    try:
        yield
    except FAIL_FAST as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


def stage_dataset(spec_path: str) -> dict[str, Any]:
    with mapped_errors():
        return stages.stage_dataset(open_from_context(spec_path))


def check_dataset(spec_path: str) -> dict[str, Any]:
    with mapped_errors():
        return stages.check_dataset(open_from_context(spec_path))


def burn_in(spec_path: str) -> dict[str, Any]:
    with mapped_errors():
        run = open_from_context(spec_path)
        cluster = kube_client(run.spec.nodes.kubernetes) if run.spec.nodes.backend == "kubernetes" else None
        return stages.burn_in(run, cluster)


def kube_client(spec: KubernetesSpec | None) -> Any:
    """A ``kubernetes`` API client through the provider's hook and the spec's Airflow connection."""
    from airflow.providers.cncf.kubernetes.hooks.kubernetes import KubernetesHook

    hook = KubernetesHook(conn_id=spec.connection) if spec and spec.connection else KubernetesHook()
    return hook.api_client


def check_checkpoint(spec_path: str, train: dict[str, Any]) -> dict[str, Any]:
    with mapped_errors():
        return stages.check_checkpoint(open_from_context(spec_path), train["checkpoint"], train["target_step"])


def publish(spec_path: str, check_checkpoint: dict[str, Any]) -> dict[str, Any]:
    with mapped_errors():
        run = open_from_context(spec_path)
        result = stages.publish(run, check_checkpoint["checkpoint"])
    event = get_current_context()["outlet_events"][checkpoint_asset(run.dag_id)]
    event.extra = {"uri": result["uri"], "step": check_checkpoint["step"], "run_id": run.run_id}
    return result


def report(spec_path: str) -> dict[str, Any]:
    run = open_from_context(spec_path)
    result = stages.report(run)
    log.info("%s", format_summary({**summarize(run.ledger), "report": result["report"]}))
    return result
