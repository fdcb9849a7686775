"""``file://`` tier: a folder on a local or mounted file system."""

from __future__ import annotations

import os
from pathlib import Path

from trainyard.atomic import fsync_dir, is_temp_name, temp_name
from trainyard.errors import ContentChanged
from trainyard.storage.hashing import changed_message, copy_file_verified
from trainyard.storage.keys import check_key, key_path
from trainyard.storage.tier import Landed, ObjectInfo

LOCAL_COPY = "local-copy"


class LocalTier:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.uri = f"file://{self.root}"

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        base = self.root / prefix if prefix else self.root
        if not base.is_dir():
            return []
        found = []
        for dirpath, _, filenames in os.walk(base):
            for name in filenames:
                if is_temp_name(name):
                    continue  # copies in flight (or left by a killed writer) are never objects
                path = Path(dirpath) / name
                st = path.stat()
                key = path.relative_to(self.root).as_posix()
                found.append(ObjectInfo(key=key, size=st.st_size, version=f"{st.st_size}-{st.st_mtime_ns}"))
        return sorted(found, key=lambda o: o.key)

    def download(
        self, key: str, dest: Path, expect: ObjectInfo | None = None, durable: bool = True, split: bool = True
    ) -> Landed:
        # xxh3-128 unless a digest recorded earlier (or a sha256) says which hash the copy must match.
        wanted = (expect.digest or (f"sha256:{expect.sha256}" if expect.sha256 else None)) if expect else None
        size, digest = copy_file_verified(
            key_path(self.root, key), dest, expect.size if expect else None, wanted, durable=durable
        )
        return Landed(size, digest, LOCAL_COPY)

    def upload(self, src: Path, key: str, expect_sha256: str | None = None) -> tuple[int, str]:
        # sha256: checkpoints record sha256 in their own manifest, and a cold copy is checked against it.
        check_key(key)
        dest = key_path(self.root, key)
        size, digest = copy_file_verified(src, dest, algo="sha256")
        sha = digest.removeprefix("sha256:")
        if expect_sha256 is not None and sha != expect_sha256:
            dest.unlink(missing_ok=True)
            raise ContentChanged(changed_message(src, sha, expect_sha256, f"{self.uri}/{key}"))
        return size, sha

    def write_bytes(self, key: str, data: bytes) -> None:
        # A temporary sibling renamed over the key: the rename is the atomic switch a pointer needs.
        final = key_path(self.root, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_name(final)
        try:
            with open(tmp, "xb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            fsync_dir(final.parent)
        finally:
            tmp.unlink(missing_ok=True)

    def read_bytes(self, key: str, limit: int = 1 << 20) -> bytes | None:
        path = key_path(self.root, key)
        if not path.is_file():
            return None
        with path.open("rb") as fh:
            return fh.read(limit)
