"""One pipeline run: its spec (with the trigger's Params), paths and ledger.

Every stage starts from ``open_run``; the Airflow layer only passes in the
identifiers Airflow knows (DAG id, run id, logical date, Params).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from trainyard.atomic import write_json_atomic
from trainyard.errors import SpecError
from trainyard.ledger import Ledger, run_dir, safe_name
from trainyard.spec import PipelineSpec, load_spec, with_params
from trainyard.storage import S3Settings, Tier, local_path, open_tier
from trainyard.templating import render

SNAPSHOT = "spec.json"


@dataclass(frozen=True)
class Run:
    spec: PipelineSpec
    spec_path: Path
    dag_id: str
    run_id: str
    ds: str
    connections: Callable[[str], S3Settings] | None = field(default=None, repr=False)
    """Resolves a connection id to S3 settings (Airflow connections); None: the environment."""

    def tier(self, uri: str, connection: str | None) -> Tier:
        if uri.startswith("s3://") and connection and self.connections:
            return open_tier(uri, self.connections(connection))
        return open_tier(uri)

    @property
    def holder(self) -> str:
        """Who pins hot-tier data for this run."""
        return f"{self.dag_id}/{self.run_id}"

    @property
    def variables(self) -> dict[str, str]:
        return {"ds": self.ds, "ds_nodash": self.ds.replace("-", ""), "dag_id": self.dag_id, "run_id": self.run_id}

    def resolve(self, field: str, text: str) -> str:
        """Fill a spec string's placeholders; a missing variable is a ``SpecError`` naming the field."""
        try:
            return render(text, self.variables)
        except KeyError as exc:
            raise SpecError([f"{self.spec_path}: {field}: {exc.args[0]}"]) from None

    @cached_property
    def dir(self) -> Path:
        root = local_path(self.resolve("runs_root", self.spec.runs_root))
        return run_dir(root, self.dag_id, self.run_id)

    @cached_property
    def ledger(self) -> Ledger:
        return Ledger.in_dir(self.dir)

    @property
    def source_uri(self) -> str:
        return self.resolve("dataset.source", self.spec.dataset.source)

    @property
    def hot_dataset_dir(self) -> Path:
        return self.hot_root / self.resolve("dataset.name", self.spec.dataset.name)

    @property
    def hot_root(self) -> Path:
        return Path(local_path(self.resolve("dataset.hot", self.spec.dataset.hot)))

    @property
    def checkpoint_root(self) -> Path:
        """The pipeline's checkpoints: shared by its runs, so each run can resume the last."""
        return Path(local_path(self.resolve("checkpoint.hot", self.spec.checkpoint.hot))) / safe_name(self.dag_id)

    @property
    def cold_checkpoint_uri(self) -> str:
        return self.resolve("checkpoint.cold", self.spec.checkpoint.cold).rstrip("/") + "/" + safe_name(self.dag_id)


def open_run(
    spec_path: str | Path,
    dag_id: str,
    run_id: str,
    ds: str,
    params: Mapping[str, Any] | None = None,
    connections: Callable[[str], S3Settings] | None = None,
) -> Run:
    """Load the spec, apply the trigger's Params, and snapshot both in the run folder once."""
    spec_path = Path(spec_path)
    spec = load_spec(spec_path)
    if params:
        spec = with_params(spec, params, spec_path)
    run = Run(spec=spec, spec_path=spec_path, dag_id=dag_id, run_id=run_id, ds=ds, connections=connections)
    snapshot = run.dir / SNAPSHOT
    if not snapshot.exists():
        write_json_atomic(snapshot, {
            "spec_file": str(spec_path), "params": dict(params or {}), "spec": spec.model_dump(mode="json"),
            "dag_id": dag_id, "run_id": run_id, "ds": ds,
        })
    return run
