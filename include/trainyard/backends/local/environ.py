"""The environment of the processes trainyard starts on this machine: an allow-list, not the worker's own.

Training code and burn-in probes are untrusted (docs/architecture.md, rule 11), and the
process that starts them is an Airflow worker: its environment holds the
JWT secret, the Fernet key, the database URL (``AIRFLOW__*``), connections
(``AIRFLOW_CONN_*``) and cloud credentials (``AWS_*``). A child gets only what
running Python, torch and its libraries needs, plus what the launcher sets
(the ``TRAINYARD_*`` contract): a variable not named here does not cross.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

# Exact names a Python/torch process needs to start and find its files and locale.
ALLOWED_NAMES = frozenset(
    {
        "PATH",
        "HOME",
        "USER",
        "LOGNAME",
        "SHELL",
        "LANG",
        "LANGUAGE",
        "TZ",
        "TERM",
        "PYTHONPATH",
        "PYTHONHASHSEED",
        "PYTHONUNBUFFERED",
        "PYTHONDONTWRITEBYTECODE",
        "VIRTUAL_ENV",
        "TMPDIR",
        "LD_LIBRARY_PATH",
    }
)
# Families that tune the numeric libraries and the accelerators (no credentials live there).
ALLOWED_PREFIXES = ("LC_", "CUDA_", "NVIDIA_", "OMP_", "MKL_", "TORCH_", "NCCL_", "GLOO_")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def allowed(name: str) -> bool:
    """Whether ``name`` may pass from the worker's environment to a child it starts."""
    return name in ALLOWED_NAMES or name.startswith(ALLOWED_PREFIXES)


def child_env(
    parent: Mapping[str, str], launcher_sets: Mapping[str, str], passed: Iterable[str] = ()
) -> dict[str, str]:
    """The allowed part of ``parent`` and the ``passed`` names the spec lists (``training.pass_env``), then
    ``launcher_sets`` (the ``TRAINYARD_*`` contract and the like) over it.

    What the launcher sets is passed whatever its name: it is trainyard's own
    contract, never read from the worker's environment.
    """
    bad = sorted(k for k in launcher_sets if not _NAME.match(k))
    if bad:
        raise ValueError(f"environment variable name(s) {', '.join(map(repr, bad))}: use letters, digits and '_'")
    passed = frozenset(passed)
    return {**{k: v for k, v in parent.items() if allowed(k) or k in passed}, **launcher_sets}
