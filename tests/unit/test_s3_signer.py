"""The small GETs' own SigV4 signer gives exactly the request minio's ``sign_v4_s3`` signs: same headers, same
signature, for names that need quoting, HTTPS, session tokens and virtual-host URLs. (A wrong signature would not
fail a stage: the server's 403 sends the object down minio's path. This test is what keeps the fast path real.)"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from minio.signer import sign_v4_s3

from trainyard.storage.s3 import S3Tier
from trainyard.storage.s3auth import S3Settings
from trainyard.storage.s3get import CHECKSUM_MODE, _Signer

NAMES = ["ds/obj_00001.bin", "ds/a b+c~d=e&f.bin", "ds/ünï/こんにちは.txt", "ds/100%/x?y#z", "ds//double"]


def minio_request(tier: S3Tier, region: str, name: str, amz: str) -> dict[str, str]:
    """The headers minio sends for a GET of ``name`` at ``amz`` (its own URL, headers and signature)."""
    client = tier.client
    url = client._base_url.build(method="GET", region=region, bucket_name=tier.bucket, object_name=name)
    creds = client._provider.retrieve()
    headers, _ = client._build_headers(url.netloc, dict(CHECKSUM_MODE), None, creds)
    headers["x-amz-date"] = amz
    date = datetime.strptime(amz, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    signed = sign_v4_s3(
        method="GET",
        url=url,
        region=region,
        headers=headers,
        credentials=creds,
        content_sha256=str(headers["x-amz-content-sha256"]),
        date=date,
    )
    return {"request-target": url.path, **{k.lower(): str(v) for k, v in signed.items()}}


def ours(signer: _Signer, name: str) -> dict[str, str]:
    line, *lines = signer.request(name).decode("latin-1").split("\r\n")
    method, target, version = line.split(" ")
    assert (method, version) == ("GET", "HTTP/1.1") and lines[-2:] == ["", ""]
    return {"request-target": target, **{k.lower(): v for k, v in (h.split(": ", 1) for h in lines[:-2])}}


@pytest.mark.parametrize(
    "endpoint,token,region",
    [
        ("http://127.0.0.1:9000", None, "us-east-1"),
        ("https://s3.example.internal:8443", "a-session-token", "eu-west-3"),
        ("https://s3.amazonaws.com", None, "us-west-2"),  # AWS: virtual-host URLs, UNSIGNED-PAYLOAD
    ],
)
def test_each_request_is_signed_as_minio_signs_it(endpoint: str, token: str | None, region: str) -> None:
    settings = S3Settings.from_endpoint_url(endpoint, "AKIDEXAMPLE", "wJalr/K7MDENG+bPxRfiCY", region, token)
    tier = S3Tier("s3://my-bucket/ds", settings)
    signer = _Signer(tier.client, tier.bucket, region)
    assert signer.plain
    for name in NAMES:
        got = ours(signer, name)
        assert got == minio_request(tier, region, name, got["x-amz-date"])
    if token:
        assert got["x-amz-security-token"] == token


def test_new_credentials_are_signed_with(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refreshing credentials refresh: a key asked for at each request, as minio asks."""
    tier = S3Tier("s3://b/ds", S3Settings.from_endpoint_url("http://127.0.0.1:9000", "OLD", "old-secret", "r"))
    signer = _Signer(tier.client, tier.bucket, "r")
    assert "Credential=OLD/" in ours(signer, "ds/a")["authorization"]
    tier.client._provider = S3Settings.from_endpoint_url("http://127.0.0.1:9000", "NEW", "new-secret").credentials
    got = ours(signer, "ds/a")
    assert "Credential=NEW/" in got["authorization"] and got == minio_request(tier, "r", "ds/a", got["x-amz-date"])
