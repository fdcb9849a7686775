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
near the largest entry, not the whole model.
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
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO, Any

import torch

from trainyard.atomic import loads_untrusted
from trainyard.checkpoint import metadata as dcp_meta
from trainyard.checkpoint.metadata import MetadataRefused, StorageInfo, read_metadata


def _plain_name(rel: str) -> bool:
    path = PurePosixPath(rel)
    return bool(rel) and not path.is_absolute() and ".." not in path.parts and "\\" not in rel and "\x00" not in rel


def storage_problems(ckpt_dir: Path, md: dcp_meta.Metadata) -> list[str]:
    """Every entry the metadata lists is stored, in a file of this checkpoint, within that file's bytes."""
    problems: list[str] = []
    sizes: dict[str, int | None] = {}
    for index, info in md.storage_data.items():
        rel = info.relative_path
        if not _plain_name(rel):
            problems.append(f"entry {index.fqn} is stored at {rel!r}, outside the checkpoint folder")
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


def _read(ckpt_dir: Path, info: StorageInfo) -> bytes:
    fd = os.open(ckpt_dir / info.relative_path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        fh.seek(info.offset)
        raw = fh.read(info.length)
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


def _tensors(value: Any, name: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _tensors(item, f"{name}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _tensors(item, f"{name}[{i}]")


def _non_finite(tensor: torch.Tensor) -> tuple[int, int]:
    # A sum is NaN or Inf if any element is, at memory speed; only then (or on overflow) count.
    if not tensor.is_floating_point() or bool(torch.isfinite(tensor.sum())) or bool(torch.isfinite(tensor).all()):
        return 0, 0
    return int(torch.isnan(tensor).sum()), int(torch.isinf(tensor).sum())


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


def tensor_problems(ckpt_dir: Path, bounded: bool = False) -> list[str]:
    """The metadata reads safely, every entry loads weights-only, and every floating-point tensor is finite.

    ``bounded`` (the inspecting fork): under ``_limit``'s limits, for the metadata and then for the entries."""
    if bounded:
        _limit(METADATA_CPU_S, METADATA_MEMORY + 16 * _size(ckpt_dir / dcp_meta.METADATA))
    try:
        md = read_metadata(ckpt_dir)
    except MetadataRefused as exc:
        return [f"torch.distributed.checkpoint metadata is unreadable: {exc}"]
    problems = storage_problems(ckpt_dir, md)
    if problems:
        return problems
    if bounded:
        largest = max((info.length for info in md.storage_data.values()), default=0)
        total = sum(info.length for info in md.storage_data.values())
        cpu_s = min(ENTRIES_CPU_S + int(CPU_S_PER_GB * total / 1e9), MAX_CPU_S)  # entries may share bytes
        _limit(cpu_s, ENTRY_MEMORY + 4 * largest, final=True)
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for index, info in sorted(md.storage_data.items(), key=lambda kv: (kv[1].relative_path, kv[1].offset)):
        entry = md.state_dict_metadata.get(index.fqn)
        if entry is None:
            problems.append(f"stored entry {index.fqn} is not in the metadata's state dict")
            continue
        try:
            value = torch.load(io.BytesIO(_read(ckpt_dir, info)), map_location="cpu", weights_only=True)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            problems.append(f"entry {index.fqn} does not load weights-only: {type(exc).__name__}: {reason}")
            continue
        if problem := _entry_problem(index.fqn, index, entry, value):
            problems.append(problem)
            continue
        for name, tensor in _tensors(value, index.fqn):
            nan, inf = _non_finite(tensor)
            counts[name][0] += nan
            counts[name][1] += inf
    problems += [
        f"tensor {name} has {nan} NaN and {inf} Inf value(s)" for name, (nan, inf) in counts.items() if nan or inf
    ]
    return problems


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
ENTRY_MEMORY = (2 << 30) + (os.cpu_count() or 1) * (96 << 20)
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


def inspect(ckpt_dir: Path, bounded: bool = False, fmt: str | None = None) -> dict[str, Any]:
    """The answer for one request: ``{"problems": [...]}``, with ``notes`` (files accepted uninspected) for a
    framework save and ``step`` for a step request; any failure is a reason instead of a traceback.

    ``fmt``: None or "dcp" (trainyard's own, torchtitan's): ``tensor_problems``; "hf", "lightning", "torch":
    ``file_problems``; "step": the ``global_step`` a Lightning file holds (``file_step``)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            if fmt == "step":
                return {"problems": [], "step": file_step(ckpt_dir, bounded)}
            if fmt in ("hf", "lightning", "torch"):
                problems, notes = file_problems(ckpt_dir, bounded, fmt)
                return {"problems": problems, "notes": notes}
            return {"problems": tensor_problems(ckpt_dir, bounded)}
        except MemoryError:
            return {"problems": ["checkpoint could not be inspected: it needs more memory than its inspector's limit"]}
        except Exception as exc:
            return {"problems": [f"checkpoint could not be inspected: {type(exc).__name__}: {str(exc)[:300]}"]}


# Globals whose call runs code or reaches the system: a file that names one is refused, never accepted as
# "not inspectable" (torch's weights-only unpickler would refuse to call them anyway; this names the reason).
CODE_MODULES = (
    "builtins", "__builtin__", "os", "posix", "nt", "sys", "subprocess", "shutil", "socket", "importlib",
    "runpy", "pty", "code", "codeop", "pickle", "_pickle", "marshal", "types", "ctypes", "functools",
    "operator", "webbrowser", "multiprocessing", "asyncio", "io", "_io", "pathlib", "tempfile", "signal",
)  # fmt: skip
TORCH_FILES = (".pt", ".pth", ".bin", ".ckpt")


def _code_global(name: str) -> bool:
    return name.split(".")[0] in CODE_MODULES


# What must be finite in a Lightning checkpoint: the model and the optimizer. Its callbacks' bookkeeping holds
# infinities by design (ModelCheckpoint's ``kth_value`` starts at inf when nothing is monitored).
LIGHTNING_FINITE = ("state_dict", "optimizer_states")


def file_problems(folder: Path, bounded: bool = False, fmt: str | None = None) -> tuple[list[str], list[str]]:
    """Every torch.save file of an adopted framework save (``.pt``, ``.pth``, ``.bin``, ``.ckpt``): loads
    with ``torch.load(weights_only=True)`` and holds only finite floating-point tensors.

    A file that needs globals beyond torch's weights-only allow-list is never unpickled: if any of them can
    run code (``CODE_MODULES``) it is a problem; otherwise (numpy's RNG state in ``rng_state.pth``, the
    ``TrainingArguments`` in ``training_args.bin``) it is a note, accepted on its zip structure and hash.
    A Lightning file's model and optimizer must be finite (``LIGHTNING_FINITE``), not its callbacks' state."""
    files = sorted(p for p in folder.rglob("*") if p.suffix in TORCH_FILES and p.is_file() and not p.is_symlink())
    if bounded:
        largest = max((_size(p) for p in files), default=0)
        total = sum(_size(p) for p in files)
        _limit(min(ENTRIES_CPU_S + int(CPU_S_PER_GB * total / 1e9), MAX_CPU_S), ENTRY_MEMORY + 4 * largest, True)
    problems: list[str] = []
    notes: list[str] = []
    for path in files:
        rel = path.relative_to(folder).as_posix()
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
        except Exception as exc:
            problems.append(f"{rel}: not a readable torch.save file ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        if code := [g for g in unsafe if _code_global(g)]:
            problems.append(f"{rel}: its pickle calls {', '.join(code[:5])} (code, not data); refused, never loaded")
            continue
        if unsafe:
            notes.append(f"{rel}: not inspectable weights-only (needs {', '.join(unsafe[:5])}); accepted on its hash")
            continue
        try:
            value = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            problems.append(f"{rel}: does not load weights-only: {type(exc).__name__}: {reason}")
            continue
        if fmt == "lightning" and isinstance(value, dict):
            value = {key: value[key] for key in LIGHTNING_FINITE if key in value}
        for name, tensor in _tensors(value, rel):
            nan, inf = _non_finite(tensor)
            if nan or inf:
                problems.append(f"tensor {name} has {nan} NaN and {inf} Inf value(s)")
    return problems, notes


def file_step(path: Path, bounded: bool = False) -> int | None:
    """The ``global_step`` (Lightning) or ``step`` a torch.save file holds at its top, loaded weights-only."""
    if bounded:
        _limit(ENTRIES_CPU_S, ENTRY_MEMORY + 4 * _size(path), True)
    value = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    for key in ("global_step", "step"):
        step = value.get(key) if isinstance(value, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            return step
    return None


def serve() -> int:
    """Answer each checkpoint folder read from stdin (one per line) with one JSON line, each from a fresh fork.

    At a lower CPU priority than its caller (nice +10; its forks inherit it): beside a training run on the
    local backend, a save's check can wait a moment, the ranks' steps cannot."""
    _no_writes()
    with contextlib.suppress(OSError):
        os.nice(INSPECT_NICE)
    for line in sys.stdin.buffer:
        path, fmt = request(line.decode("utf-8", "replace").rstrip("\n"))
        answer = _in_fork(path, fmt)
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0  # stdin closed: the process that started this server is gone or done


def request(line: str) -> tuple[Path, str | None]:
    """A request line: a folder's path (trainyard's own checkpoint), or ``{"path": ..., "format": ...}``."""
    if line.startswith("{"):
        try:
            asked = json.loads(line)
            return Path(str(asked["path"])), str(asked["format"]) if asked.get("format") else None
        except (ValueError, KeyError, TypeError):
            return Path(line), None
    return Path(line), None


def _in_fork(ckpt_dir: Path, fmt: str | None = None) -> dict[str, Any]:
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
            answer = {**inspect(ckpt_dir, bounded=True, fmt=fmt), "pid": os.getpid()}
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
