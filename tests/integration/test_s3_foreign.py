"""Objects written by other tools (boto3, as `aws s3 cp` writes them) stage and verify.

Real boto3 writes to SeaweedFS's S3 over HTTP with path-style addressing; trainyard reads with its
own minio client. Each object is checked by the best thing it carries (S3 checksum, sha256 metadata,
MD5 ETag, multipart ETag), or trusted on its first fetch and checked against that record later.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest

from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.storage import S3Tier
from trainyard.storage.hot import JOURNAL, STAGED_MANIFEST
from trainyard.storage.s3retry import Retry
from trainyard.storage.staging import stage

pytestmark = pytest.mark.integration
FAST = Retry(attempts=3, backoff_s=0.05)
MiB = 1 << 20


def boto(s3_server, **config: Any):
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3",
        endpoint_url=s3_server.url,
        aws_access_key_id=s3_server.access_key,
        aws_secret_access_key=s3_server.secret_key,
        region_name="us-east-1",
        config=Config(s3={"addressing_style": "path"}, **config),
    )


def tier(s3_server, bucket: str, prefix: str, **kw: Any) -> S3Tier:
    return S3Tier(f"s3://{bucket}/{prefix}", s3_server.settings, retry=FAST, **kw)


def staged(hot: Path) -> dict[str, dict[str, Any]]:
    return json.loads((hot / STAGED_MANIFEST).read_text())["files"]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def b64_sha256(data: bytes) -> str:
    return base64.b64encode(hashlib.sha256(data).digest()).decode()


def multipart_upload(client, bucket: str, key: str, path: Path, **extra: Any) -> None:
    from boto3.s3.transfer import TransferConfig

    config = TransferConfig(multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB, max_concurrency=2)
    client.upload_file(str(path), bucket, key, Config=config, ExtraArgs=extra or None)


def uneven_multipart(client, bucket: str, key: str, data: bytes, cuts: list[int]) -> None:
    """Parts of unequal sizes (some tools stream with growing parts): no one part size recomputes the ETag."""
    upload = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    parts, start = [], 0
    for number, end in enumerate([*cuts, len(data)], 1):
        etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=number, Body=data[start:end])
        parts.append({"PartNumber": number, "ETag": etag["ETag"]})
        start = end
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload, MultipartUpload={"Parts": parts})


# writer -> (how the object is written, the check staging must use, how its digest starts)
WRITERS: dict[str, tuple[str, str]] = {
    "put-default": ("s3-checksum", "crc32:"),  # botocore 1.36+ sends a CRC32 by default
    "put-when-required": ("etag-md5", "md5:"),
    "put-sha256": ("s3-checksum", "sha256:"),
    "put-crc32c": ("s3-checksum", "crc32c:"),
    "multipart-default": ("s3-checksum", "crc32-composite:"),
    "multipart-when-required": ("etag-multipart", "md5-multipart:"),
    "multipart-sha256": ("s3-checksum", "sha256-composite:"),
    "multipart-crc32c": ("s3-checksum", "crc32c-composite:"),  # moto needs the crc32c package for it
    "multipart-crc64nvme": ("s3-checksum", "crc64nvme:"),  # FULL_OBJECT, as AWS adds to every new object
    "trainyard-put": ("s3-checksum", "sha256:"),
    "trainyard-multipart": ("sha256-metadata", "sha256:"),
}


# Where the server keeps no flexible checksums (Ceph RGW Pacific), staging falls back to what is left.
WITHOUT_CHECKSUMS: dict[str, tuple[str, str]] = {
    "put": ("etag-md5", "md5:"),
    "multipart": ("etag-multipart", "md5-multipart:"),
    "trainyard-put": ("sha256-metadata", "sha256:"),
    "trainyard-multipart": ("sha256-metadata", "sha256:"),
}


def expected_check(s3_server, writer: str) -> tuple[str, str]:
    if s3_server.keeps_checksums:
        return WRITERS[writer]
    return WITHOUT_CHECKSUMS.get(writer) or WITHOUT_CHECKSUMS[writer.split("-")[0]]


def write(s3_server, bucket: str, writer: str, key: str, data: bytes, tmp_path: Path) -> None:
    default, required = boto(s3_server), boto(s3_server, request_checksum_calculation="when_required")
    path = tmp_path / "src.bin"
    path.write_bytes(data)
    if writer == "put-default":
        default.put_object(Bucket=bucket, Key=key, Body=data)
    elif writer == "put-when-required":
        required.put_object(Bucket=bucket, Key=key, Body=data)
    elif writer == "put-sha256":
        default.put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="SHA256")
    elif writer == "put-crc32c":
        default.put_object(Bucket=bucket, Key=key, Body=data, ChecksumAlgorithm="CRC32C")
    elif writer == "multipart-default":
        multipart_upload(default, bucket, key, path)
    elif writer == "multipart-when-required":
        multipart_upload(required, bucket, key, path)
    elif writer == "multipart-sha256":
        multipart_upload(default, bucket, key, path, ChecksumAlgorithm="SHA256")
    elif writer == "multipart-crc32c":
        multipart_upload(default, bucket, key, path, ChecksumAlgorithm="CRC32C")
    elif writer == "multipart-crc64nvme":
        multipart_upload(default, bucket, key, path, ChecksumAlgorithm="CRC64NVME")
    else:
        prefix, _, name = key.partition("/")
        S3Tier(f"s3://{bucket}/{prefix}", s3_server.settings, part_size=5 * MiB, retry=FAST).upload(path, name)


@pytest.mark.parametrize("writer", sorted(WRITERS))
def test_objects_written_by_any_tool_stage_and_are_verified(s3_server, bucket: str, tmp_path: Path, writer) -> None:
    data = os.urandom(12 * MiB + 4321 if "multipart" in writer else 300_000)
    write(s3_server, bucket, writer, f"{writer}/shard.tok", data, tmp_path)
    hot = tmp_path / "hot"
    result = stage(tier(s3_server, bucket, writer), hot)
    assert (result.transferred, (hot / "shard.tok").read_bytes() == data) == (1, True)
    entry = staged(hot)["shard.tok"]
    how, digest = expected_check(s3_server, writer)
    assert (entry["check"], entry["digest"][: len(digest)]) == (how, digest), entry
    assert entry.get("sha256") == (sha256(data) if digest == "sha256:" else None)
    assert stage(tier(s3_server, bucket, writer), hot).transferred == 0


def test_trainyard_writes_sha256_metadata_and_an_s3_checksum(s3_server, bucket: str, tmp_path: Path) -> None:
    data = b"pointer" * 100
    tier(s3_server, bucket, "ty").write_bytes("PUBLISHED", data)
    head = boto(s3_server).head_object(Bucket=bucket, Key="ty/PUBLISHED", ChecksumMode="ENABLED")
    assert head["Metadata"]["sha256"] == sha256(data)
    assert head.get("ChecksumSHA256") == (b64_sha256(data) if s3_server.keeps_checksums else None)


CLAIMS = {
    "meta": {"Metadata": {"sha256": sha256(b"the old content")}},
    "sum": {"ChecksumAlgorithm": "SHA256", "ChecksumSHA256": b64_sha256(b"the old content")},
}


def refused_on_staging(server, bucket: str, tmp_path: Path, prefix: str) -> None:
    boto(server, request_checksum_calculation="when_required").put_object(
        Bucket=bucket, Key=f"{prefix}/bad.tok", Body=b"replaced content", **CLAIMS[prefix]
    )
    hot = tmp_path / "hot"
    with pytest.raises(DataError, match=rf"s3://{bucket}/{prefix}/bad\.tok: failed verification: .* says sha256:"):
        stage(tier(server, bucket, prefix), hot)
    assert not (hot / "bad.tok").exists() and not (hot / STAGED_MANIFEST).exists()
    assert sorted(p.name for p in hot.iterdir()) == [".last_used", JOURNAL]  # no temporary file left either


def test_an_object_whose_sha256_metadata_does_not_match_its_bytes_is_refused(
    s3_server, bucket: str, tmp_path: Path
) -> None:
    refused_on_staging(s3_server, bucket, tmp_path, "meta")


def test_an_object_whose_s3_checksum_does_not_match_its_bytes_is_refused(
    s3_server, bucket: str, moto_server, moto_bucket: str, tmp_path: Path
) -> None:
    """A real server checks the checksum on PUT and refuses the object (as SeaweedFS does here), so only
    moto, which keeps whatever checksum it is sent, can serve a stored object whose checksum is wrong
    (a store's corruption after the write)."""
    from botocore.exceptions import ClientError

    put = boto(s3_server, request_checksum_calculation="when_required").put_object
    if s3_server.keeps_checksums:
        with pytest.raises(ClientError, match="BadDigest"):
            put(Bucket=bucket, Key="sum/bad.tok", Body=b"replaced content", **CLAIMS["sum"])
    else:  # Ceph RGW Pacific ignores the claim and keeps no checksum: staging checks the MD5 ETag instead
        put(Bucket=bucket, Key="sum/bad.tok", Body=b"replaced content", **CLAIMS["sum"])
        result = stage(tier(s3_server, bucket, "sum"), tmp_path / "rgw")
        assert (result.transferred, staged(tmp_path / "rgw")["bad.tok"]["check"]) == (1, "etag-md5")
    refused_on_staging(moto_server, moto_bucket, tmp_path, "sum")


def test_an_object_with_nothing_to_check_is_trusted_once_then_checked_against_the_record(
    s3_server, bucket: str, tmp_path: Path
) -> None:
    if not s3_server.keeps_checksums:
        pytest.skip(
            "Ceph RGW Pacific ignores HEAD ?partNumber=, so an uneven multipart object's part sizes are guessed and"
            " it is refused (failed verification, with the re-upload hint) rather than trusted on first fetch"
        )
    data = os.urandom(12 * MiB)
    client = boto(s3_server, request_checksum_calculation="when_required")
    uneven_multipart(client, bucket, "raw/a.tok", data, [6 * MiB, 11 * MiB])
    hot, ledger = tmp_path / "hot", Ledger.in_dir(tmp_path / "run")
    stage(tier(s3_server, bucket, "raw"), hot, ledger=ledger)
    entry = staged(hot)["a.tok"]
    assert (entry["check"], entry["digest"], entry["sha256"]) == ("first-fetch", f"sha256:{sha256(data)}", sha256(data))
    [said] = [e for e in ledger.events("stage_dataset") if e["event"] == "trust_on_first_fetch"]
    assert (said["objects"], said["keys"]) == (1, ["a.tok"])

    (hot / "a.tok").unlink()  # the same version fetched again: checked against the record
    assert stage(tier(s3_server, bucket, "raw"), hot, ledger=ledger).transferred == 1
    assert staged(hot)["a.tok"]["check"] == "recorded" and (hot / "a.tok").read_bytes() == data
    assert len([e for e in ledger.events("stage_dataset") if e["event"] == "trust_on_first_fetch"]) == 1

    manifest = json.loads((hot / STAGED_MANIFEST).read_text())
    manifest["files"]["a.tok"]["digest"] = "sha256:" + "0" * 64  # a record that no longer matches the bytes
    (hot / STAGED_MANIFEST).write_text(json.dumps(manifest))
    (hot / "a.tok").unlink()
    with pytest.raises(
        DataError, match=rf"raw/a\.tok: failed verification: .*0000.*, the bytes give sha256:{sha256(data)}"
    ):
        stage(tier(s3_server, bucket, "raw"), hot)
    assert not (hot / "a.tok").exists()


def test_ranged_downloads_verify_foreign_objects_larger_than_a_part(s3_server, bucket: str, tmp_path: Path) -> None:
    if not s3_server.keeps_checksums:
        pytest.skip(
            "Ceph RGW Pacific ignores HEAD ?partNumber=, so an uneven multipart object's part sizes are guessed and"
            " it is refused (failed verification, with the re-upload hint) rather than trusted on first fetch"
        )
    default = boto(s3_server)
    required = boto(s3_server, request_checksum_calculation="when_required")
    objects = {
        name: os.urandom(12 * MiB + i) for i, name in enumerate(["put.tok", "multi.tok", "multi-sha.tok", "raw.tok"])
    }
    required.put_object(Bucket=bucket, Key="big/put.tok", Body=objects["put.tok"])
    for name, extra in [("multi.tok", {}), ("multi-sha.tok", {"ChecksumAlgorithm": "SHA256"})]:
        (tmp_path / name).write_bytes(objects[name])
        multipart_upload(default if extra else required, bucket, f"big/{name}", tmp_path / name, **extra)
    uneven_multipart(required, bucket, "big/raw.tok", objects["raw.tok"], [6 * MiB, 11 * MiB])
    hot = tmp_path / "hot"
    result = stage(tier(s3_server, bucket, "big", part_size=5 * MiB), hot)  # 3 ranges each
    assert result.transferred == 4
    assert {k: (hot / k).read_bytes() == v for k, v in objects.items()} == dict.fromkeys(objects, True)
    checks = {k: e["check"] for k, e in staged(hot).items()}
    # The server's HEAD gives the multipart object's composite sha256 with its type (COMPOSITE, -N), so it is
    # checked by it; an object whose parts carry no checksum, by its multipart ETag.
    assert checks == {
        "put.tok": "etag-md5",
        "multi.tok": "etag-multipart",
        "multi-sha.tok": "s3-checksum",
        "raw.tok": "first-fetch",
    }
    (hot / "raw.tok").unlink()
    stage(tier(s3_server, bucket, "big", part_size=5 * MiB), hot)
    assert staged(hot)["raw.tok"]["check"] == "recorded"


def test_ranged_download_refuses_a_corrupt_object_and_leaves_nothing(s3_server, bucket: str, tmp_path: Path) -> None:
    data = os.urandom(11 * MiB)
    boto(s3_server, request_checksum_calculation="when_required").put_object(
        Bucket=bucket, Key="bad/big.tok", Body=data, Metadata={"sha256": "1" * 64}
    )
    hot = tmp_path / "hot"
    with pytest.raises(DataError, match=r"bad/big\.tok: failed verification: x-amz-meta-sha256 says sha256:1111"):
        stage(tier(s3_server, bucket, "bad", part_size=5 * MiB), hot)
    assert sorted(p.name for p in hot.iterdir()) == [".last_used", JOURNAL]
