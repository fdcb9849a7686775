"""``s3://`` tier through the ``minio`` SDK (MinIO, AWS S3, any S3-compatible store).

Every download is verified by the best check the object offers (its S3
checksum, trainyard's sha256 metadata, an MD5 ETag, or a digest recorded at
its first fetch: ``checksums.choose_check``), hashed once while it is written.
Uploads store the sha256 as user metadata (``x-amz-meta-sha256``) and, on a
single PUT, as an S3 checksum too. Large objects move in parallel byte ranges
(down) or parts (up). Every request is retried with jittered backoff within a
time budget, for the errors S3 documents as transient only (``s3retry``).
Where the store is and as whom to reach it: ``s3auth``.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import ssl
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import urllib3
from minio import Minio
from minio.commonconfig import ENABLED, Filter
from minio.error import S3Error
from minio.lifecycleconfig import Expiration, LifecycleConfig, Rule, Transition

from trainyard.atomic import open_new, temp_name
from trainyard.errors import DataError
from trainyard.storage.checksums import Check, available_algorithms, choose_check, parts_to_infer
from trainyard.storage.hashing import BLOCK, digest_file, settle, sha256_file, write_verified
from trainyard.storage.keys import check_key
from trainyard.storage.s3auth import S3Settings
from trainyard.storage.s3get import CHECKSUM_MODE, SMALL_GET, Job, SmallGets
from trainyard.storage.s3list import list_prefix
from trainyard.storage.s3put import SHA_META, Metadata, ReadHashing, digests_of, put_headers, stored_problems
from trainyard.storage.s3retry import Retry
from trainyard.storage.tier import Landed, ObjectInfo

log = logging.getLogger(__name__)
DEFAULT_RETRY = Retry()  # frozen: one shared default


def _pwrite_all(fd: int, data: bytes, offset: int) -> int:
    view = memoryview(data)
    while len(view):
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
    return offset


class S3Tier:
    def __init__(
        self,
        uri: str,
        settings: S3Settings,
        part_size: int = 16 << 20,
        parallel_parts: int = 4,
        retry: Retry = DEFAULT_RETRY,
    ):
        bucket, _, prefix = uri.removeprefix("s3://").partition("/")
        self.uri, self.bucket, self.prefix = uri, bucket, prefix.strip("/")
        self.part_size, self.parallel_parts, self.retry = part_size, parallel_parts, retry
        # The SDK's own retries stay short; ``Retry`` owns the bounded, logged backoff.
        # Room for every connection a stage opens at once (large objects' ranges plus the small-object pool),
        # so none is discarded and reopened per request.
        http = urllib3.PoolManager(
            maxsize=64,
            timeout=urllib3.Timeout(connect=5, read=60),
            retries=urllib3.Retry(total=1, backoff_factor=0.1, status_forcelist=[500, 502, 503, 504]),
        )
        self.client = Minio(
            settings.endpoint,
            credentials=settings.credentials,
            secure=settings.secure,
            region=settings.region,
            http_client=http,
        )
        # The TLS settings urllib3 gives the pool above (the system's CAs, certificates required).
        self.small = SmallGets(self.client, bucket, ssl.create_default_context() if settings.secure else None)

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""

        def listing() -> list[ObjectInfo]:
            return list(list_prefix(self.client, self.bucket, base, prefix))

        try:
            found = self.retry.call(f"list {self.uri}", listing)
        except S3Error as exc:
            if exc.code == "NoSuchBucket":
                raise DataError(f"{self.uri}: bucket {self.bucket!r} does not exist") from None
            raise
        return sorted(found, key=lambda o: o.key)

    def stat(self, key: str) -> ObjectInfo | None:
        try:
            st = self.retry.call(f"stat {key}", lambda: self.client.stat_object(self.bucket, self._name(key)))
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                return None
            raise
        if st.size is None or st.etag is None:  # minio types both as optional; a HEAD answer should have both
            raise DataError(f"{self.uri}/{key}: the server's answer has no size or ETag (is it S3-compatible?)")
        meta = {k.lower(): v for k, v in (st.metadata or {}).items()}
        return ObjectInfo(key, st.size, st.etag, meta.get(f"x-amz-meta-{SHA_META}"))

    def download(
        self, key: str, dest: Path, expect: ObjectInfo | None = None, durable: bool = True, split: bool = True
    ) -> Landed:
        """One object to ``dest``, verified by the best check its store offers (``checksums.choose_check``).

        ``durable``, ``split``: as ``Tier.download``."""
        check_key(key)
        if split and expect is not None and expect.size > self.part_size:
            return self._ranged(key, dest, expect, durable)
        return self.retry.call(f"download {self._name(key)}", lambda: self._whole(key, dest, expect, durable))

    def download_small(
        self, objects: Sequence[tuple[ObjectInfo, Path, Future[Landed]]], connections: int, durable: bool = True
    ) -> None:
        """Many small objects (each at most ``SMALL_GET``), ``connections`` requests at once on this thread's event
        loop (``s3get``); each ``(object, dest, done)``'s future gets what landed or the object's error. A future
        cancelled before its turn is skipped. ``durable``: as ``download``."""
        for obj, _, _ in objects:
            check_key(obj.key)  # refused before anything is asked (staging's ``key_path`` has refused it already)
            if obj.size > SMALL_GET:
                raise ValueError(f"{obj.key}: {obj.size} bytes is not a small object (at most {SMALL_GET})")
        jobs = [Job(obj, self._name(obj.key), dest, f"{self.uri}/{obj.key}", done) for obj, dest, done in objects]

        def check(job: Job, headers: Mapping[str, str]) -> Check:
            return self._check(job.name, headers, headers.get("etag"), job.obj.size, job.obj.digest)

        def slow(job: Job) -> Landed:  # anything but a plain 200: minio's path, with its errors and retries
            return self.download(job.obj.key, job.dest, job.obj, durable=durable)

        self.small.run(jobs, check, slow, connections, durable)

    def _check(self, name: str, headers: Mapping[str, str], etag: str | None, size: int, recorded: str | None) -> Check:
        algorithms = available_algorithms()
        parts = parts_to_infer(headers, etag, algorithms)
        part_size = self._part_size(name, size, parts) if parts and parts > 1 else None
        return choose_check(headers, etag, size, recorded, part_size, algorithms)

    def _part_size(self, name: str, size: int, parts: int) -> int | None:
        """The part size as the store says it (HEAD ``?partNumber=``), 0 if the parts differ in size,
        None if the store cannot say (then standard part sizes are tried)."""

        def part(number: int) -> int | None:
            try:
                st = self.client.stat_object(self.bucket, name, extra_query_params={"partNumber": str(number)})
            except S3Error:
                return None  # a store without per-part answers
            count = (st.metadata or {}).get("x-amz-mp-parts-count")
            if st.size is None or st.size >= size or (count is not None and count != str(parts)):
                return None  # the whole object came back: the store ignored partNumber
            return st.size

        first = part(1)
        if first is None:
            return None
        # Equal parts but the last: checked at both ends, since some tools grow their parts as they stream.
        return first if part(parts) == size - (parts - 1) * first else 0

    def _whole(self, key: str, dest: Path, expect: ObjectInfo | None, durable: bool = True) -> Landed:
        name = self._name(key)
        response = self.client.get_object(self.bucket, name, request_headers=dict(CHECKSUM_MODE))
        try:
            headers = response.headers
            size = expect.size if expect else int(headers.get("content-length") or 0)
            check = self._check(name, headers, headers.get("etag"), size, expect.digest if expect else None)
            return write_verified(
                response,
                dest,
                check,
                expect_size=expect.size if expect else None,
                where=f"{self.uri}/{key}",
                durable=durable,
            )
        finally:
            response.close()
            response.release_conn()

    def _ranged(self, key: str, dest: Path, expect: ObjectInfo, durable: bool = True) -> Landed:
        """Fetch byte ranges in parallel (each retried on its own) into one temporary file, then verify.

        A range answer carries no checksum, so the check is chosen from a HEAD with checksum mode, the
        ranges are pinned to that ETag (``If-Match``), and the assembled file is hashed once.
        """
        name, where = self._name(key), f"{self.uri}/{key}"
        st = self.retry.call(
            f"stat {name}", lambda: self.client.stat_object(self.bucket, name, extra_headers=dict(CHECKSUM_MODE))
        )
        if st.size != expect.size or not st.etag:
            raise DataError(f"{where}: {st.size} bytes now, {expect.size} when listed: it changed; stage again")
        size, etag = expect.size, st.etag
        headers = st.metadata or {}
        check = self.retry.call(f"stat {name}", lambda: self._check(name, headers, etag, size, expect.digest))
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(dest)
        try:
            with open_new(tmp) as out:
                out.truncate(size)
                fd = out.fileno()

                def once(offset: int, length: int) -> None:
                    response = self.client.get_object(
                        self.bucket, name, offset=offset, length=length, request_headers={"If-Match": f'"{etag}"'}
                    )
                    try:
                        written = offset
                        for chunk in response.stream(BLOCK):
                            written = _pwrite_all(fd, chunk, written)
                        if written != offset + length:  # retried: the next try rewrites the whole range
                            raise urllib3.exceptions.ProtocolError(
                                f"range {offset}+{length} of {key} ended after {written - offset} bytes"
                            )
                    finally:
                        response.close()
                        response.release_conn()

                def fetch(offset: int) -> None:
                    length = min(self.part_size, size - offset)
                    self.retry.call(f"download {name} bytes {offset}+{length}", lambda: once(offset, length))

                with ThreadPoolExecutor(self.parallel_parts) as pool:
                    list(pool.map(fetch, range(0, size, self.part_size)))
                if durable:
                    os.fsync(fd)
            landed = settle(check, digest_file(tmp, check), size, size, where)
            os.replace(tmp, dest)
            return landed
        except S3Error as exc:
            if exc.code == "PreconditionFailed":
                raise DataError(
                    f"{where}: changed while it was downloaded (ETag no longer {etag}); stage again"
                ) from None
            raise
        finally:
            tmp.unlink(missing_ok=True)

    def upload(self, src: Path, key: str, expect_sha256: str | None = None) -> tuple[int, str]:
        """Upload ``src`` with its sha256 as metadata and, where one PUT carries it, as an S3 checksum.

        With ``expect_sha256`` (a checkpoint's manifest says it) the file is read once: hashed as minio reads
        it to send (``s3put.ReadHashing``: its sha256, and the MD5s the store's ETag is checked against), and a
        file that does not give it is refused at its last byte, before the PUT or the multipart completion
        (minio then aborts the upload): nothing is stored. Without it, the file is hashed first.

        A multipart upload carries the metadata only: minio 7.2 sends no per-part checksums and its
        CompleteMultipartUpload lists no part checksums, which S3 requires once an algorithm is
        declared. AWS S3 adds its own FULL_OBJECT CRC64NVME to such objects, which downloads check.
        """
        check_key(key)
        size = src.stat().st_size
        sha = expect_sha256 or sha256_file(src)
        part_size = max(self.part_size, 5 << 20)
        multipart = size > part_size
        headers: Metadata = {SHA_META: sha} if multipart else put_headers(sha)

        def put() -> tuple[int, str]:
            with open(src, "rb") as fh:
                sent = ReadHashing(fh, size, part_size, sha, f"{self.uri}/{key}", src)
                self.client.put_object(
                    self.bucket,
                    self._name(key),
                    sent,  # type: ignore[arg-type]  # minio only calls its read()
                    size,
                    metadata=headers,
                    part_size=part_size,
                    num_parallel_uploads=self.parallel_parts,
                )
            self._verify_stored(key, size, sha, sent.digests_for, part_size if multipart else None)
            return size, sha

        return self.retry.call(f"upload {self._name(key)}", put)

    def write_bytes(self, key: str, data: bytes) -> None:
        # One PUT is atomic in S3: readers get the previous object or this one, never a mix.
        check_key(key)
        sha = hashlib.sha256(data).hexdigest()

        def put() -> None:
            self.client.put_object(self.bucket, self._name(key), io.BytesIO(data), len(data), metadata=put_headers(sha))
            self._verify_stored(key, len(data), sha, lambda check: digests_of(check, data))

        self.retry.call(f"write {self._name(key)}", put)

    def _verify_stored(
        self, key: str, size: int, sha: str, written: Callable[[Check], Sequence[str]], part_size: int | None = None
    ) -> None:
        """The stored object has the size, sha256 metadata and (if the store keeps one) sha256 checksum written,
        and the bytes written give the digest the store answers with, as a download would check them
        (``s3put.stored_problems``)."""
        st = self.client.stat_object(self.bucket, self._name(key), extra_headers=dict(CHECKSUM_MODE))
        meta = {k.lower(): v for k, v in (st.metadata or {}).items()}
        if problems := stored_problems(meta, st.size, st.etag, size, sha, written, part_size):
            raise DataError(f"{self.uri}/{key}: the stored object differs from what was written: {'; '.join(problems)}")

    def read_bytes(self, key: str, limit: int = 1 << 20) -> bytes | None:
        check_key(key)

        def get() -> bytes:
            response = self.client.get_object(self.bucket, self._name(key))
            try:
                return response.read(limit)
            finally:
                response.close()
                response.release_conn()

        try:
            return self.retry.call(f"read {self._name(key)}", get)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                return None
            raise

    def set_lifecycle(
        self, rule_id: str, expire_days: int | None, transition_days: int | None, storage_class: str | None
    ) -> None:
        """Expire or transition objects under this tier's prefix; other rules of the bucket are kept."""
        try:
            current = self.client.get_bucket_lifecycle(self.bucket)
        except S3Error as exc:
            if exc.code != "NoSuchLifecycleConfiguration":
                raise
            current = None
        rules = [r for r in (current.rules if current else []) if r.rule_id != rule_id]
        rules.append(
            Rule(
                ENABLED,
                rule_filter=Filter(prefix=f"{self.prefix}/" if self.prefix else ""),
                rule_id=rule_id,
                expiration=Expiration(days=expire_days) if expire_days else None,
                transition=Transition(days=transition_days, storage_class=storage_class) if transition_days else None,
            )
        )
        self.client.set_bucket_lifecycle(self.bucket, LifecycleConfig(rules))
        log.info(
            "lifecycle rule %s on %s: expire after %s days, transition after %s days to %s",
            rule_id,
            self.uri,
            expire_days,
            transition_days,
            storage_class,
        )
