"""Which S3 request failures are transient, and how one request is retried (``Retry``).

``retryable`` is a pure function of the error: the codes and statuses S3
documents as transient, and the connection failures under them. ``Retry``
retries a request with full-jitter exponential backoff, bounded in tries and
in time, logging each failed try; once it gives up, ``TransientError``.
Every request of ``storage.s3`` goes through it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import urllib3
from minio.error import InvalidResponseError, S3Error, ServerError
from tenacity import (
    RetryCallState,
    RetryError,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_random_exponential,
)

from trainyard.errors import TransientError

log = logging.getLogger(__name__)
_T = TypeVar("_T")


# What S3 documents as worth retrying (error best practices, the SDKs' retry rules): internal errors,
# throttling, and a socket the server timed out. RequestTimeTooSkewed is left out: the clock stays skewed.
RETRY_CODES = frozenset({"InternalError", "ServiceUnavailable", "SlowDown", "RequestTimeout"})
RETRY_STATUS = frozenset({500, 502, 503, 504})


def retryable(exc: BaseException | None) -> bool:
    """Whether a failed request may succeed as is a little later (a pure function of the error)."""
    if isinstance(exc, S3Error):
        return exc.code in RETRY_CODES or getattr(exc.response, "status", None) in RETRY_STATUS
    if isinstance(exc, ServerError):  # an error answer without a body (a HEAD), or a proxy's
        return exc.status_code in RETRY_STATUS
    if isinstance(exc, InvalidResponseError):  # a non-XML answer, e.g. a load balancer's 503 page
        return getattr(exc, "_code", None) in RETRY_STATUS
    if isinstance(exc, urllib3.exceptions.MaxRetryError):  # urllib3's own retry ran out: judge the cause
        return isinstance(exc.reason, urllib3.exceptions.ResponseError) or retryable(exc.reason)
    # Connection refused or reset, a body cut short, connect or read timeouts.
    return isinstance(
        exc,
        (
            urllib3.exceptions.ProtocolError,
            urllib3.exceptions.TimeoutError,
            urllib3.exceptions.IncompleteRead,
            ConnectionError,
            TimeoutError,
        ),
    )


@dataclass(frozen=True)
class Retry:
    """How one request is retried: full-jitter exponential backoff, at most ``attempts`` tries within
    ``budget_s`` seconds, and only for errors ``retryable`` accepts."""

    attempts: int = 5
    backoff_s: float = 1.0
    """The first wait is random up to this; each later one up to twice the one before."""
    max_backoff_s: float = 20.0
    budget_s: float = 300.0
    """All tries of one request together: once this much time has passed, a failure is not retried."""

    def call(self, what: str, fn: Callable[[], _T]) -> _T:
        def warn(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            delay = state.next_action.sleep if state.next_action else 0.0
            log.warning(
                "%s: try %d of %d failed (%s); again in %.1f s",
                what,
                state.attempt_number,
                self.attempts,
                _short(exc),
                delay,
            )

        retrying = Retrying(
            retry=retry_if_exception(retryable),
            stop=stop_after_attempt(self.attempts) | stop_after_delay(self.budget_s),
            wait=wait_random_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
            before_sleep=warn,
        )
        try:
            return retrying(fn)
        except RetryError as exc:
            last = exc.last_attempt.exception()
            tries = exc.last_attempt.attempt_number
            raise TransientError(f"{what}: gave up after {tries} tries: {_short(last)}") from last


def _short(exc: BaseException | None) -> str:
    if exc is None:
        return "no error"
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:200]
