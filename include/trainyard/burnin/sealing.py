"""Per-run keys and signed values for the pressure test's store (the burn-in's face of ``protocol.sealing``).

The store the candidates meet at is a ``torch.distributed.TCPStore``: it has
no authentication, and anyone who reaches its port can list, read, write and
delete its keys (``list_keys`` included), so a secret key *name* would hide
nothing. Every protocol value is sealed (``trainyard.protocol.sealing``, the one
implementation both stores use): an HMAC-SHA256 over the key name and the
payload. Each run draws a fresh random secret, and each candidate gets its own
key derived from it (``TRAINYARD_BURNIN_KEY``), so a candidate can sign only its
own reports, and only the orchestrator can sign its instructions to a candidate.

What it does not do: keep the figures secret, or keep a stranger from
deleting keys (indistinguishable from a silent node). A forged value is
detected and fails the stage (``StoreTampered``, a retry with new keys),
never evicts or passes a node.
"""

from __future__ import annotations

from trainyard.errors import TransientError
from trainyard.protocol import sealing
from trainyard.protocol.sealing import seal

__all__ = ["KEY_ENV", "StoreTampered", "node_key", "run_secret", "seal", "unseal"]

KEY_ENV = "TRAINYARD_BURNIN_KEY"
"""The variable that carries a candidate's key into its process or pod (never its command line)."""
PURPOSE = "candidate"
"""What burn-in keys are derived for (a coordination store key of the same node never opens its values)."""


class StoreTampered(TransientError):
    """A value in the pressure test's store was not signed with the key of whom it claims to come from."""


def run_secret() -> bytes:
    """A fresh secret for one run of the pressure test; it never leaves the orchestrator."""
    return sealing.new_secret()


def node_key(secret: bytes, node: str) -> str:
    """The key of candidate ``node`` (hex): what it signs its reports with, and checks its instructions by."""
    return sealing.node_key(secret, node, PURPOSE)


def unseal(key: str, name: str, raw: bytes | str) -> str:
    """The payload of a sealed value; ``StoreTampered`` if it was not sealed with ``key`` for ``name``."""
    try:
        return sealing.unseal(key, name, raw)
    except sealing.Forged:
        raise StoreTampered(
            f"pressure test store: {name!r} is not signed with its writer's per-run key; "
            "someone else wrote to the store (its port must be reachable only by the candidates)"
        ) from None
