"""``s3://`` tier through the ``minio`` SDK (MinIO, AWS S3, any S3-compatible store).

A multipart ETag is not a content hash, so every upload stores the object's
sha256 as user metadata (``x-amz-meta-sha256``) and every download checks the
bytes on disk against it. Large objects move in parallel byte ranges (down)
or parts (up). Credentials come from an Airflow connection or the
environment, never from a spec, and never appear in logs or reprs.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import urllib3
from minio import Minio
from minio.commonconfig import ENABLED, Filter
from minio.error import S3Error
from minio.lifecycleconfig import Expiration, LifecycleConfig, Rule, Transition

from trainyard.atomic import open_new, temp_name
from trainyard.errors import DataError, SpecError, TransientError
from trainyard.storage.hashing import commit_verified, sha256_file, write_verified
from trainyard.storage.keys import check_key
from trainyard.storage.tier import ObjectInfo

log = logging.getLogger(__name__)
SHA_META = "sha256"
_T = TypeVar("_T")
# Server-side answers that mean "try again later"; anything else is the caller's problem.
_RETRY_CODES = {"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"}


@dataclass(frozen=True)
class S3Settings:
    """Where and as whom to reach the object store. Secrets stay out of ``repr``."""

    endpoint: str
    """``host:port`` of the S3 API."""
    access_key: str = field(repr=False)
    secret_key: str = field(repr=False)
    secure: bool = True
    region: str | None = None

    @classmethod
    def from_endpoint_url(cls, url: str, access_key: str, secret_key: str, region: str | None = None) -> S3Settings:
        parsed = urlparse(url if "://" in url else f"https://{url}")
        if not parsed.hostname:
            raise SpecError([f"endpoint_url {url!r} has no host (expected e.g. http://127.0.0.1:9000)"])
        port = f":{parsed.port}" if parsed.port else ""
        return cls(f"{parsed.hostname}{port}", access_key, secret_key, parsed.scheme == "https", region)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> S3Settings:
        """Outside Airflow: ``TRAINYARD_S3_ENDPOINT``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``."""
        env = os.environ if env is None else env
        missing = [n for n in ("TRAINYARD_S3_ENDPOINT", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY") if not env.get(n)]
        if missing:
            raise SpecError(
                [f"s3 access needs an Airflow connection or the environment variables {', '.join(missing)}"]
            )
        return cls.from_endpoint_url(
            env["TRAINYARD_S3_ENDPOINT"], env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env.get("AWS_REGION")
        )


@dataclass(frozen=True)
class Retry:
    """Bounded retries with exponential backoff around each object transfer."""

    attempts: int = 4
    backoff_s: float = 1.0

    def call(self, what: str, fn: Callable[[], _T]) -> _T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn()
            except (urllib3.exceptions.HTTPError, OSError, S3Error) as exc:
                if isinstance(exc, S3Error) and exc.code not in _RETRY_CODES:
                    raise  # a missing object or a refused key will not heal with time
                if attempt == self.attempts:
                    raise TransientError(f"{what}: gave up after {attempt} tries: {_short(exc)}") from exc
                delay = self.backoff_s * 2 ** (attempt - 1)
                log.warning(
                    "%s: try %d of %d failed (%s); again in %.1f s", what, attempt, self.attempts, _short(exc), delay
                )
                time.sleep(delay)
        raise AssertionError("unreachable")


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]


class S3Tier:
    def __init__(
        self,
        uri: str,
        settings: S3Settings,
        part_size: int = 16 << 20,
        parallel_parts: int = 4,
        retry: Retry = Retry(),
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
            settings.access_key,
            settings.secret_key,
            secure=settings.secure,
            region=settings.region,
            http_client=http,
        )

    def _name(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = f"{self.prefix}/" if self.prefix else ""

        def listing() -> list[ObjectInfo]:
            objects = self.client.list_objects(self.bucket, prefix=base + prefix, recursive=True)
            return [ObjectInfo(o.object_name[len(base) :], o.size, o.etag) for o in objects if not o.is_dir]

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

    def download(self, key: str, dest: Path, expect: ObjectInfo | None = None) -> tuple[int, str]:
        check_key(key)
        size = expect.size if expect else None
        if size is not None and size > self.part_size:
            return self.retry.call(f"download {self._name(key)}", lambda: self._ranged(key, dest, size))
        return self.retry.call(f"download {self._name(key)}", lambda: self._whole(key, dest, expect))

    def _whole(self, key: str, dest: Path, expect: ObjectInfo | None) -> tuple[int, str]:
        response = self.client.get_object(self.bucket, self._name(key))
        try:
            sha = response.headers.get(f"x-amz-meta-{SHA_META}") or (expect.sha256 if expect else None)
            return write_verified(response, dest, expect_size=expect.size if expect else None, expect_sha256=sha)
        finally:
            response.close()
            response.release_conn()

    def _ranged(self, key: str, dest: Path, size: int) -> tuple[int, str]:
        """Fetch byte ranges in parallel into one preallocated temporary file, then verify."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(dest)
        shas: set[str | None] = set()
        try:
            with open_new(tmp) as out:
                out.truncate(size)
                fd = out.fileno()

                def fetch(offset: int) -> None:
                    length = min(self.part_size, size - offset)
                    response = self.client.get_object(self.bucket, self._name(key), offset=offset, length=length)
                    try:
                        shas.add(response.headers.get(f"x-amz-meta-{SHA_META}"))
                        written = offset
                        for chunk in response.stream(1 << 20):
                            written += os.pwrite(fd, chunk, written)
                        if written != offset + length:
                            raise OSError(f"range {offset}+{length} of {key} ended after {written - offset} bytes")
                    finally:
                        response.close()
                        response.release_conn()

                with ThreadPoolExecutor(self.parallel_parts) as pool:
                    list(pool.map(fetch, range(0, size, self.part_size)))
                os.fsync(fd)
            [sha] = shas if len(shas) == 1 else [None]
            if sha is None:
                raise DataError(f"{self.uri}/{key}: no sha256 metadata (upload it with trainyard, or re-upload)")
            commit_verified(tmp, dest, size, sha)
            return size, sha
        finally:
            tmp.unlink(missing_ok=True)

    def upload(self, src: Path, key: str) -> tuple[int, str]:
        check_key(key)
        sha, size = sha256_file(src), src.stat().st_size

        def put() -> tuple[int, str]:
            self.client.fput_object(
                self.bucket,
                self._name(key),
                str(src),
                metadata={SHA_META: sha},
                part_size=max(self.part_size, 5 << 20),
                num_parallel_uploads=self.parallel_parts,
            )
            stored = self.stat(key)
            if stored is None or stored.size != size or stored.sha256 != sha:
                raise OSError(f"upload of {src} to {self.uri}/{key} failed verification: stored {stored}")
            return size, sha

        return self.retry.call(f"upload {self._name(key)}", put)

    def write_bytes(self, key: str, data: bytes) -> None:
        # One PUT is atomic in S3: readers get the previous object or this one, never a mix.
        check_key(key)
        sha = hashlib.sha256(data).hexdigest()

        def put() -> None:
            self.client.put_object(self.bucket, self._name(key), io.BytesIO(data), len(data), metadata={SHA_META: sha})
            stored = self.stat(key)
            if stored is None or stored.size != len(data) or stored.sha256 != sha:
                raise OSError(f"write of {self.uri}/{key} failed verification: stored {stored}")

        self.retry.call(f"write {self._name(key)}", put)

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


def settings_for(connection: Any) -> S3Settings:
    """``S3Settings`` from an Airflow connection object (type aws, ``endpoint_url`` in extra)."""
    extra = connection.extra_dejson or {}
    url = extra.get("endpoint_url") or (f"http://{connection.host}:{connection.port}" if connection.host else None)
    if not url:
        raise SpecError(
            [f"connection {connection.conn_id!r}: set endpoint_url in its extra (e.g. http://127.0.0.1:9000)"]
        )
    if not connection.login or not connection.password:
        raise SpecError([f"connection {connection.conn_id!r}: needs a login (access key) and password (secret key)"])
    return S3Settings.from_endpoint_url(url, connection.login, connection.password, extra.get("region_name"))
