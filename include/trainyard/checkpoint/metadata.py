"""Read a DCP checkpoint's ``.metadata`` without running anything it says.

``torch.distributed.checkpoint`` writes its metadata with ``pickle.dump`` and
reads it back with ``pickle.load``, which calls whatever the file names: a
checkpoint written by training code (untrusted: docs/architecture.md, untrusted input) could run code
in whoever validates it. Here the unpickler resolves only the names DCP
metadata really holds (its dataclasses, ``torch.Size``, dtypes, layouts, paths;
the same idea as ``torch.load(weights_only=True)``, whose own unpickler cannot
read the protocol-4 pickles DCP writes), and the result must then have the
shape of DCP ``Metadata``. Anything else is refused with the name it asked for.

DCP's dataclasses are resolved to the plain mirrors below (same fields, no
behaviour), so no DCP code runs while reading, and the validating child skips
importing ``torch.distributed.checkpoint`` (seconds of its start-up).
"""

from __future__ import annotations

import enum
import io
import pathlib
import pickle
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.serialization

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # a model with millions of chunks stays far below this


class MetadataRefused(ValueError):
    """``.metadata`` is not DCP metadata this reader accepts; the message says why."""


# Mirrors of torch.distributed.checkpoint.metadata (and filesystem.StorageInfo), as torch 2.x pickles them.
class MemFormat(enum.Enum):
    TORCH_CONTIGUOUS_FORMAT = 0
    TORCH_CHANNELS_LAST = 1
    TORCH_PRESERVE_FORMAT = 2


@dataclass
class TensorProperties:
    dtype: Any = None
    layout: Any = None
    requires_grad: bool = False
    memory_format: Any = None
    pin_memory: bool = False

    def __setstate__(self, state: Any) -> None:
        # DCP pickles this one as a 5-tuple (a memory_format itself cannot be pickled).
        if not (isinstance(state, tuple) and len(state) == 5):
            raise MetadataRefused("its TensorProperties state is not DCP's 5-tuple")
        self.dtype, self.layout, self.requires_grad, self.memory_format, self.pin_memory = state


@dataclass
class ChunkStorageMetadata:
    offsets: Any = None
    sizes: Any = None


@dataclass
class TensorStorageMetadata:
    properties: Any = None
    size: Any = None
    chunks: Any = None


@dataclass
class BytesStorageMetadata:
    pass


@dataclass(frozen=True)
class MetadataIndex:
    fqn: str = ""
    offset: Any = None
    index: Any = field(default=None, hash=False, compare=False)

    @classmethod
    def of(cls, fqn: str, offset: Sequence[int] | None = None) -> MetadataIndex:
        """The key DCP stores an entry under (an offset is a ``torch.Size``, as DCP makes it)."""
        return cls(fqn, torch.Size(offset) if offset is not None else None)


@dataclass
class StorageMeta:
    checkpoint_id: Any = None
    save_id: Any = None
    load_id: Any = None
    modules: Any = None


@dataclass
class Metadata:
    state_dict_metadata: Any = None
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: Any = None


@dataclass
class StorageInfo:
    relative_path: Any = None
    offset: Any = None
    length: Any = None
    transform_descriptors: Any = None


def _torch_constants() -> dict[tuple[str, str], Any]:
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)}


_DCP = "torch.distributed.checkpoint.metadata"
# Every callable here only builds a value: the mirrors, torch.Size, paths (never opened), containers.
ALLOWED: dict[tuple[str, str], Any] = {
    (_DCP, "Metadata"): Metadata,
    (_DCP, "MetadataIndex"): MetadataIndex,
    (_DCP, "TensorStorageMetadata"): TensorStorageMetadata,
    (_DCP, "BytesStorageMetadata"): BytesStorageMetadata,
    (_DCP, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_DCP, "TensorProperties"): TensorProperties,
    (_DCP, "StorageMeta"): StorageMeta,
    (_DCP, "_MEM_FORMAT_ENCODING"): MemFormat,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup by name, as weights_only allows
    **_torch_constants(),
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # StorageMeta.checkpoint_id: a name, never a file to touch
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("collections", "OrderedDict"): OrderedDict,
}


class _AllowListUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose only way to reach a global is ``ALLOWED`` (exact names, no dotted lookups)."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return ALLOWED[(module, name)]
        except KeyError:
            raise MetadataRefused(
                f"it refers to {module}.{name}, which DCP metadata never holds"
                " (a pickle that would run code); the checkpoint was not written by"
                " torch.distributed.checkpoint.save"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataRefused("it uses a persistent id, which DCP metadata never holds")


def loads(data: bytes) -> Metadata:
    """DCP ``Metadata`` from pickled bytes, through the allow-list; ``MetadataRefused`` says why not."""
    try:
        value = _AllowListUnpickler(io.BytesIO(data)).load()
    except MetadataRefused:
        raise
    except Exception as exc:
        raise MetadataRefused(f"it is not a readable pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
    _check_shape(value)
    return value


def read_metadata(ckpt_dir: Path) -> Metadata:
    """The checkpoint's DCP metadata, read with the allow-list unpickler."""
    path = Path(ckpt_dir) / METADATA
    try:
        size = path.lstat().st_size
        if path.is_symlink() or size > MAX_METADATA_BYTES:
            raise MetadataRefused(f"{METADATA} is a symbolic link or larger than {MAX_METADATA_BYTES} bytes")
        data = path.read_bytes()
    except OSError as exc:
        raise MetadataRefused(f"{METADATA} cannot be read ({exc.strerror or exc})") from None
    return loads(data)


def _check_shape(value: Any) -> None:
    """The unpickled value is a ``Metadata`` whose parts have the types DCP gives them."""
    if not isinstance(value, Metadata):
        raise MetadataRefused(f"it holds a {type(value).__name__}, not torch.distributed.checkpoint Metadata")
    entries = value.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and isinstance(v, (TensorStorageMetadata, BytesStorageMetadata)) for k, v in entries.items()
    ):
        raise MetadataRefused("its state_dict_metadata is not a mapping of names to tensor or bytes entries")
    for name, entry in entries.items():
        if isinstance(entry, TensorStorageMetadata) and not (
            isinstance(entry.size, torch.Size)
            and isinstance(entry.properties, TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype)
            and isinstance(entry.chunks, list)
            and all(
                isinstance(c, ChunkStorageMetadata)
                and isinstance(c.offsets, torch.Size)
                and isinstance(c.sizes, torch.Size)
                for c in entry.chunks
            )
        ):
            raise MetadataRefused(f"its entry {name!r} is not a well-formed tensor entry")
    storage = value.storage_data
    if not isinstance(storage, dict) or not all(
        isinstance(k, MetadataIndex)
        and isinstance(k.fqn, str)
        and (k.offset is None or isinstance(k.offset, torch.Size))
        and isinstance(v, StorageInfo)
        and isinstance(v.relative_path, str)
        and type(v.offset) is int
        and type(v.length) is int
        and (
            v.transform_descriptors is None
            or (
                isinstance(v.transform_descriptors, (list, tuple))
                and all(isinstance(d, str) for d in v.transform_descriptors)
            )
        )
        for k, v in storage.items()
    ):
        raise MetadataRefused("its storage_data is not a mapping of entries to (file, offset, length)")
