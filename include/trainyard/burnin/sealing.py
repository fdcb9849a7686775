"""Per-run keys and signed values for the pressure test's store.

The store the candidates meet at is a ``torch.distributed.TCPStore``: it has
no authentication, and anyone who reaches its port can list, read, write and
delete its keys (``list_keys`` included), so a secret key *name* would hide
nothing. What this module makes sure is that a value is acted on only if its
writer holds the key: every protocol value is ``<hmac>.<payload>``, an
HMAC-SHA256 over the key name and the payload. Each run draws a fresh random
secret, and each candidate gets its own key derived from it
(``TRAINYARD_BURNIN_KEY``), so a candidate can sign only its own reports, and
only the orchestrator can sign its instructions to a candidate.

What it does not do: keep the figures secret, or keep a stranger from
deleting keys (indistinguishable from a silent node). A forged value is
detected and fails the stage (``StoreTampered``, a retry with new keys),
never evicts or passes a node.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from trainyard.errors import TransientError

KEY_ENV = "TRAINYARD_BURNIN_KEY"
"""The variable that carries a candidate's key into its process or pod (never its command line)."""


class StoreTampered(TransientError):
    """A value in the pressure test's store was not signed with the key of whom it claims to come from."""


def run_secret() -> bytes:
    """A fresh secret for one run of the pressure test; it never leaves the orchestrator."""
    return secrets.token_bytes(32)


def node_key(secret: bytes, node: str) -> str:
    """The key of candidate ``node`` (hex): what it signs its reports with, and checks its instructions by."""
    return hmac.new(secret, f"candidate\0{node}".encode(), hashlib.sha256).hexdigest()


def _mac(key: str, name: str, payload: str) -> str:
    return hmac.new(bytes.fromhex(key), f"{name}\0{payload}".encode(), hashlib.sha256).hexdigest()


def seal(key: str, name: str, payload: str) -> str:
    """``payload`` signed for store key ``name`` (binding the name: a value copied to another key fails)."""
    return f"{_mac(key, name, payload)}.{payload}"


def unseal(key: str, name: str, raw: bytes | str) -> str:
    """The payload of a sealed value; ``StoreTampered`` if it was not sealed with ``key`` for ``name``."""
    text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
    mac, dot, payload = text.partition(".")
    if not dot or not hmac.compare_digest(mac.encode(), _mac(key, name, payload).encode()):
        raise StoreTampered(
            f"pressure test store: {name!r} is not signed with its writer's per-run key; "
            "someone else wrote to the store (its port must be reachable only by the candidates)"
        )
    return payload
