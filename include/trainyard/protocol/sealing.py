"""Sealed values for the stores training processes share with the orchestrator: one implementation.

Both stores (the pressure test's, ``trainyard.burnin.sealing``, and in-place
recovery's coordination store, ``trainyard.protocol.coordstore``) are
``torch.distributed.TCPStore`` servers: they have no authentication, and
anyone who reaches the port can list, read, write and delete keys. What this
module makes sure is that a value is acted on only if its writer holds the
key: a sealed value is ``<hmac>.<payload>``, an HMAC-SHA256 over the store
key's *name* and the payload, so a value copied to another key fails too.

The orchestrator draws a fresh ``new_secret`` per run (or attempt) that never
leaves its process, and hands each node only its own ``node_key`` (through the
environment, never a command line, never logged). A node can therefore seal
only values of its own, and check values the orchestrator sealed for it; it
cannot speak for another node, nor forge the orchestrator's word to one.

What sealing does not do: keep values secret, or keep a stranger who reaches
the port from deleting keys or replaying a value a key held before (both look
like a silent node). Keep the port reachable only by the nodes.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

KEY_PATTERN = re.compile(r"^[0-9a-f]{64}$")
"""What a node key looks like (hex of 32 bytes): anything else in a node's environment is refused."""


class Forged(ValueError):
    """A value that was not sealed, for the key name it sits under, with the key of whom it claims to come from."""


def new_secret() -> bytes:
    """A fresh secret for one run or attempt; it never leaves the orchestrator."""
    return secrets.token_bytes(32)


def node_key(secret: bytes, node: str, purpose: str) -> str:
    """Node ``node``'s key (hex) for ``purpose`` (which store): what it seals its values and checks its
    instructions with. Keys for two purposes never match, even from one secret."""
    return hmac.new(secret, f"{purpose}\0{node}".encode(), hashlib.sha256).hexdigest()


def _mac(key: str, name: str, payload: str) -> str:
    return hmac.new(bytes.fromhex(key), f"{name}\0{payload}".encode(), hashlib.sha256).hexdigest()


def seal(key: str, name: str, payload: str) -> str:
    """``payload`` sealed for store key ``name`` (binding the name: a value copied to another key fails)."""
    return f"{_mac(key, name, payload)}.{payload}"


def unseal(key: str, name: str, raw: bytes | str) -> str:
    """The payload of a sealed value; ``Forged`` if it was not sealed with ``key`` for ``name``."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    mac, dot, payload = text.partition(".")
    if not dot or not hmac.compare_digest(mac.encode(), _mac(key, name, payload).encode()):
        raise Forged(f"{name!r} is not sealed with its writer's key")
    return payload
