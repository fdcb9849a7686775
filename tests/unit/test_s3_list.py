"""A ListObjectsV2 page read for key, size and ETag: the forms stores answer in, and the answers that are refused."""

from __future__ import annotations

import pytest

from trainyard.errors import DataError
from trainyard.storage.s3list import parse_page
from trainyard.storage.tier import ObjectInfo

NS = ' xmlns="http://s3.amazonaws.com/doc/2006-03-01/"'


def page(contents: str, ns: str = NS, extra: str = "<IsTruncated>false</IsTruncated>") -> bytes:
    return f"<?xml version='1.0'?><ListBucketResult{ns}><Name>b</Name>{extra}{contents}</ListBucketResult>".encode()


def entry(key: str, size: int = 4, etag: str = '"e1"') -> str:
    return (
        f"<Contents><Key>{key}</Key><LastModified>2026-12-04T10:00:00.000Z</LastModified><ETag>{etag}</ETag>"
        f"<Size>{size}</Size><StorageClass>STANDARD</StorageClass></Contents>"
    )


@pytest.mark.parametrize("ns", [NS, ""], ids=["namespaced", "bare"])
def test_keys_sizes_and_etags_relative_to_the_base(ns: str) -> None:
    objects, token = parse_page(page(entry("ds/a.bin", 3) + entry("ds/sub/b.bin", 5, '"e2-3"'), ns), 3, "s3://b/ds/")
    assert objects == [ObjectInfo("a.bin", 3, "e1"), ObjectInfo("sub/b.bin", 5, "e2-3")] and token == ""


def test_url_encoded_keys_are_decoded_and_folder_markers_dropped() -> None:
    data = page(entry("ds/a+b%2Bc%C3%BC.bin") + entry("ds/folder/"), extra="<EncodingType>url</EncodingType>")
    objects, _ = parse_page(data, 3, "s3://b/ds/")
    assert [o.key for o in objects] == ["a b+cü.bin"]


def test_the_next_page_token_only_when_truncated() -> None:
    more = "<IsTruncated>true</IsTruncated><NextContinuationToken>t/1=</NextContinuationToken>"
    assert parse_page(page(entry("a"), extra=more), 0, "w")[1] == "t/1="
    last = "<IsTruncated>false</IsTruncated><NextContinuationToken>stale</NextContinuationToken>"
    assert parse_page(page(entry("a"), extra=last), 0, "w")[1] == ""


@pytest.mark.parametrize(
    "data,said",
    [
        (b"<html>502 Bad Gateway", "not XML"),
        (page(entry("a"), extra="<IsTruncated>true</IsTruncated>"), "no continuation token"),
        (page("<Contents><Key>a</Key><Size>1</Size></Contents>"), "without a key, size or ETag"),
        (page(entry("a").replace("<Size>4</Size>", "<Size>four</Size>")), "without a key, size or ETag"),
    ],
    ids=["not-xml", "truncated-without-token", "no-etag", "size-not-a-number"],
)
def test_an_answer_not_understood_is_a_clear_error(data: bytes, said: str) -> None:
    with pytest.raises(DataError, match=said) as caught:
        parse_page(data, 0, "s3://b/ds/")
    assert "s3://b/ds/" in str(caught.value)
