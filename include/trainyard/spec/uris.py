"""Tier URIs: what a ``file://`` or ``s3://`` root must look like, and what to write instead.

``uri_problems`` words each mistake a person makes when typing a URI (one slash,
a capital scheme, a bare path) and each S3 bucket-name rule broken, so the fix
is in the message rather than in the AWS documentation.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import PurePosixPath

from trainyard.spec.templating import placeholder_problems

URI_SCHEMES = ("file", "s3")
_SCHEME = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*):(/*)")
_BUCKET_CHARS = re.compile(r"[a-z0-9.-]+\Z")


def uri_problems(uri: str, schemes: tuple[str, ...]) -> list[str]:
    """Problems with a tier URI; ``file://`` paths must be absolute and stay inside their root."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in schemes:
        return [_scheme_problem(uri, schemes)]
    problems = placeholder_problems(uri)
    if scheme == "file" and not (rest.startswith("/") or rest.startswith("${")):
        problems.append(f"{uri!r} must be an absolute path (file:///abs/path or file://${{TRAINYARD_HOME}}/...)")
    if scheme == "s3" and (why := bucket_problem(rest.partition("/")[0])):
        problems.append(f"{uri!r} must name a valid bucket (s3://bucket/prefix): {why}")
    if ".." in PurePosixPath(rest).parts or "\\" in rest or "\x00" in rest:
        problems.append(f"{uri!r} may not contain '..', backslashes or NUL")
    return problems


def _scheme_problem(uri: str, schemes: tuple[str, ...]) -> str:
    """Why ``uri`` does not start with one of ``schemes`` + ``://``, saying what to write."""
    allowed = " or ".join(s + "://" for s in schemes)
    match = _SCHEME.match(uri)
    if match is None:
        if uri.startswith("/") and "file" in schemes:
            return f"{uri!r} is a bare path; write it as a URI: file://{uri}"
        return f"{uri!r} has no scheme; it must start with {allowed}"
    scheme, slashes = match.group(1), match.group(2)
    if scheme.lower() in schemes and scheme != scheme.lower():
        return f"{uri!r}: write the scheme in lowercase ({scheme.lower()}://)"
    if scheme in schemes and len(slashes) != 2:
        rest = uri[match.end() :]
        fixed = f"{scheme}:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
        return (
            f"{uri!r} has {_count(len(slashes))} after '{scheme}:' where two belong ({scheme}://...); write {fixed!r}"
        )
    return f"{uri!r} must start with {allowed} (the scheme {scheme!r} is not allowed here)"


def _count(n: int) -> str:
    return {0: "no slash", 1: "one slash"}.get(n, f"{n} slashes")


def bucket_problem(bucket: str) -> str | None:
    """The S3 bucket-naming rule ``bucket`` breaks, or None (a ``${VAR}`` or template stands for a valid name)."""
    if "${" in bucket or "{{" in bucket:
        return None
    if not bucket:
        return "the bucket name is empty"
    if not 3 <= len(bucket) <= 63:
        return f"a bucket name is 3 to 63 characters long ({bucket!r} has {len(bucket)})"
    if not _BUCKET_CHARS.match(bucket):
        wrong = sorted({c for c in bucket if not re.match(r"[a-z0-9.-]", c)})
        return f"a bucket name has only lowercase letters, digits, '.' and '-' ({bucket!r} has {''.join(wrong)!r})"
    if not (bucket[0].isalnum() and bucket[-1].isalnum()):
        return f"a bucket name starts and ends with a letter or digit ({bucket!r})"
    if ".." in bucket:
        return f"a bucket name has no two adjacent dots ({bucket!r})"
    if _is_ip(bucket):
        return f"a bucket name is not an IP address ({bucket!r})"
    return None


def _is_ip(text: str) -> bool:
    try:
        ipaddress.IPv4Address(text)
    except ValueError:
        return False
    return True
