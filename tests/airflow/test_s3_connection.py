"""The task adapter's S3 settings from an Airflow connection (``AIRFLOW_CONN_<ID>``, as in a deployment)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from minio.credentials import StaticProvider

from trainyard.airflow.tasks import _s3_settings
from trainyard.errors import FAIL_FAST, SpecError
from trainyard.storage.s3auth import ChainProvider


def test_a_connection_without_a_login_gives_its_endpoint_and_the_credential_chain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    extra = {"endpoint_url": "http://127.0.0.1:9000", "region_name": "eu-west-1", "profile_name": "datasets"}
    monkeypatch.setenv("AIRFLOW_CONN_COLD_CHAIN", json.dumps({"conn_type": "aws", "extra": extra}))
    s = _s3_settings("cold_chain")
    assert (s.endpoint, s.secure, s.region) == ("127.0.0.1:9000", False, "eu-west-1")
    assert isinstance(s.credentials, ChainProvider) and "profile 'datasets'" in repr(s.credentials)


def test_a_connection_with_a_login_uses_it(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = {
        "conn_type": "aws",
        "login": "AKIACONN",
        "password": "conn-secret",
        "extra": {"endpoint_url": "https://s3.example.com"},
    }
    monkeypatch.setenv("AIRFLOW_CONN_COLD_KEYS", json.dumps(conn))
    s = _s3_settings("cold_keys")
    assert (s.endpoint, s.secure) == ("s3.example.com", True) and isinstance(s.credentials, StaticProvider)
    assert s.credentials.retrieve().access_key == "AKIACONN" and "conn-secret" not in repr(s)


def test_a_missing_connection_fails_fast_saying_how_to_add_it() -> None:
    with pytest.raises(
        SpecError, match=r"connection 'nowhere_cold' is not defined: .*AIRFLOW_CONN_NOWHERE_COLD"
    ) as caught:
        _s3_settings("nowhere_cold")
    assert isinstance(caught.value, FAIL_FAST)  # a retry would not make it appear


def test_the_s3_example_mounted_beside_the_stack_pipelines_is_one_more_dag(tmp_path: Path) -> None:
    # What the compose stack's dag-processor sees: the image's dags/pipelines plus the mounted example.
    import shutil

    from trainyard.airflow.dag_builder import build_dags

    root = Path(__file__).resolve().parents[2]
    shutil.copytree(root / "dags" / "pipelines", tmp_path / "pipelines")
    shutil.copy(root / "examples" / "specs" / "s3_pretrain.yaml", tmp_path / "pipelines")
    dags = build_dags(tmp_path / "pipelines")
    assert set(dags) == {"nightly_pretrain", "finetune_manual", "s3_pretrain"}
    assert "stage_dataset" in dags["s3_pretrain"].task_ids and dags["s3_pretrain"].schedule is None
