"""Load every entry of a DCP checkpoint safely and check that its tensors are finite.

This is the part of validation that interprets bytes training code wrote, so it
runs in a child process that holds none of the orchestrator's secrets, may not
write files, and answers in JSON: ``{"problems": [...]}``. ``validate`` starts
one server per process (``python -m trainyard.checkpoint.tensors --serve``),
which imports torch once and forks a fresh process for each checkpoint: the
server itself never reads a checkpoint, so what one checkpoint does to its
inspector cannot reach the next. ``python -m trainyard.checkpoint.tensors DIR``
inspects one folder.
Inside, nothing is unpickled with a full unpickler either: ``.metadata`` goes
through ``checkpoint.metadata``'s allow-list, and each stored entry through
``torch.load(weights_only=True)``. Entries are read one at a time from the
byte ranges the metadata names (files of this checkpoint only), so memory stays
near the largest entry, not the whole model. Each file is read once, front to
back (``readonce``), and the answer carries the size and sha256 of the bytes
read: the orchestrator compares them with the manifest, so the bytes checked
are the bytes hashed (a rank cannot serve one version to a hash and another to
the load). Framework saves' ``torch.save`` files: ``checkpoint.torchfiles``.
Bytes can cost without running code (a set of nested tuples hashes for years), so each fork
dies with its server (``PR_SET_PDEATHSIG``; the server leads a process group ``validate``
kills whole) and runs under CPU-time and address-space limits: tight while it reads the
metadata, then sized by what the metadata says must be read (``_limit``).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import resource
import signal
import sys
import warnings
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath
from typing import IO, Any

import torch

from trainyard.atomic import loads_untrusted
from trainyard.checkpoint import metadata as dcp_meta
from trainyard.checkpoint import torchfiles
from trainyard.checkpoint.frameworks import FORMATS
from trainyard.checkpoint.metadata import MetadataRefused, StorageInfo
from trainyard.checkpoint.pickles import TORCH_FILES
from trainyard.checkpoint.readonce import Once
from trainyard.checkpoint.torchfiles import Digests, non_finite


def _plain_name(rel: str) -> bool:
    path = PurePosixPath(rel)
    return bool(rel) and not path.is_absolute() and ".." not in path.parts and "\\" not in rel and "\x00" not in rel


def storage_problems(ckpt_dir: Path, md: dcp_meta.Metadata, files: list[str] | None = None) -> list[str]:
    """Every entry the metadata lists is stored, in a file of this checkpoint (one of ``files``, those read and
    hashed), within that file's bytes."""
    problems: list[str] = []
    sizes: dict[str, int | None] = {}
    for index, info in md.storage_data.items():
        rel = info.relative_path
        if not _plain_name(rel):
            problems.append(f"entry {index.fqn} is stored at {rel!r}, outside the checkpoint folder")
            continue
        if files is not None and rel not in files:
            problems.append(f"entry {index.fqn} is stored in {rel!r}, not a data file the manifest lists")
            continue
        if rel not in sizes:
            path = ckpt_dir / rel
            sizes[rel] = path.stat().st_size if path.is_file() and not path.is_symlink() else None
        size = sizes[rel]
        if size is None:
            problems.append(f"entry {index.fqn} is stored in {rel}, which is not a regular file of the checkpoint")
        elif info.offset < 0 or info.length < 0 or info.offset + info.length > size:
            problems.append(f"entry {index.fqn} claims bytes {info.offset}+{info.length} of {rel}, which holds {size}")
    for fqn, entry in md.state_dict_metadata.items():
        if isinstance(entry, dcp_meta.BytesStorageMetadata):
            wanted = [dcp_meta.MetadataIndex.of(fqn)]
        else:
            wanted = [dcp_meta.MetadataIndex.of(fqn, chunk.offsets) for chunk in entry.chunks]
            if sum(chunk.sizes.numel() for chunk in entry.chunks) != entry.size.numel():
                problems.append(f"tensor {fqn}: its chunks do not add up to its size {list(entry.size)}")
        problems += [
            f"entry {fqn} at {list(i.offset or [])} has no stored data" for i in wanted if i not in md.storage_data
        ]
    return problems


def _transformed(raw: bytes, info: StorageInfo) -> bytes:
    if info.transform_descriptors:  # e.g. compression: undone as DCP's FileSystemReader does, with its registry
        from torch.distributed.checkpoint._extension import (  # seconds to import: only here
            ExtensionRegistry,
            StreamTransformExtension,
        )

        stream: IO[bytes] = io.BytesIO(raw)
        for ext in ExtensionRegistry().from_descriptor_list(info.transform_descriptors):
            if isinstance(ext, StreamTransformExtension):
                stream = ext.transform_from(stream)
        return stream.read()
    return raw


def dcp_files(ckpt_dir: Path) -> list[str]:
    """The files a DCP folder's inspection reads (when the request does not name them): metadata and data."""
    return sorted(p.name for p in ckpt_dir.iterdir() if p.name == dcp_meta.METADATA or p.name.endswith(".distcp"))


def _entry_problem(fqn: str, index: dcp_meta.MetadataIndex, entry: Any, value: Any) -> str | None:
    """A stored tensor chunk has the dtype and shape the metadata promises."""
    if not isinstance(entry, dcp_meta.TensorStorageMetadata):
        return None
    chunk = next((c for c in entry.chunks if c.offsets == index.offset), None)
    if not isinstance(value, torch.Tensor) or chunk is None:
        return f"entry {fqn} at {list(index.offset or [])} does not hold a tensor chunk the metadata lists"
    if value.dtype != entry.properties.dtype or value.shape != chunk.sizes:
        return (
            f"tensor {fqn}: stored chunk is {value.dtype} {list(value.shape)}, the metadata says"
            f" {entry.properties.dtype} {list(chunk.sizes)}"
        )
    return None


def _metadata(ckpt_dir: Path, digests: Digests) -> dcp_meta.Metadata:
    """The DCP metadata from the bytes read (and hashed) once; ``MetadataRefused`` says why not."""
    try:
        with Once(ckpt_dir, dcp_meta.METADATA) as once:
            if once.size > dcp_meta.MAX_METADATA_BYTES:
                raise MetadataRefused(f"{dcp_meta.METADATA} is larger than {dcp_meta.MAX_METADATA_BYTES} bytes")
            raw = once.read(once.size)
            digests[dcp_meta.METADATA] = once.finish()
    except OSError as exc:
        raise MetadataRefused(f"{dcp_meta.METADATA} cannot be read ({exc.strerror or exc})") from None
    return dcp_meta.loads(raw)


def tensor_problems(ckpt_dir: Path, bounded: bool = False, files: list[str] | None = None) -> tuple[list[str], Digests]:
    """The metadata reads safely, every entry loads weights-only, and every floating-point tensor is finite;
    with the size and sha256 of each file read (``files``: the metadata and data files the manifest lists).

    Each data file is read once, front to back, its entries loaded from the bytes hashed (``readonce``).
    ``bounded`` (the inspecting fork): under ``_limit``'s limits, for the metadata and then for the entries."""
    files = dcp_files(ckpt_dir) if files is None else files
    digests: Digests = {}
    if bounded:
        _limit(METADATA_CPU_S, METADATA_MEMORY + 16 * _size(ckpt_dir / dcp_meta.METADATA))
    try:
        md = _metadata(ckpt_dir, digests)
    except MetadataRefused as exc:
        return [f"torch.distributed.checkpoint metadata is unreadable: {exc}"], digests
    problems = storage_problems(ckpt_dir, md, files)
    if problems:
        return problems, digests
    by_file: dict[str, list[tuple[dcp_meta.MetadataIndex, StorageInfo]]] = defaultdict(list)
    for index, info in md.storage_data.items():
        by_file[info.relative_path].append((index, info))
    data_files = sorted(f for f in files if f != dcp_meta.METADATA)
    # Files side by side (each hashed as it is read, the hash being what bounds a plain sha256sum): as many at
    # once as there are cores, so memory holds that many entries, each loaded from its raw bytes.
    workers = max(1, min(os.cpu_count() or 1, len(data_files)))
    if bounded:
        largest = sorted(max((i.length for _, i in by_file[rel]), default=0) for rel in data_files)[-workers:]
        total = sum(info.length for info in md.storage_data.values())
        cpu_s = min(ENTRIES_CPU_S + int(CPU_S_PER_GB * total / 1e9), MAX_CPU_S)
        _limit(cpu_s, ENTRY_MEMORY + 2 * workers * THREAD_MEMORY + 4 * sum(largest), final=True)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        read = list(pool.map(lambda rel: _file_entries(ckpt_dir, rel, md, by_file[rel]), data_files))
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for rel, (found, file_counts, digest) in zip(data_files, read, strict=True):
        problems += found
        digests[rel] = digest
        for name, (nan, inf) in file_counts.items():  # one tensor's chunks may lie in several ranks' files
            counts[name][0] += nan
            counts[name][1] += inf
    problems += [
        f"tensor {name} has {nan} NaN and {inf} Inf value(s)" for name, (nan, inf) in counts.items() if nan or inf
    ]
    return problems, digests


def _file_entries(
    ckpt_dir: Path, rel: str, md: dcp_meta.Metadata, entries: list[tuple[dcp_meta.MetadataIndex, StorageInfo]]
) -> tuple[list[str], dict[str, list[int]], tuple[int, str]]:
    """One data file read once, front to back: its entries' problems, non-finite counts, and its digest."""
    problems: list[str] = []
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    with Once(ckpt_dir, rel) as once:
        for index, info in sorted(entries, key=lambda item: (item[1].offset, item[1].length)):
            problems += _entry(once, md, index, info, counts)
        return problems, counts, once.finish()


def _entry(
    once: Once, md: dcp_meta.Metadata, index: dcp_meta.MetadataIndex, info: StorageInfo, counts: dict[str, list[int]]
) -> list[str]:
    """One stored entry, read from where ``once`` is: loaded weights-only, its tensors' non-finite values counted."""
    entry = md.state_dict_metadata.get(index.fqn)
    if entry is None:
        return [f"stored entry {index.fqn} is not in the metadata's state dict"]
    if info.offset < once.pos:  # DCP writes each entry once, one after another: shared bytes are not its doing
        return [f"entry {index.fqn} overlaps the bytes of another entry in {info.relative_path}"]
    once.skip_to(info.offset)
    raw = once.read(info.length)
    if len(raw) != info.length:
        return [f"entry {index.fqn} claims bytes {info.offset}+{info.length} of {info.relative_path}, past its end"]
    try:
        value = torch.load(io.BytesIO(_transformed(raw, info)), map_location="cpu", weights_only=True)
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        return [f"entry {index.fqn} does not load weights-only: {type(exc).__name__}: {reason}"]
    if problem := _entry_problem(index.fqn, index, entry, value):
        return [problem]
    for name, tensor in torchfiles.tensors_in(value, index.fqn):
        nan, inf = non_finite(tensor)
        counts[name][0] += nan
        counts[name][1] += inf
    return []


# The inspecting fork's limits. Measured on a real 2.1 GB DCP checkpoint (101 tensors, the largest 1 GB;
# issue 29): its 20 kB metadata loads in 0.005 s of CPU and no new memory; the entries take 1.5 s of CPU
# per GB and twice the largest entry in memory. The limits leave 20x that (a metadata of 100,000 chunks
# stays within them too), and room for torch's threads (a stack and a malloc arena each) on many cores.
INSPECT_NICE = 10  # the same as the checkpoint watcher's (registry.BACKGROUND_NICE)
METADATA_CPU_S = 30
METADATA_MEMORY = 1 << 30
ENTRIES_CPU_S = 60
CPU_S_PER_GB = 30
MAX_CPU_S = 3600  # twice validate's time limit for the answer (CHILD_TIMEOUT_S)
THREAD_MEMORY = 96 << 20  # a thread's stack and malloc arena, as address space
ENTRY_MEMORY = (2 << 30) + (os.cpu_count() or 1) * THREAD_MEMORY
_PR_SET_PDEATHSIG = 1


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except OSError:
        return 0


def _address_space() -> int:
    """Bytes of address space this process maps now (``/proc/self/statm``): torch's libraries are most of it."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * resource.getpagesize()


def _limit(cpu_s: int, memory: int, final: bool = False) -> None:
    """At most ``cpu_s`` more seconds of CPU (SIGXCPU) and ``memory`` more bytes mapped (MemoryError).

    Only soft limits until ``final``, so the entries' limits can replace the metadata's; then hard ones too."""
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = int(used.ru_utime + used.ru_stime) + cpu_s
    space = _address_space() + memory
    for which, soft in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, space)):
        hard = resource.getrlimit(which)[1]
        soft = soft if hard == resource.RLIM_INFINITY else min(soft, hard)
        resource.setrlimit(which, (soft, soft + (which == resource.RLIMIT_CPU) if final else hard))


def _die_with(server: int) -> None:
    """In the fork: SIGKILL when the server dies, however it dies (a server already gone: exit now)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:
        os._exit(1)


def _no_writes() -> None:
    """This process reads; a file it writes (or a core dump) can only be an attack's doing."""
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def inspect(
    ckpt_dir: Path,
    bounded: bool = False,
    fmt: str | None = None,
    files: list[str] | None = None,
    key: str | None = None,
) -> dict[str, Any]:
    """The answer for one request: ``{"problems": [...], "digests": {file: [size, sha256]}}``, with ``notes``
    for a framework save and ``step`` for a step request; any failure is a reason instead of a traceback.

    ``fmt``: None, or a format of ``checkpoint.frameworks`` read as DCP (trainyard's own, torchtitan's):
    ``tensor_problems``; a format read as torch.save files: ``torchfiles.file_problems``; "step": the step a torch.save file (or a folder of them) holds (``key`` first, then ``frameworks.STEP_KEYS``). ``files``: the files to
    read and hash, as the manifest lists them (None: those the folder holds)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if fmt == "step":
                if bounded:
                    _limit(ENTRIES_CPU_S, ENTRY_MEMORY + 4 * torchfiles.largest(ckpt_dir), True)
                return {"problems": [], "step": torchfiles.file_step(ckpt_dir, key)}
            fw = FORMATS.get(fmt) if fmt is not None else None
            if fw is not None and fw.inspector == "torch":
                if files is None:
                    found = (p for p in ckpt_dir.rglob("*") if p.suffix in TORCH_FILES and p.is_file())
                    files = sorted(p.relative_to(ckpt_dir).as_posix() for p in found)
                if bounded:
                    sizes = [_size(ckpt_dir / rel) for rel in files]
                    cpu_s = min(ENTRIES_CPU_S + int(CPU_S_PER_GB * sum(sizes) / 1e9), MAX_CPU_S)
                    _limit(cpu_s, ENTRY_MEMORY + 4 * max(sizes, default=0), True)
                problems, notes, digests = torchfiles.file_problems(ckpt_dir, files, fw.finite)
                return {"problems": problems, "notes": notes, "digests": digests}
            problems, digests = tensor_problems(ckpt_dir, bounded, files)
            return {"problems": problems, "digests": digests}
        except MemoryError:
            return {"problems": ["checkpoint could not be inspected: it needs more memory than its inspector's limit"]}
        except Exception as exc:
            return {"problems": [f"checkpoint could not be inspected: {type(exc).__name__}: {str(exc)[:300]}"]}


def serve() -> int:
    """Answer each checkpoint folder read from stdin (one per line) with one JSON line, each from a fresh fork.

    At a lower CPU priority than its caller (nice +10; its forks inherit it): beside a training run on the
    local backend, a save's check can wait a moment, the ranks' steps cannot."""
    _no_writes()
    with contextlib.suppress(OSError):
        os.nice(INSPECT_NICE)
    for line in sys.stdin.buffer:
        answer = _in_fork(*request(line.decode("utf-8", "replace").rstrip("\n")))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0  # stdin closed: the process that started this server is gone or done


def request(line: str) -> tuple[Path, str | None, list[str] | None, str | None]:
    """A request line: a folder's path (trainyard's own checkpoint), or ``{"path": ..., "format": ...,
    "files": [...], "key": ...}`` (the files to read and hash, as the manifest lists them; the spec's
    ``checkpoint.step_key`` for a step request)."""
    if line.startswith("{"):
        try:
            asked = json.loads(line)
            files, key = asked.get("files"), asked.get("key")
            named = [str(f) for f in files] if isinstance(files, list) else None
            fmt = str(asked["format"]) if asked.get("format") else None
            return Path(str(asked["path"])), fmt, named, key[:100] if isinstance(key, str) and key else None
        except (ValueError, KeyError, TypeError, AttributeError):
            return Path(line), None, None, None
    return Path(line), None, None, None


def _in_fork(
    ckpt_dir: Path, fmt: str | None = None, files: list[str] | None = None, key: str | None = None
) -> dict[str, Any]:
    read_end, write_end = os.pipe()
    server = os.getpid()
    pid = os.fork()
    if pid == 0:  # the inspector: its own process, with no way to the server's channel
        try:
            _die_with(server)
            os.close(read_end)
            devnull = os.open(os.devnull, os.O_RDWR)
            os.dup2(devnull, 0)
            os.dup2(devnull, 1)
            answer = {**inspect(ckpt_dir, bounded=True, fmt=fmt, files=files, key=key), "pid": os.getpid()}
            with os.fdopen(write_end, "w") as out:
                out.write(json.dumps(answer))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as answer_pipe:
        text = answer_pipe.read()
    _, status = os.waitpid(pid, 0)
    try:
        answer = loads_untrusted(text, "the inspector's answer")  # it read the rank's bytes: trusted no more
        if isinstance(answer, dict) and isinstance(answer.get("problems"), list):
            return answer
    except ValueError:
        pass
    return {"problems": [f"the process inspecting the tensors failed ({_how(status)}) without an answer"]}


def _how(status: int) -> str:
    if os.WIFSIGNALED(status) and os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL):
        return f"signal {os.WTERMSIG(status)}: past its CPU-time limit, or killed"
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.waitstatus_to_exitcode(status)}"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--serve"]:
        return serve()
    if len(args) != 1:
        print("usage: python -m trainyard.checkpoint.tensors CHECKPOINT_DIR | --serve", file=sys.stderr)
        return 2
    _no_writes()
    print(json.dumps(inspect(Path(args[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
