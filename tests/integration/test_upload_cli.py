"""``trainyard upload`` and ``trainyard ls`` through the command's entry point, against SeaweedFS's S3 over HTTP."""

from __future__ import annotations

import hashlib
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest

from trainyard.cli import main
from trainyard.storage.s3 import S3Tier
from trainyard.storage.upload import PlainProgress, progress_for

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def aws_env(s3_server: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The chain's environment: keys and endpoint as a user exports them; nothing from this machine."""
    for name in ("AWS_PROFILE", "AWS_SHARED_CREDENTIALS_FILE", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_server.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_server.access_key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_server.secret_key)
    monkeypatch.setenv("AWS_REGION", "us-east-1")


def corpus(root: Path) -> dict[str, bytes]:
    files = {
        "a.tok": b"a" * 3000,
        "b.tok": b"b" * 5000,
        "nested/c.tok": b"c" * 7000,
        "nested/deeper/d.tok": b"d" * 11,
        "e.json": b"{}",
    }
    for key, data in files.items():
        (root / key).parent.mkdir(parents=True, exist_ok=True)
        (root / key).write_bytes(data)
    return files


def stored_bytes(s3_server: Any, bucket: str, name: str) -> bytes:
    response = s3_server.client().get_object(bucket, name)
    try:
        return bytes(response.read())
    finally:
        response.close()
        response.release_conn()


def summary(out: str) -> tuple[int, int]:
    m = re.search(r"uploaded (\d+) object\(s\) .*, skipped (\d+) already there", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def test_a_folder_goes_up_verified_and_a_second_run_sends_nothing(
    s3_server: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = corpus(tmp_path / "src")
    assert main(["upload", str(tmp_path / "src"), f"s3://{bucket}/data/v1", "--jobs", "3"]) == 0
    out = capsys.readouterr().out
    assert summary(out) == (5, 0)
    assert out.splitlines()[0] == "5 object(s), 0.0 MB to check"  # not a terminal: plain lines
    tier = S3Tier(f"s3://{bucket}/data/v1", s3_server.settings)
    assert sorted(o.key for o in tier.list()) == sorted(files)
    for key, data in files.items():
        stored = tier.stat(key)
        assert stored is not None and stored.sha256 == hashlib.sha256(data).hexdigest()
    assert stored_bytes(s3_server, bucket, "data/v1/nested/c.tok") == files["nested/c.tok"]

    assert main(["upload", str(tmp_path / "src"), f"s3://{bucket}/data/v1/"]) == 0
    assert summary(capsys.readouterr().out) == (0, 5)


def test_an_interrupted_upload_sends_only_what_is_missing_or_different(
    s3_server: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = corpus(tmp_path / "src")
    tier = S3Tier(f"s3://{bucket}/ds", s3_server.settings)
    tier.upload(tmp_path / "src" / "a.tok", "a.tok")  # what the interrupted run finished
    tier.upload(tmp_path / "src" / "nested" / "c.tok", "nested/c.tok")
    # Same size, other bytes (a half-updated dataset), and the same bytes without a sha256 (another tool's):
    # neither is trusted.
    (tmp_path / "other.tok").write_bytes(b"x" * 5000)
    tier.upload(tmp_path / "other.tok", "b.tok")
    s3_server.client().put_object(bucket, "ds/e.json", io.BytesIO(b"{}"), 2)

    assert main(["upload", str(tmp_path / "src"), f"s3://{bucket}/ds"]) == 0
    assert summary(capsys.readouterr().out) == (3, 2)  # a.tok and nested/c.tok stay as they were
    for key, data in files.items():
        assert stored_bytes(s3_server, bucket, f"ds/{key}") == data
        stored = tier.stat(key)
        assert stored is not None and stored.sha256 == hashlib.sha256(data).hexdigest()


def test_a_single_file_goes_under_its_name(
    s3_server: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "one.bin").write_bytes(b"1" * 100)
    # --endpoint-url wins over the environment, as with the aws CLI.
    assert main(["upload", str(tmp_path / "one.bin"), f"s3://{bucket}", "--endpoint-url", s3_server.url]) == 0
    assert summary(capsys.readouterr().out) == (1, 0)
    assert stored_bytes(s3_server, bucket, "one.bin") == b"1" * 100


def test_ls_prints_size_sha256_and_key_per_object(
    s3_server: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus(tmp_path / "src")
    assert main(["upload", str(tmp_path / "src"), f"s3://{bucket}/ds"]) == 0
    s3_server.client().put_object(bucket, "ds/foreign.bin", io.BytesIO(b"z" * 42), 42)
    capsys.readouterr()
    assert main(["ls", f"s3://{bucket}/ds"]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines == [
        ["3000", "sha256", "ds/a.tok"],
        ["5000", "sha256", "ds/b.tok"],
        ["2", "sha256", "ds/e.json"],
        ["42", "-", "ds/foreign.bin"],
        ["7000", "sha256", "ds/nested/c.tok"],
        ["11", "sha256", "ds/nested/deeper/d.tok"],
    ]


def test_an_airflow_connection_gives_endpoint_and_keys_and_results_print_as_json(
    s3_server: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    corpus(tmp_path / "src")
    # Nothing in the chain's environment: the connection alone, as a spec's dataset.connection is read.
    for name in ("AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    conn = {"conn_type": "aws", "login": s3_server.access_key, "password": s3_server.secret_key,
            "extra": {"endpoint_url": s3_server.url, "region_name": "us-east-1"}}  # fmt: skip
    monkeypatch.setenv("AIRFLOW_CONN_TRAINYARD_COLD", json.dumps(conn))
    argv = ["upload", str(tmp_path / "src"), f"s3://{bucket}/ds", "--connection", "trainyard_cold", "-o", "json"]
    assert main(argv) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)  # the progress lines went to stderr
    assert result["dest"] == f"s3://{bucket}/ds" and (result["uploaded"], result["skipped"]) == (5, 0)
    assert main(["ls", f"s3://{bucket}/ds", "--connection", "trainyard_cold", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert {o["key"]: (o["size"], o["sha256"]) for o in listed}["ds/b.tok"] == (5000, True) and len(listed) == 5


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["upload", "{src}", "s3://no-such-bucket-here/x"], "bucket 'no-such-bucket-here' does not exist"),
        (["upload", "{tmp}/missing", "s3://{bucket}/x"], "missing: no such file or folder"),
        (["upload", "{src}", "{bucket}/x"], "expected s3://bucket or s3://bucket/prefix"),
        (["upload", "{src}", "s3://{bucket}/x", "--jobs", "0"], "--jobs 0: must be at least 1"),
        (
            ["upload", "{src}", "s3://{bucket}/x", "--endpoint-url", "http://h:1/path"],
            "--endpoint-url: 'http://h:1/path' has a path",
        ),
        (["ls", "s3://no-such-bucket-here"], "bucket 'no-such-bucket-here' does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(
    s3_server: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    corpus(tmp_path / "src")
    filled = [a.format(src=tmp_path / "src", tmp=tmp_path, bucket=bucket) for a in argv]
    assert main(filled) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and says in err, err
    assert "Traceback" not in err and s3_server.secret_key not in err


def test_no_credentials_is_one_line_naming_the_fix(
    bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    corpus(tmp_path / "src")
    assert main(["upload", str(tmp_path / "src"), f"s3://{bucket}/x"]) == 3  # credentials: infrastructure
    err = capsys.readouterr().err
    assert err.startswith("trainyard upload: no S3 credentials found (tried the environment")
    assert len(err.strip().splitlines()) == 1 and "AWS_ACCESS_KEY_ID" in err and "AWS_PROFILE" in err


def test_plain_progress_lines_carry_objects_bytes_and_rate() -> None:
    out, now = io.StringIO(), [0.0]
    progress = PlainProgress(out, every_s=5, clock=lambda: now[0])
    progress.start(3, 3 << 20)
    now[0] = 2.0
    progress.advance(1 << 20, skipped=False)  # before the interval: no line
    now[0] = 6.0
    progress.advance(1 << 20, skipped=True)
    assert out.getvalue().splitlines() == ["3 object(s), 3.0 MB to check", "2/3 objects, 1.0 MB sent, 0.2 MB/s"]


def test_a_terminal_gets_a_progress_bar() -> None:
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert type(progress_for(Terminal())).__name__ == "BarProgress"
    assert isinstance(progress_for(io.StringIO()), PlainProgress)
