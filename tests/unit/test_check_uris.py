"""A tier URI typed wrong is told what is wrong with it: the slashes, the scheme's case, the S3 bucket rule broken."""

from __future__ import annotations

import pytest

from trainyard.spec.uris import bucket_problem, uri_problems

S3 = ("file", "s3")


@pytest.mark.parametrize(
    "uri,expected",
    [
        ("s3:/bucket/x", "'s3:/bucket/x' has one slash after 's3:' where two belong (s3://...); write 's3://bucket/x'"),
        ("s3:bucket/x", "has no slash after 's3:'"),
        ("file:/data/x", "has one slash after 'file:' where two belong (file://...); write 'file:///data/x'"),
        ("S3://bucket/x", "write the scheme in lowercase (s3://)"),
        ("/data/tokens", "is a bare path; write it as a URI: file:///data/tokens"),
        ("http://host/x", "must start with file:// or s3:// (the scheme 'http' is not allowed here)"),
        ("tokens", "has no scheme; it must start with file:// or s3://"),
    ],
)
def test_a_mistyped_uri_is_told_what_to_write(uri: str, expected: str) -> None:
    [problem] = uri_problems(uri, S3)
    assert expected in problem, problem


@pytest.mark.parametrize(
    "bucket,rule",
    [
        ("My_Bucket", "only lowercase letters, digits, '.' and '-' ('My_Bucket' has 'BM_')"),
        ("ab", "3 to 63 characters long ('ab' has 2)"),
        ("x" * 64, "3 to 63 characters long"),
        ("-bucket", "starts and ends with a letter or digit"),
        ("my..bucket", "no two adjacent dots"),
        ("192.168.1.10", "not an IP address"),
        ("", "the bucket name is empty"),
    ],
)
def test_an_invalid_bucket_says_which_rule_it_breaks(bucket: str, rule: str) -> None:
    [problem] = uri_problems(f"s3://{bucket}/prefix", S3)
    assert problem.startswith(f"'s3://{bucket}/prefix' must name a valid bucket (s3://bucket/prefix): "), problem
    assert rule in problem, problem


@pytest.mark.parametrize("bucket", ["my-bucket", "a.b.c", "abc", "x" * 63, "${TMPDIR}", "b{{ ds_nodash }}"])
def test_valid_buckets_pass(bucket: str) -> None:
    assert bucket_problem(bucket) is None
