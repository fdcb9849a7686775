"""Which boot wrote a staged folder, and re-verifying one written in an earlier boot.

Staging copies without an fsync per file (cp and rclone do not fsync either):
within one boot the page cache holds every byte written, so a file the staged
manifest lists is there, whole, for every reader. A crash or reboot can take
unsynced copies back, so the manifest and each journal line record the boot
they were written in (Linux's ``boot_id``), and one from another boot is not
trusted: staging copies its files again, and the orchestrator, before it hands
the folder to ``check_dataset`` or training, hashes each file against its
recorded digest and re-stamps the manifest (``ensure_this_boot``). Where the
boot id cannot be read, staging keeps its fsyncs and writes no boot id; a
manifest without one was written that way and stays trusted.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainyard.atomic import read_json, write_json_atomic
from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.storage import checksums
from trainyard.storage.hashing import file_digest
from trainyard.storage.hot import STAGED_MANIFEST
from trainyard.storage.keys import key_path

log = logging.getLogger(__name__)
BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")
BOOT_ID = "boot_id"
"""The manifest's (and each journal line's) field naming the boot it was written in."""


def current_boot_id() -> str | None:
    """This boot's id (changes at every boot), or None where the system does not say (then staging fsyncs)."""
    try:
        value = BOOT_ID_FILE.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return value or None


def trusted(written_in: object, current: str | None) -> bool:
    """Whether a manifest or journal line written in boot ``written_in`` may be believed now.

    None: written by staging that fsynced each file (no boot id known then): durable, trusted.
    Otherwise only in the same boot: the page cache that held its unsynced copies is still there.
    """
    return written_in is None or written_in == current


def recomputable(digest: str, algorithms: frozenset[str] | None = None) -> bool:
    """Whether ``digest`` can be computed again from the file alone.

    A checksum of parts (``md5-multipart``, ``*-composite``) needs the part size,
    which the manifest does not keep; a CRC needs ``awscrt``.
    """
    have = checksums.available_algorithms() if algorithms is None else algorithms
    return digest.partition(":")[0] in have


def entry_digest(entry: dict[str, Any]) -> str | None:
    """The digest a manifest entry records (entries from before digests carry only ``sha256``)."""
    if digest := entry.get("digest"):
        return str(digest)
    return f"sha256:{entry['sha256']}" if entry.get("sha256") else None


def problems(hot_dir: Path, files: dict[str, dict[str, Any]]) -> list[str]:
    """Each listed file that is not what the manifest says (missing, resized, other digest, or uncheckable)."""
    found = []
    for key in sorted(files):
        entry, digest = files[key], entry_digest(files[key])
        try:
            path = key_path(hot_dir, key)
            size = path.stat().st_size
        except (OSError, DataError) as exc:
            found.append(f"{key} (unreadable: {exc})")
            continue
        if size != entry.get("size"):
            found.append(f"{key} ({size} bytes, the manifest says {entry.get('size')})")
        elif digest is None or not recomputable(digest):
            found.append(f"{key} (its digest {digest or 'none'} cannot be recomputed from the file alone)")
        elif (actual := file_digest(path, digest.partition(":")[0])) != digest:
            found.append(f"{key} ({actual}, the manifest says {digest})")
    return found


def ensure_this_boot(hot_dir: Path, ledger: Ledger | None = None, stage: str = "check_dataset") -> int:
    """Before a finished stage's folder is used: re-verify it if it was staged in another boot.

    Returns the number of files re-verified (0 when the manifest is from this
    boot, or from fsyncing staging). Raises ``DataError`` naming the files that
    no longer match, and the fix; when all match, the manifest is re-stamped
    with this boot's id, so the check runs once per boot.
    """
    path = hot_dir / STAGED_MANIFEST
    if not path.exists():
        return 0  # nothing staged: check_dataset says so in its own words
    try:
        manifest = read_json(path)
        files = manifest["files"]
    except (ValueError, KeyError, OSError) as exc:
        raise DataError(f"{path}: unreadable ({exc}); clear stage_dataset in the Airflow UI to stage again") from None
    current = current_boot_id()
    written_in = manifest.get(BOOT_ID)
    if trusted(written_in, current):
        return 0
    log.warning(
        "%s was written in an earlier boot (%s, now %s): a crash may have taken back copies it lists;"
        " re-verifying its %d files",
        path,
        written_in,
        current,
        len(files),
    )
    bad = problems(hot_dir, files)
    if ledger:
        ledger.append(stage, "earlier_boot_reverified", hot_dir=str(hot_dir), files=len(files), mismatched=bad[:20])
    if bad:
        raise DataError(
            f"{path}: staged in an earlier boot, and {len(bad)} of its {len(files)} files no longer match it"
            f" (a crash took back copies that were not yet on disk): {'; '.join(bad[:20])}"
            + (" ..." if len(bad) > 20 else "")
            + ". Fix: clear stage_dataset in the Airflow UI (or run the DAG again): staging copies them again"
        )
    write_json_atomic(path, {**manifest, BOOT_ID: current})
    return len(files)
