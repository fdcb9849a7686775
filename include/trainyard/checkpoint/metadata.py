"""Read a DCP checkpoint's ``.metadata`` without running anything it says.

``torch.distributed.checkpoint`` writes its metadata with ``pickle.dump`` and
reads it back with ``pickle.load``, which calls whatever the file names: a
checkpoint written by training code (untrusted, DESIGN rule 11) could run code
in whoever validates it. Here the unpickler resolves only the globals DCP
metadata really holds (its dataclasses, ``torch.Size``, dtypes, layouts, paths;
the same idea as ``torch.load(weights_only=True)``, whose own unpickler cannot
read the protocol-4 pickles DCP writes), and the result must then have the
shape of a ``Metadata``. Anything else is refused with the name it asked for.
"""

from __future__ import annotations

import io
import pathlib
import pickle
from collections import OrderedDict
from pathlib import Path
from typing import Any

import torch
import torch.serialization
from torch.distributed.checkpoint import metadata as dcp_meta
from torch.distributed.checkpoint.filesystem import _StorageInfo

METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30  # a model with millions of chunks stays far below this


class MetadataRefused(ValueError):
    """``.metadata`` is not DCP metadata this reader accepts; the message says why."""


def _torch_constants() -> dict[tuple[str, str], Any]:
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {("torch", name): value for name, value in vars(torch).items() if isinstance(value, kinds)}


_DCP_CLASSES = (
    dcp_meta.Metadata, dcp_meta.MetadataIndex, dcp_meta.TensorStorageMetadata, dcp_meta.BytesStorageMetadata,
    dcp_meta.ChunkStorageMetadata, dcp_meta.TensorProperties, dcp_meta.StorageMeta, dcp_meta._MEM_FORMAT_ENCODING,
)
# Every callable here only builds a value: dataclasses, an enum, torch.Size, paths (never opened), containers.
ALLOWED: dict[tuple[str, str], Any] = {
    **{("torch.distributed.checkpoint.metadata", cls.__name__): cls for cls in _DCP_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
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
            raise MetadataRefused(f"it refers to {module}.{name}, which DCP metadata never holds"
                                  " (a pickle that would run code); the checkpoint was not written by"
                                  " torch.distributed.checkpoint.save") from None

    def persistent_load(self, pid: Any) -> Any:
        raise MetadataRefused("it uses a persistent id, which DCP metadata never holds")


def loads(data: bytes) -> dcp_meta.Metadata:
    """DCP ``Metadata`` from pickled bytes, through the allow-list; ``MetadataRefused`` says why not."""
    try:
        value = _AllowListUnpickler(io.BytesIO(data)).load()
    except MetadataRefused:
        raise
    except Exception as exc:  # noqa: BLE001 -- a malformed pickle fails in many ways; each is a refusal
        raise MetadataRefused(f"it is not a readable pickle ({type(exc).__name__}: {str(exc)[:200]})") from None
    _check_shape(value)
    return value


def read_metadata(ckpt_dir: Path) -> dcp_meta.Metadata:
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
    if not isinstance(value, dcp_meta.Metadata):
        raise MetadataRefused(f"it holds a {type(value).__name__}, not torch.distributed.checkpoint Metadata")
    entries = value.state_dict_metadata
    if not isinstance(entries, dict) or not all(
        isinstance(k, str) and isinstance(v, (dcp_meta.TensorStorageMetadata, dcp_meta.BytesStorageMetadata))
        for k, v in entries.items()
    ):
        raise MetadataRefused("its state_dict_metadata is not a mapping of names to tensor or bytes entries")
    for name, entry in entries.items():
        if isinstance(entry, dcp_meta.TensorStorageMetadata) and not (
            isinstance(entry.size, torch.Size) and isinstance(entry.properties, dcp_meta.TensorProperties)
            and isinstance(entry.properties.dtype, torch.dtype) and isinstance(entry.chunks, list)
            and all(isinstance(c, dcp_meta.ChunkStorageMetadata) and isinstance(c.offsets, torch.Size)
                    and isinstance(c.sizes, torch.Size) for c in entry.chunks)
        ):
            raise MetadataRefused(f"its entry {name!r} is not a well-formed tensor entry")
    storage = value.storage_data
    if not isinstance(storage, dict) or not all(
        isinstance(k, dcp_meta.MetadataIndex) and isinstance(k.fqn, str) and isinstance(v, _StorageInfo)
        and isinstance(v.relative_path, str) and type(v.offset) is int and type(v.length) is int
        for k, v in storage.items()
    ):
        raise MetadataRefused("its storage_data is not a mapping of entries to (file, offset, length)")
