"""Storage tiers over URIs, and the staging between them."""

from __future__ import annotations

from trainyard.errors import SpecError
from trainyard.storage.local import LocalTier
from trainyard.storage.s3 import S3Tier
from trainyard.storage.s3auth import S3Settings
from trainyard.storage.tier import ObjectInfo, Tier


def open_tier(uri: str, s3: S3Settings | None = None) -> Tier:
    """The tier for a rendered URI (placeholders already filled).

    ``s3`` says how to reach an ``s3://`` tier; without it, the environment's endpoint
    (``AWS_ENDPOINT_URL_S3`` ...) and the AWS credential chain (``storage.s3auth``).
    """
    scheme, _, rest = uri.partition("://")
    if scheme == "file":
        return LocalTier(rest)
    if scheme == "s3":
        return S3Tier(uri, s3 or S3Settings.from_env())
    raise SpecError([f"{uri}: no tier for the {scheme}:// scheme (use file:// or s3://)"])


def local_path(uri: str) -> str:
    """The folder of a ``file://`` URI (hot tiers are always local)."""
    scheme, _, rest = uri.partition("://")
    if scheme != "file":
        raise SpecError([f"{uri}: expected a file:// URI"])
    return rest


__all__ = ["LocalTier", "ObjectInfo", "S3Settings", "S3Tier", "Tier", "local_path", "open_tier"]
