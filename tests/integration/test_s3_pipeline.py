"""A pipeline whose cold tier is S3, credentials from an Airflow connection, through ``airflow dags test``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from airflow_helpers import ROOT, TASKS, airflow, airflow_env, run_state, task_states

from trainyard.checkpoint import cold as cold_copies
from trainyard.protocol.shards import write_synthetic_corpus
from trainyard.storage import S3Tier

pytestmark = pytest.mark.integration
DATE = "2026-11-20"
SPEC = """\
schedule: "@daily"
dataset:
  source: s3://cold/tokens/{{ ds }}
  connection: trainyard_cold
  name: s3-tokens/{{ ds }}
  hot_capacity_gb: 0.1
  expectations: {min_shards: 2, min_tokens_per_shard: 1024, max_vocab: 256}
nodes: {count: 2}
pressure_test: {enabled: false}  # what S3 changes is staging and publishing; burn-in has tests of its own
training:
  args: {vocab-size: 256, seq-len: 32, d-model: 32, n-layers: 1, n-heads: 2}
  max_steps: 6
  global_batch: 8
  micro_batch: 2
  checkpoint_every: 3
checkpoint:
  cold: s3://cold/checkpoints
  connection: trainyard_cold
  lifecycle: {expire_days: 90}
"""


def test_s3_pipeline_with_airflow_connection(s3_server, tmp_path: Path) -> None:
    client = s3_server.client()
    if not client.bucket_exists("cold"):
        client.make_bucket("cold")
    cold = S3Tier(f"s3://cold/tokens/{DATE}", s3_server.settings)
    for shard in write_synthetic_corpus(tmp_path / "corpus", shards=3, tokens_per_shard=4096):
        cold.upload(shard, shard.name)

    dags = tmp_path / "dags"
    (dags / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", dags)
    (dags / "pipelines" / "s3_pretrain.yaml").write_text(SPEC)
    s = s3_server.settings
    secret = s3_server.secret_key
    conn = {
        "conn_type": "aws",
        "login": s3_server.access_key,
        "password": secret,
        "extra": {"endpoint_url": f"http://{s.endpoint}", "region_name": s.region},
    }
    env = airflow_env(tmp_path / "home", dags, AIRFLOW_CONN_TRAINYARD_COLD=json.dumps(conn))

    done = airflow(env, "dags", "test", "s3_pretrain", DATE)
    states = {t: st for t, (st, _) in task_states(env, "s3_pretrain", DATE).items()}
    assert states == dict.fromkeys(TASKS, "success"), done.stdout[-4000:]
    assert run_state(env, "s3_pretrain", DATE) == "success"

    published = S3Tier("s3://cold/checkpoints/s3_pretrain", s3_server.settings)
    copy = cold_copies.published(published)  # the pointer, written after the copy was verified
    keys = {o.key for o in published.list()}
    assert copy.startswith("step_000006.") and f"{copy}/manifest.json" in keys and f"{copy}/.metadata" in keys
    assert published.stat(f"{copy}/.metadata").sha256  # sha256 travels as metadata
    [rule] = [r for r in client.get_bucket_lifecycle("cold").rules if r.rule_id == "trainyard-s3_pretrain-checkpoints"]
    assert rule.expiration.days == 90 and rule.rule_filter.prefix == "checkpoints/s3_pretrain/"

    home = Path(env["TRAINYARD_HOME"])
    staged = home / "hot" / "s3-tokens" / DATE
    assert sorted(p.name for p in staged.glob("*.tok")) == sorted(o.key for o in cold.list())
    assert not list((staged / ".pins").iterdir())  # the report released the run's pin
    [run_dir] = (home / "runs" / "s3_pretrain").iterdir()
    assert json.loads((run_dir / "data_quality.json").read_text())["success"] is True
    # The secret never reaches a log, the ledger or the run folder.
    logs = [p for root in (Path(env["AIRFLOW_HOME"]) / "logs", run_dir) for p in root.rglob("*") if p.is_file()]
    assert logs and not [p for p in logs if secret in p.read_text(errors="replace")]
    assert secret not in done.stdout + done.stderr
