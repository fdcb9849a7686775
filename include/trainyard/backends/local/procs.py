"""What every process the local backend starts shares: it dies with the process that started it."""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: signal.Signals = signal.SIGTERM) -> None:
    """In the child before exec: send it ``sig`` when the process that launched it dies.

    If the Airflow task process is SIGKILLed, no ``finally`` runs; the kernel
    still tells each torchrun agent (SIGTERM), which then shuts its workers down.
    """
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
