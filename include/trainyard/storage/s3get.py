"""The GET of a small object in one request on a connection of this thread's own, for ``S3Tier``.

A stage of thousands of objects of a few KB is bound by the client's CPU per request,
not by bytes: through minio's ``get_object`` (urllib3's pool, its response wrapper, the
SDK's response checks, a tenacity ``Retrying`` per call) a 4 KB object cost ~2.7 ms of
one Python core against rclone's ~1 ms. Here a request is what S3 needs and no more: the
URL, headers and SigV4 signature as minio makes them (``BaseURL.build``,
``_build_headers``, ``sign_v4_s3``: one implementation of the protocol), sent with
``http.client`` on a keep-alive connection each transfer thread keeps for itself.

Only the plain case is taken here: a 200 answer on a connection that works. Anything else
(an error status, a redirect, a connection the server closed, a timeout) returns ``None``
and the caller fetches the object through minio's path, whose errors (``S3Error``) and
retries (``s3retry``) are the ones every other request has. The bytes are verified the
same way on both paths (the check ``choose_check`` picks; here over the body in memory, before
anything is written: ``land_bytes``).
"""

from __future__ import annotations

import http.client
import ssl
import threading
from collections.abc import Callable, Mapping
from pathlib import Path

from minio import Minio
from minio.signer import sign_v4_s3

from trainyard.storage.checksums import Check
from trainyard.storage.hashing import land_bytes
from trainyard.storage.tier import Landed

SMALL_GET = 1 << 20
"""Objects up to this size come in one GET on the caller's thread; larger ones through minio (and ranges)."""
TIMEOUT_S = 60.0  # as the tier's urllib3 pool: a stalled server fails the request, then minio's path retries it
CHECKSUM_MODE = {"x-amz-checksum-mode": "ENABLED"}
"""Asks the store for the object's checksums in the answer's headers (``choose_check`` prefers them)."""


class SmallGet:
    """GETs of small objects of one bucket, each thread on a keep-alive connection of its own."""

    def __init__(self, client: Minio, bucket: str, tls: ssl.SSLContext | None):
        self.client, self.bucket, self.tls = client, bucket, tls
        self._region: str | None = None
        self._local = threading.local()

    def download(
        self,
        name: str,
        dest: Path,
        check_for: Callable[[Mapping[str, str], str | None, int], Check],
        expect_size: int,
        where: str,
        durable: bool,
    ) -> Landed | None:
        """Fetch object ``name`` to ``dest``, verified by ``check_for(headers, etag, size)``; None where this path
        could not (the caller then fetches it through minio). A verification failure raises, as on every path."""
        response = self._get(name)
        if response is None:
            return None
        try:
            headers = {k.lower(): v for k, v in response.getheaders()}
            # One read, verified in memory before anything is written. A byte more than listed is enough to refuse
            # it (the object changed): a body bigger than the listing said is never read whole.
            body = response.read(expect_size + 1)
        except (OSError, http.client.HTTPException):  # the body cut short: minio's path fetches it again
            self._drop()
            return None
        if not response.isclosed():  # its rest unread: the connection cannot carry another request
            self._drop()
        return land_bytes(body, dest, check_for(headers, headers.get("etag"), expect_size), expect_size, where, durable)

    def _get(self, name: str) -> http.client.HTTPResponse | None:
        """The 200 answer to a signed GET of ``name``, its body unread; None on anything else."""
        if self._region is None:
            self._region = self.client._get_region(self.bucket)
        url = self.client._base_url.build(method="GET", region=self._region, bucket_name=self.bucket, object_name=name)
        creds = self.client._provider.retrieve() if self.client._provider else None
        headers, date = self.client._build_headers(url.netloc, dict(CHECKSUM_MODE), None, creds)
        if creds:
            headers = sign_v4_s3(
                method="GET",
                url=url,
                region=self._region,
                headers=headers,
                credentials=creds,
                content_sha256=str(headers.get("x-amz-content-sha256")),
                date=date,
            )
        sent = {k: v if isinstance(v, str) else ",".join(v) for k, v in headers.items()}  # each one value here
        for _ in range(2):
            conn, reused = self._connection(url.scheme, url.netloc)
            try:
                conn.request("GET", url.path + (f"?{url.query}" if url.query else ""), headers=sent)
                response = conn.getresponse()
            except (OSError, http.client.HTTPException):
                self._drop()
                if reused:  # a kept connection the server has since closed: once more, on a new one
                    continue
                return None
            if response.status == 200:
                return response
            response.read()  # the error body: minio's path asks again and reads the error it names
            return None
        return None

    def _connection(self, scheme: str, netloc: str) -> tuple[http.client.HTTPConnection, bool]:
        """This thread's connection to ``netloc`` and whether it was used before (it connects on first use)."""
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is not None and getattr(self._local, "netloc", None) == netloc:
            return conn, True
        self._drop()
        if scheme == "https":
            conn = http.client.HTTPSConnection(netloc, timeout=TIMEOUT_S, context=self.tls)
        else:
            conn = http.client.HTTPConnection(netloc, timeout=TIMEOUT_S)
        self._local.conn, self._local.netloc = conn, netloc
        return conn, False

    def _drop(self) -> None:
        conn = getattr(self._local, "conn", None)
        if conn is not None:
            conn.close()
        self._local.conn = None
