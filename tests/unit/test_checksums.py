"""Which check a download gets (a pure function of the response) and the digests that make it."""

from __future__ import annotations

import base64
import hashlib
import random
import zlib

import pytest

from trainyard.storage.checksums import (
    FIRST_FETCH,
    HEX_ALGORITHMS,
    Digester,
    PartDigest,
    choose_check,
    new_hasher,
    part_size_candidates,
    parts_to_infer,
)

MiB = 1 << 20
# Seeded: the digests appear in the test ids, which every pytest-xdist worker must collect alike.
DATA = random.Random(12345).randbytes(12 * MiB + 12345)
SIZE = len(DATA)
SHA = hashlib.sha256(DATA).hexdigest()
SHA_B64 = base64.b64encode(hashlib.sha256(DATA).digest()).decode()
MD5 = hashlib.md5(DATA).hexdigest()


def parts_of(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def of_parts(algo: str, data: bytes, size: int) -> bytes:
    """The checksum of the parts' checksums, computed the plain way (what S3 and boto3 do)."""
    raw = b"".join(hashlib.new(algo, p).digest() for p in parts_of(data, size))
    return hashlib.new(algo, raw).digest()


MULTI_ETAG = f'"{of_parts("md5", DATA, 5 * MiB).hex()}-3"'
COMPOSITE = base64.b64encode(of_parts("sha256", DATA, 5 * MiB)).decode() + "-3"
ALL = frozenset({"sha256", "sha1", "md5", "crc32", "crc32c", "crc64nvme"})


@pytest.mark.parametrize(
    ("headers", "etag", "recorded", "part_size", "algorithms", "how", "expected"),
    [
        # a FULL_OBJECT checksum wins over sha256 metadata and an MD5 ETag; sha256 is written in hex
        (
            {"x-amz-checksum-sha256": SHA_B64, "x-amz-checksum-type": "FULL_OBJECT", "x-amz-meta-sha256": "0" * 64},
            f'"{MD5}"',
            None,
            None,
            ALL,
            "s3-checksum",
            f"sha256:{SHA}",
        ),
        # header names in any case; a single-part object's checksum without a type is a full one
        ({"X-Amz-Checksum-CRC32C": "AAAAAA=="}, f'"{MD5}"', None, None, ALL, "s3-checksum", "crc32c:AAAAAA=="),
        # AWS's default on new objects, multipart ones too: a FULL_OBJECT CRC64NVME
        (
            {"x-amz-checksum-crc64nvme": "AAAAAAAAAAA=", "x-amz-checksum-type": "FULL_OBJECT"},
            MULTI_ETAG,
            None,
            None,
            ALL,
            "s3-checksum",
            "crc64nvme:AAAAAAAAAAA=",
        ),
        # the CRC cannot be computed here (no awscrt): the next best check
        ({"x-amz-checksum-crc32c": "AAAAAA=="}, f'"{MD5}"', None, None, HEX_ALGORITHMS, "etag-md5", f"md5:{MD5}"),
        # a COMPOSITE checksum with the part size the store said
        (
            {"x-amz-checksum-sha256": COMPOSITE, "x-amz-checksum-type": "COMPOSITE"},
            MULTI_ETAG,
            None,
            5 * MiB,
            ALL,
            "s3-checksum",
            f"sha256-composite:{COMPOSITE}",
        ),
        # ... and without it: the standard part sizes that make 3 parts are tried
        (
            {"x-amz-checksum-sha256": COMPOSITE},
            MULTI_ETAG,
            None,
            None,
            ALL,
            "s3-checksum",
            f"sha256-composite:{COMPOSITE}",
        ),
        # parts of unequal size (first part 4 MiB cannot make 3 parts): sha256 metadata instead
        (
            {"x-amz-checksum-sha256": COMPOSITE, "x-amz-meta-sha256": SHA},
            MULTI_ETAG,
            None,
            4 * MiB,
            ALL,
            "sha256-metadata",
            f"sha256:{SHA}",
        ),
        # COMPOSITE said but no -N, or a multipart object's checksum without a type (moto's HEAD): unused
        (
            {"x-amz-checksum-sha256": SHA_B64, "x-amz-checksum-type": "COMPOSITE", "x-amz-meta-sha256": SHA},
            MULTI_ETAG,
            None,
            5 * MiB,
            ALL,
            "sha256-metadata",
            f"sha256:{SHA}",
        ),
        (
            {"x-amz-checksum-sha256": SHA_B64},
            MULTI_ETAG,
            None,
            5 * MiB,
            ALL,
            "etag-multipart",
            f"md5-multipart:{MULTI_ETAG.strip(chr(34))}",
        ),
        # a malformed checksum is never half-trusted
        ({"x-amz-checksum-sha256": "not base64!"}, f'"{MD5}"', None, None, ALL, "etag-md5", f"md5:{MD5}"),
        ({"x-amz-checksum-crc32": "AAAAAAAA"}, f'"{MD5}"', None, None, ALL, "etag-md5", f"md5:{MD5}"),  # 6 bytes
        ({"x-amz-meta-sha256": SHA.upper()}, MULTI_ETAG, None, None, ALL, "sha256-metadata", f"sha256:{SHA}"),
        ({}, f'"{MD5}"', "sha256:" + "1" * 64, None, ALL, "etag-md5", f"md5:{MD5}"),
        # with SSE-KMS or SSE-C the ETag is no MD5 of the bytes
        ({"x-amz-server-side-encryption": "aws:kms"}, f'"{MD5}"', None, None, ALL, "first-fetch", None),
        ({"x-amz-server-side-encryption": "aws:kms:dsse"}, f'"{MD5}"', None, None, ALL, "first-fetch", None),
        (
            {"x-amz-server-side-encryption-customer-algorithm": "AES256"},
            f'"{MD5}"',
            None,
            None,
            ALL,
            "first-fetch",
            None,
        ),
        ({"x-amz-server-side-encryption": "AES256"}, f'"{MD5}"', None, None, ALL, "etag-md5", f"md5:{MD5}"),
        # a multipart ETag with the store's part size, or guessed ones
        ({}, MULTI_ETAG, None, 5 * MiB, ALL, "etag-multipart", f"md5-multipart:{MULTI_ETAG.strip(chr(34))}"),
        ({}, MULTI_ETAG, None, None, ALL, "etag-multipart", f"md5-multipart:{MULTI_ETAG.strip(chr(34))}"),
        # unequal parts and nothing else: the recorded digest, else trust on first fetch
        ({}, MULTI_ETAG, "sha256:" + "1" * 64, 7 * MiB, ALL, "recorded", "sha256:" + "1" * 64),
        ({}, MULTI_ETAG, None, 7 * MiB, ALL, "first-fetch", None),
        ({}, MULTI_ETAG, None, 0, ALL, "first-fetch", None),  # the store said its parts differ in size
        ({}, "not-an-md5", None, None, ALL, "first-fetch", None),
        ({}, None, None, None, ALL, "first-fetch", None),
        ({}, None, "xxh3-128:abc", None, ALL, "first-fetch", None),  # a record this process cannot recompute
    ],
)
def test_choose_check(headers, etag, recorded, part_size, algorithms, how, expected) -> None:
    check = choose_check(headers, etag, SIZE, recorded, part_size, algorithms)
    assert (check.how, check.expected) == (how, expected)


def test_the_best_check_alone_says_whether_the_part_size_is_worth_asking() -> None:
    assert parts_to_infer({}, MULTI_ETAG) == 3
    assert parts_to_infer({"x-amz-checksum-sha256": COMPOSITE}, f'"{MD5}"') == 3
    assert parts_to_infer({"x-amz-meta-sha256": SHA}, MULTI_ETAG) is None  # metadata beats the ETag
    assert parts_to_infer({"x-amz-checksum-sha256": SHA_B64}, f'"{MD5}"') is None
    assert parts_to_infer({"x-amz-server-side-encryption": "aws:kms"}, MULTI_ETAG) is None


def test_part_size_candidates_cut_exactly_n_parts() -> None:
    assert part_size_candidates(12 * MiB, 3) == (5 * MiB,)
    assert part_size_candidates(100 * MiB, 13) == (8 * MiB,)  # boto3's default
    assert part_size_candidates(100 * MiB, 7) == (16 * MiB,)
    assert part_size_candidates(12 * MiB, 1) == (12 * MiB,)
    assert part_size_candidates(12 * MiB, 40) == ()  # 300 KiB parts: no standard size


@pytest.mark.parametrize("part_size", [5 * MiB, 4 * MiB, 1 * MiB, SIZE])
def test_parts_digest_is_the_digest_of_the_part_digests(part_size: int) -> None:
    digest = PartDigest("md5", part_size)
    for block in parts_of(DATA, 1 << 20 | 7):  # blocks that straddle part boundaries
        digest.update(block)
    assert digest.finish() == (of_parts("md5", DATA, part_size), -(-SIZE // part_size))


def test_a_digester_computes_every_candidate_in_one_pass_and_records_the_match() -> None:
    check = choose_check({}, MULTI_ETAG, SIZE)
    digester = Digester(check)
    digester.update(DATA)
    assert digester.result() == check.expected
    wrong = choose_check({}, f'"{"0" * 32}-3"', SIZE)
    other = Digester(wrong)
    other.update(DATA)
    assert wrong.expected not in other.digests() and other.result() == f"md5-multipart:{MULTI_ETAG.strip(chr(34))}"
    composite = choose_check({"x-amz-checksum-sha256": COMPOSITE}, MULTI_ETAG, SIZE)
    parts = Digester(composite)
    parts.update(DATA)
    assert parts.digests() == [composite.expected]  # base64 with its -N, as S3 writes it
    first = Digester(FIRST_FETCH)
    first.update(DATA)
    assert first.result() == f"sha256:{SHA}"


# Check values of the CRC catalogue (reveng.sourceforge.io) for "123456789".
@pytest.mark.parametrize(
    ("algo", "value"), [("crc32", 0xCBF43926), ("crc32c", 0xE3069283), ("crc64nvme", 0xAE8B14860A799888)]
)
def test_crcs_match_their_catalogue_check_values_in_pieces(algo: str, value: int) -> None:
    hasher = new_hasher(algo)
    for piece in (b"1234", memoryview(b"56789")):
        hasher.update(piece)
    assert int.from_bytes(hasher.digest(), "big") == value
    whole = new_hasher("crc32")
    whole.update(DATA)
    assert algo != "crc32" or int.from_bytes(whole.digest(), "big") == zlib.crc32(DATA)
