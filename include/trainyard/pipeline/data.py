"""The data stages: stage the cold shards to the hot tier (verified, incremental), then gate them."""

from __future__ import annotations

from dataclasses import asdict

from trainyard.errors import SpecError
from trainyard.events.fold import fold
from trainyard.events.ledger import safe_name
from trainyard.pipeline.recorder import recorded
from trainyard.pipeline.results import DataCheckResult, StagingResult
from trainyard.pipeline.run import Run
from trainyard.quality.dataset import check_dataset as _check_dataset
from trainyard.spec import FORMAT_SUFFIXES, Lifecycle, dataset_name_problems
from trainyard.storage import S3Tier, Tier
from trainyard.storage.boot import ensure_this_boot
from trainyard.storage.hot import HotRoom
from trainyard.storage.staging import stage


@recorded("stage_dataset")
def stage_dataset(run: Run) -> StagingResult:
    """Copy the cold shards to the hot tier, verified; only what changed is copied."""
    ds = run.spec.dataset
    # The spec check saw the template; this sees what it rendered to (e.g. a run id with a '/').
    if problems := dataset_name_problems(run.resolve("dataset.name", ds.name), ds.name):
        raise SpecError([f"{run.spec_path}: dataset.name: {p}" for p in problems])
    source = run.tier(run.source_uri, ds.connection)
    if ds.lifecycle:
        set_lifecycle(source, ds.lifecycle, f"trainyard-{run.dag_id}-data")
    capacity = int(ds.hot_capacity_gb * 1e9) if ds.hot_capacity_gb else None
    room = HotRoom(run.hot_root, capacity, run.holder)
    # tok stages the whole prefix, as before formats existed; the others only their own files.
    suffixes = None if ds.format == "tok" else FORMAT_SUFFIXES[ds.format]
    return stage(
        source, run.hot_dataset_dir, ledger=run.ledger, concurrency=ds.concurrency, room=room, suffixes=suffixes,
        files=ds.files,
    )  # fmt: skip


def set_lifecycle(tier: Tier, rule: Lifecycle, rule_id: str) -> None:
    # The spec check guarantees an s3:// URI wherever a lifecycle rule is set.
    assert isinstance(tier, S3Tier), tier
    tier.set_lifecycle(safe_name(rule_id), rule.expire_days, rule.transition_days, rule.storage_class)


@recorded("check_dataset")
def check_dataset(run: Run) -> DataCheckResult:
    """Fail fast (``DataError``) unless the staged shards meet the spec's expectations."""
    ensure_this_boot(run.hot_dataset_dir, run.ledger, "check_dataset")  # staged unsynced in an earlier boot?
    ds = run.spec.dataset
    # Staging's warnings (files left at the source, an optional file missing) are the data check's to show too.
    staged = fold(run.ledger.events()).results.get("stage_dataset") or {}
    result = _check_dataset(
        run.hot_dataset_dir, ds.expectations, result_dir=run.dir, format=ds.format, dtype=ds.dtype,
        text_column=ds.text_column, files=ds.files, warnings=[str(w) for w in staged.get("warnings") or []],
    )  # fmt: skip
    run.ledger.append("check_dataset", "dataset_checked", **asdict(result))
    return result
