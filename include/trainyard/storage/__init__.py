"""Storage tiers over URIs, and the staging between them."""

from __future__ import annotations

from trainyard.errors import SpecError
from trainyard.storage.local import LocalTier
from trainyard.storage.tier import ObjectInfo, Tier


def open_tier(uri: str) -> Tier:
    """The tier for a rendered URI (placeholders already filled)."""
    scheme, _, rest = uri.partition("://")
    if scheme == "file":
        return LocalTier(rest)
    raise SpecError([f"{uri}: no tier implementation for the {scheme}:// scheme yet"])


def local_path(uri: str) -> str:
    """The folder of a ``file://`` URI (hot tiers are always local)."""
    scheme, _, rest = uri.partition("://")
    if scheme != "file":
        raise SpecError([f"{uri}: expected a file:// URI"])
    return rest


__all__ = ["LocalTier", "ObjectInfo", "Tier", "local_path", "open_tier"]
