"""What every process the local backend starts shares: it dies with the process that started it."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: SIGTERM it when the process that launched it dies.

    If the Airflow task process is SIGKILLed, no ``finally`` runs; the kernel
    still tells each torchrun agent, which then shuts its workers down.
    """
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
