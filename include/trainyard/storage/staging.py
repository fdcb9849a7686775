"""Staging: copy a dataset from a cold tier to a folder in the hot tier.

Plan, make room, transfer, commit. Only objects that are missing or changed
are copied; each lands under a temporary name, is verified and renamed, and
is then recorded in a journal, so a stage killed midway and run again skips
what it finished. The staged manifest is written last: a folder whose
manifest lists a file holds that file, whole.

Where the boot id is known (Linux), copies are not fsynced: the manifest and
each journal line record the boot instead, and one from another boot (a crash
or reboot since, which can take back unsynced copies) is not trusted: its
objects are copied again (``storage.boot``). Elsewhere each copy, and each
folder before its journal lines, is fsynced.

Files the script reads beside its shards (``dataset.files``: a vocabulary, a tokenizer) are staged with
them in every format and verified against the spec (``storage.datafiles``); what a format leaves at the
source unnamed is a warning, in the task log and in the result.

A source key named like the hot folder's own files (``hot.RESERVED``: pins, the journal, a
staged manifest, at any depth) was written by someone else: it is never staged, only named.

``storage.staged`` reads what a folder holds and plans the copy;
``storage.transfer`` copies and journals.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainyard.atomic import write_json_atomic
from trainyard.errors import DataError
from trainyard.events.ledger import Ledger
from trainyard.spec import DataFile
from trainyard.storage.boot import BOOT_ID, current_boot_id, trusted
from trainyard.storage.datafiles import check_staged, pick, unstaged_keys, unstaged_warning
from trainyard.storage.hot import JOURNAL, RESERVED, STAGED_MANIFEST, HotRoom, make_room, pin, reserved, touch
from trainyard.storage.keys import key_path, key_paths
from trainyard.storage.results import StagingResult
from trainyard.storage.staged import plan, read_journal, read_manifest, recorded_digest
from trainyard.storage.tier import Tier
from trainyard.storage.transfer import Progress, transfer

log = logging.getLogger(__name__)


def stage(
    source: Tier,
    hot_dir: Path,
    ledger: Ledger | None = None,
    concurrency: int = 4,
    room: HotRoom | None = None,
    suffixes: tuple[str, ...] | None = None,
    files: Sequence[DataFile] = (),
) -> StagingResult:
    """Stage ``source`` into ``hot_dir``: every object, or with ``suffixes`` only the keys ending in one; and
    the ``files`` named beside them (``dataset.files``) whatever their names."""
    started = time.monotonic()
    listed = source.list()
    objects = [o for o in listed if not reserved(o.key)]
    skipped = sorted(o.key for o in listed if reserved(o.key))
    _say_reserved(source, skipped)
    picked = pick(files, {o.key: o for o in objects}, source.uri)  # a required file missing: fail before copying
    named = {o.key for o in picked.objects}
    warnings = list(picked.warnings)
    unstaged: list[str] = []
    if suffixes is not None:
        unstaged = unstaged_keys([o.key for o in objects if not o.key.endswith(suffixes) and o.key not in named])
        objects = [o for o in objects if o.key.endswith(suffixes) or o.key in named]
        warnings += [w] if (w := unstaged_warning(unstaged, suffixes)) else []
    for warning in warnings:
        log.warning("%s: %s", source.uri, warning)
    if len(objects) == len(named):
        which = f" with a {'/'.join(suffixes)} suffix" if suffixes is not None else ""
        hint = " and dataset.format" if suffixes is not None else ""
        beside = " beside dataset.files" if named else ""
        raise DataError(
            f"{source.uri} holds no objects{which} to stage{beside}; check dataset.source{hint} and the partition date"
        )
    boot_id = current_boot_id()
    durable = boot_id is None  # no boot to record: each copy is fsynced instead
    manifest = read_manifest(hot_dir)
    staged: dict[str, dict[str, Any]] = manifest.get("files", {})
    journaled, journal_earlier = read_journal(hot_dir, boot_id)
    manifest_trusted = trusted(manifest.get(BOOT_ID), boot_id)
    known = {**(staged if manifest_trusted else {}), **journaled}
    earlier = {k: e for k, e in {**({} if manifest_trusted else staged), **journal_earlier}.items() if k not in known}
    if earlier:
        _say_earlier_boot(hot_dir, manifest.get(BOOT_ID), len(staged) if not manifest_trusted else 0, earlier, ledger)
    recorded = {**earlier, **known}  # a digest says what the source held, whichever boot recorded it
    todo = [
        dataclasses.replace(o, digest=recorded_digest(recorded.get(o.key), o)) for o in plan(objects, known, hot_dir)
    ]
    dests = key_paths(hot_dir, [o.key for o in todo])  # a key escaping the hot folder fails here
    need = sum(o.size for o in todo)
    if ledger:
        ledger.append(
            "stage_dataset", "plan", source=source.uri, objects=len(objects), to_transfer=len(todo), bytes=need
        )
    log.info(
        "staging %s -> %s: %d objects, %d to transfer (%.1f MB)",
        source.uri,
        hot_dir,
        len(objects),
        len(todo),
        need / 1e6,
    )
    if room:
        pin(hot_dir, room.holder)  # before making room, so a parallel stage cannot evict us
        make_room(room, hot_dir, need - sum(recorded[o.key]["size"] for o in todo if o.key in recorded), ledger)
    touch(hot_dir)

    todo_keys = {o.key for o in todo}
    entries = {o.key: known[o.key] for o in objects if o.key not in todo_keys}
    progress = Progress(need, len(todo), ledger)
    if todo or set(staged) != set(entries):
        if not durable and manifest and manifest.get(BOOT_ID) is None and todo_keys & set(staged):
            # A manifest from fsyncing staging is trusted in any boot: before unsynced copies replace files
            # it lists, it says this boot, so a crash midway makes the next stage copy them all again.
            write_json_atomic(hot_dir / STAGED_MANIFEST, {**manifest, BOOT_ID: boot_id})
        transfer(source, hot_dir, todo, dests, entries, progress, concurrency, boot_id)
        _say_trusted(source, [o.key for o in todo if entries[o.key].get("check") == "first-fetch"], ledger)
        written = {"source": source.uri, "staged_at": time.time(), "files": entries}
        write_json_atomic(hot_dir / STAGED_MANIFEST, written if durable else {**written, BOOT_ID: boot_id})
        os.unlink(hot_dir / JOURNAL)
        for stale in {k for k in set(staged) - set(entries) if not reserved(k)}:
            key_path(hot_dir, stale).unlink(missing_ok=True)  # gone at the source: not part of this dataset
    if problems := check_staged(hot_dir, files, entries).problems:  # the bytes the script will read, as promised
        raise DataError("; ".join(problems))
    result = StagingResult(
        hot_dir=str(hot_dir),
        files=len(objects),
        bytes_total=sum(o.size for o in objects),
        transferred=len(todo),
        bytes_transferred=progress.bytes,
        seconds=round(time.monotonic() - started, 3),
        extra_files=len(named),
        unstaged=len(unstaged),
        warnings=warnings,
    )
    if ledger:
        said = {"reserved_skipped": skipped[:20]} if skipped else {}  # the keys the warning names
        ledger.append("stage_dataset", "staged", **asdict(result), **said)
    return result


def _say_reserved(source: Tier, keys: list[str], shown: int = 20) -> None:
    """Source objects named like trainyard's own files of a hot folder are never staged: say so, once per stage."""
    if keys:
        log.warning(
            "%s: %d objects are named like trainyard's own files in the hot tier (%s); someone else wrote them,"
            " and staged they would pin, re-stage or fake a dataset: not staged: %s",
            source.uri,
            len(keys),
            ", ".join(sorted(RESERVED)),
            ", ".join(keys[:shown]) + (" ..." if len(keys) > shown else ""),
        )


def _say_earlier_boot(
    hot_dir: Path,
    manifest_boot: object,
    manifest_objects: int,
    earlier: dict[str, dict[str, Any]],
    ledger: Ledger | None,
    shown: int = 20,
) -> None:
    """What an earlier boot staged without fsyncs is copied again: say so, once per stage."""
    log.warning(
        "%s: %d objects were staged in an earlier boot (manifest boot %s; %d from the manifest, the rest from"
        " the journal) without fsyncs: a crash or reboot since may have taken them back; copying them again: %s",
        hot_dir,
        len(earlier),
        manifest_boot,
        manifest_objects,
        ", ".join(sorted(earlier)[:shown]) + (" ..." if len(earlier) > shown else ""),
    )
    if ledger:
        ledger.append(
            "stage_dataset",
            "earlier_boot",
            hot_dir=str(hot_dir),
            objects=len(earlier),
            manifest_objects=manifest_objects,
            keys=sorted(earlier)[:shown],
        )


def _say_trusted(source: Tier, keys: list[str], ledger: Ledger | None, shown: int = 20) -> None:
    """Objects with nothing to check them against were trusted as they came: say so, once per stage."""
    if not keys:
        return
    log.warning(
        "%s: %d objects have no checksum, sha256 metadata or MD5 ETag to check; trusted on this first fetch,"
        " their sha256 recorded in the staged manifest and checked on every later fetch: %s",
        source.uri,
        len(keys),
        ", ".join(keys[:shown]) + (" ..." if len(keys) > shown else ""),
    )
    if ledger:
        ledger.append(
            "stage_dataset", "trust_on_first_fetch", source=source.uri, objects=len(keys), keys=sorted(keys)[:shown]
        )
