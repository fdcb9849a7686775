"""Files the orchestrator writes and reads in folders that training code can also write.

Run, checkpoint and hot folders are shared with training processes and pods,
which are untrusted (docs/architecture.md, rule 11): one of them may plant a symbolic link, a
hard link or a FIFO where the orchestrator is about to write or read. Every
orchestrator write under such a folder goes through this module:

- ``write_bytes_atomic`` / ``write_json_atomic``: create-exclusive on a hidden
  temporary name (``O_EXCL|O_NOFOLLOW``), then one rename over the final name.
  A reader sees the old content or the new, never half; a link planted at the
  final name is replaced, never written through.
- ``open_new``: a fresh file under a name only this process uses (a temporary).
- ``open_append``: ``O_APPEND|O_NOFOLLOW``, and only a regular file with one link.
- ``open_regular``: read a regular file, never a link; ``single_link`` also
  refuses hard links (what the view serves).
- ``read_capped`` / ``read_json_capped``: THE reader of a small file a worker
  wrote (a heartbeat, a failure record, a pointer): a regular file only, never
  more than its cap read into memory. Each caller checks the schema of what it got.
- ``loads_untrusted``: THE parser of JSON a worker, a pod or a store value could
  have written, wherever it came from (a file, a line, a pipe, a store): any bytes
  give a value or a ``ValueError``, never another exception out of a reader.

The folder written into must be a real folder, not a symbolic link (a pod may
have swapped ``attempt-1/`` for a link to elsewhere); files are opened and
renamed relative to that folder's descriptor, so the check cannot go stale.
Links above that folder (``$TRAINYARD_HOME`` itself on a symlinked disk) are the
operator's and are followed. Anything refused raises ``UnsafePath``.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import stat
import uuid
from pathlib import Path
from typing import IO, Any

_TEMP = re.compile(r"\..+\.part-[0-9a-f]{8}\Z")
_NOFOLLOW = os.O_NOFOLLOW | os.O_CLOEXEC
_NONBLOCK = os.O_NONBLOCK  # a FIFO planted where a file belongs must not hang the worker on open


class UnsafePath(OSError):
    """A path the orchestrator will not write or read: a link, or not a regular file, where its own file belongs."""


def temp_name(final: Path) -> Path:
    """A hidden sibling name: a partial file is never visible under its final name."""
    return final.with_name(f".{final.name}.part-{uuid.uuid4().hex[:8]}")


def is_temp_name(name: str) -> bool:
    """True for names made by ``temp_name``: copies in flight or left by a killed writer."""
    return bool(_TEMP.match(name))


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new entry in ``directory`` durable, not just visible."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _refused(path: Path, what: str) -> UnsafePath:
    return UnsafePath(
        errno.ELOOP,
        f"{path} is {what}; trainyard reads and writes only its own regular files"
        " there, never through a link that training code could have planted. Remove it (and find"
        " out who made it), then retry",
    )


def open_dir(folder: Path, create: bool = True) -> int:
    """A descriptor of ``folder`` (made if missing), refused if ``folder`` itself is a symbolic link."""
    flags = os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW
    try:
        try:
            return os.open(folder, flags)
        except FileNotFoundError:  # made only when missing: one syscall per file in the usual case, not three
            if not create:
                raise
        folder.mkdir(parents=True, exist_ok=True)
        return os.open(folder, flags)
    except OSError as exc:  # FileExistsError from mkdir: a dangling link
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EEXIST):
            raise _refused(folder, "a symbolic link or not a folder") from None
        raise


def _checked(fd: int, path: Path, single_link: bool) -> int:
    """``fd`` if it is a regular file (with one link if asked); closed and refused otherwise."""
    st = os.fstat(fd)
    problem = (
        "not a regular file"
        if not stat.S_ISREG(st.st_mode)
        else f"a hard link ({st.st_nlink} names share it)"
        if single_link and st.st_nlink != 1
        else None
    )
    if problem:
        os.close(fd)
        raise _refused(path, problem)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~_NONBLOCK)
    return fd


def _open_in(folder_fd: int, path: Path, flags: int, mode: int = 0o644) -> int:
    try:
        return os.open(path.name, flags | _NOFOLLOW, mode, dir_fd=folder_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # ENXIO: a FIFO nobody reads
            raise _refused(path, "a symbolic link or a FIFO") from None
        raise


def open_new(path: Path, mode: str = "wb") -> IO[Any]:
    """A new file at ``path`` (a temporary name nobody else uses): ``FileExistsError`` if anything is there."""
    folder = open_dir(path.parent)
    try:
        fd = _open_in(folder, path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    finally:
        os.close(folder)
    return os.fdopen(fd, mode)


def open_append(path: Path, mode: str = "ab") -> IO[Any]:
    """``path`` opened to append (created if missing), never through a link planted there."""
    return os.fdopen(append_fd(path), mode)


def append_fd(path: Path) -> int:
    """A raw ``O_APPEND`` descriptor of ``path``: one ``os.write`` is one append, even across processes."""
    folder = open_dir(path.parent)
    try:
        # Read and write: the ledger reads its last byte to close a line an earlier append tore.
        fd = _open_in(folder, path, os.O_RDWR | os.O_APPEND | os.O_CREAT | _NONBLOCK)
    finally:
        os.close(folder)
    return _checked(fd, path, single_link=True)  # writing into a shared inode would change the other name too


def open_regular(path: Path, single_link: bool = False) -> IO[bytes]:
    """``path`` opened to read, only if it is a regular file (not a link, FIFO or device).

    ``single_link`` also refuses a file with other names (a hard link to a
    file outside the folder), for what is shown to people.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _refused(path, "a symbolic link") from None
        raise
    return os.fdopen(_checked(fd, path, single_link), "rb")


class TooLarge(ValueError):
    """A worker-written file larger than its reader's cap: evidence of a fault or an attack, never read whole."""


def read_capped(path: Path, max_bytes: int) -> bytes:
    """The content of the regular file ``path``, if it holds at most ``max_bytes``.

    ``UnsafePath`` for a link, FIFO or device (never followed, never waited on); ``TooLarge`` past the cap,
    after reading at most one byte more than it (a sparse file of gigabytes costs nothing).
    """
    with open_regular(path) as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise TooLarge(f"{path} is larger than {max_bytes} bytes; a worker-written file this big is not read")
    return data


MAX_DEPTH = 64
"""The deepest nesting of lists and objects taken from untrusted JSON. The protocol's own values are a few
levels deep; one nested near the interpreter's recursion limit would parse here and raise ``RecursionError``
wherever it is next walked (a ``json.dumps`` into the ledger, a printer), far from the reader that took it."""
# A \uD800-\uDFFF escape: JSON lets it stand alone, Python then holds a lone surrogate, which no UTF-8 writer
# (the ledger, a log file) can encode. Only a text that has one (or many brackets) is walked after parsing.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def loads_untrusted(data: bytes | str, what: str = "worker-written JSON") -> Any:
    """``data`` parsed as JSON, or ``ValueError`` naming ``what`` and why, for ANY input.

    ``json.loads`` alone lets three things through that are not ``ValueError``s or that crash a later
    reader: nesting past the parser's recursion (``RecursionError``, from a few kilobytes of ``[``),
    nesting past ``MAX_DEPTH`` (parsed, then fatal to the next recursive walk), and text that is not
    Unicode (bytes are decoded strictly as UTF-8, where ``json.loads`` would pass surrogates). An escaped
    lone surrogate (valid JSON, which the ledger's own writer makes of a rank's undecodable byte) becomes
    U+FFFD, so the line is kept and every later writer can encode it. NaN and Infinity stay: a diverged loss
    is reported as one."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        value = json.loads(text)
    except RecursionError:
        raise ValueError(f"{what} is not JSON (nested deeper than the parser's recursion allows)") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not JSON (not UTF-8 at byte {exc.start})") from None
    except ValueError as exc:  # JSONDecodeError, a number past int's digit limit
        raise ValueError(f"{what} is not JSON ({exc})") from None
    if text.count("[") + text.count("{") > MAX_DEPTH:
        _check_depth(value, what)  # only then: a walk per value would cost every heartbeat and event
    return _unicode(value) if _SURROGATE_ESCAPE.search(text) else value


def _unicode(value: Any) -> Any:
    """``value`` with each lone surrogate replaced (its depth is checked already: the recursion is bounded)."""
    if isinstance(value, str):
        return _SURROGATE.sub("\ufffd", value)
    if isinstance(value, list):
        return [_unicode(v) for v in value]
    if isinstance(value, dict):
        return {_unicode(k): _unicode(v) for k, v in value.items()}
    return value


def _check_depth(value: Any, what: str) -> None:
    """``ValueError`` if ``value`` nests deeper than ``MAX_DEPTH`` (walked without recursion: the walk must not
    fail the way it guards against)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= MAX_DEPTH:
                raise ValueError(f"{what} is not JSON (nested deeper than {MAX_DEPTH} levels)")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


def read_json_capped(path: Path, max_bytes: int) -> Any:
    """``read_capped``'s content as JSON (``ValueError`` for anything ``loads_untrusted`` refuses)."""
    return loads_untrusted(read_capped(path, max_bytes), str(path))


def write_bytes_atomic(path: Path, data: bytes | memoryview, mode: int = 0o644, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` whole: temporary name, fsync, rename, fsync of the folder. ``mode``: the
    new file's (0o600 for a secret: it is never readable by others, not even before the rename). Without
    ``durable`` no fsync: whole for every reader, but not across a crash (staging records the boot instead)."""
    folder = open_dir(path.parent)
    tmp, renamed = temp_name(path), False
    try:
        fd = _open_in(folder, tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        # A link planted at ``path`` is replaced by the rename, not followed.
        os.replace(tmp.name, path.name, src_dir_fd=folder, dst_dir_fd=folder)
        renamed = True
        if durable:
            os.fsync(folder)
    finally:
        try:
            if not renamed:  # a failed write leaves no temporary behind
                os.unlink(tmp.name, dir_fd=folder)
        except FileNotFoundError:
            pass
        os.close(folder)


def write_text_atomic(path: Path, text: str) -> None:
    write_bytes_atomic(path, text.encode("utf-8"))


def json_bytes(data: Any, sort_keys: bool = True) -> bytes:
    """How trainyard writes a JSON file (a manifest, a pointer): one spelling whatever the writer. ``sort_keys``
    False: for data whose mappings mean something in their order (a pinned spec's ``training.args``)."""
    return (json.dumps(data, indent=1, sort_keys=sort_keys) + "\n").encode("utf-8")


def write_json_atomic(path: Path, data: Any, sort_keys: bool = True) -> None:
    write_bytes_atomic(path, json_bytes(data, sort_keys))


def read_json(path: Path) -> Any:
    """A JSON file's content; a link planted at ``path`` is refused (``UnsafePath``), not followed, and
    content ``loads_untrusted`` refuses is a ``ValueError``."""
    with open_regular(path) as fh:
        return loads_untrusted(fh.read(), str(path))
