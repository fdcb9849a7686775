"""S3Tier.stat on an answer without size or ETag: a DataError that names the object, never a bad ObjectInfo."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from trainyard.errors import DataError
from trainyard.storage.s3 import S3Tier
from trainyard.storage.s3auth import S3Settings
from trainyard.storage.s3retry import Retry
from trainyard.storage.tier import ObjectInfo


def tier_answering(**answer: object) -> S3Tier:
    # Minio connects on the first request only; the client is replaced before any.
    tier = S3Tier(
        "s3://bucket/data", S3Settings.from_endpoint_url("http://127.0.0.1:9", "k", "s"), retry=Retry(attempts=1)
    )
    tier.client = SimpleNamespace(stat_object=lambda bucket, name: SimpleNamespace(**answer))
    return tier


def test_a_full_answer_is_the_object_info() -> None:
    tier = tier_answering(size=3, etag="e", metadata={"X-Amz-Meta-Sha256": "abc"})
    assert tier.stat("a.bin") == ObjectInfo("a.bin", 3, "e", "abc")


@pytest.mark.parametrize("answer", [{"size": None, "etag": "e"}, {"size": 3, "etag": None}])
def test_an_answer_without_size_or_etag_is_a_data_error(answer: dict[str, object]) -> None:
    with pytest.raises(DataError, match=r"^s3://bucket/data/a\.bin: the server's answer has no size or ETag"):
        tier_answering(metadata=None, **answer).stat("a.bin")
