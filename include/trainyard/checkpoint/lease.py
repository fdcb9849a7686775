"""The lineage lease: one run at a time trains on a pipeline's checkpoints.

Two runs of a pipeline at once (a backfill beside the nightly run) would
resume from the same step, save the same step names and retire each other's
checkpoints. ``HOLDER`` in the checkpoint root names the run that holds the
lineage: its DAG and run id, a token unique to this claim, and until when
the claim holds. The holder renews it while it trains; another run takes it
over only when it has expired, or when Airflow says the holder's run is no
longer running (finished, failed, deleted). What the holder's ledger says
does not count: a re-run of a finished run inherits its old report events.

Every change (take, renew, release) happens under an exclusive ``flock`` on
``.HOLDER.lock`` -- the kernel drops it when a process dies, so it never
sticks -- and compares the claim it read before it writes: a renewal whose
token is no longer the holder's fails (``LineageBusy``) instead of
overwriting the run that took over. The claim itself is written to a
temporary name and renamed, so a reader sees a whole claim or the old one.

This module imports no Airflow: the Airflow layer passes ``run_state``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainyard.atomic import read_json_capped, write_json_atomic
from trainyard.errors import LineageBusy
from trainyard.events.ledger import Ledger

log = logging.getLogger(__name__)
HOLDER = "HOLDER"
LOCK = ".HOLDER.lock"
HOLDER_BYTES = 64 * 1024  # a claim is a few hundred bytes
LEASE_S = 300.0
"""How long a claim holds without renewal: a run that stops renewing (its worker died, the run was
marked failed and its report skipped) frees the lineage after this long at the latest."""
LOCK_WAIT_S = 30.0
STAGE = "train"
ENDED = frozenset({"success", "failed", "absent"})
"""Airflow run states (and ``absent``: no such run) whose claim another run may take at once."""

RunState = Callable[[str, str], "str | None"]
"""``(dag_id, run_id)`` -> Airflow's state of that run, ``absent`` if there is none, None if unknown."""


@dataclass(frozen=True)
class Claim:
    """The content of ``HOLDER``."""

    dag_id: str
    run_id: str
    token: str
    since: float
    renewed: float
    expires: float
    ledger: str = ""

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Claim:
        since = float(data.get("since", 0.0))
        return cls(
            dag_id=str(data.get("dag_id", "")),
            run_id=str(data["run_id"]),
            token=str(data.get("token", "")),
            since=since,
            renewed=float(data.get("renewed", since)),
            # a claim written before leases (no expiry) lapses like a claim never renewed
            expires=float(data.get("expires", since + LEASE_S)),
            ledger=str(data.get("ledger", "")),
        )

    def describe(self, now: float) -> str:
        left = self.expires - now
        until = f"expires in {left:.0f} s" if left > 0 else f"expired {-left:.0f} s ago"
        return (
            f"run {self.run_id or '?'} of {self.dag_id or '?'} since {_utc(self.since)} UTC,"
            f" last renewed {_utc(self.renewed)} UTC ({until})"
        )


UNREADABLE = Claim(dag_id="", run_id="", token="", since=0.0, renewed=0.0, expires=0.0)
"""What a damaged ``HOLDER`` counts as: a claim long expired (a torn or planted file must not block forever)."""


def takeover_reason(claim: Claim | None, run_id: str, now: float, state: str | None) -> str | None:
    """Why ``run_id`` may take the lineage from ``claim``; None while the holder is alive.

    ``state`` is Airflow's state of the holder's run (None: not asked or unknown).
    Pure: the caller reads the claim, the clock and Airflow.
    """
    if claim is None:
        return "free"
    if claim is UNREADABLE:
        return "unreadable claim"
    if claim.run_id == run_id:
        return "same run"  # a retried or resumed train task of the run that holds it
    if now >= claim.expires:
        return "expired"
    if state in ENDED:
        return f"holder run {state}"
    return None


def needs_state(claim: Claim | None, run_id: str, now: float) -> bool:
    """Whether Airflow must be asked about the holder: only a live claim of another run."""
    return takeover_reason(claim, run_id, now, None) is None


def read_claim(root: Path) -> Claim | None:
    """The claim in ``root``'s ``HOLDER``: None if there is none, ``UNREADABLE`` if it is damaged or a link."""
    try:  # pods can write here: never a link, a FIFO (which would block) or a file of gigabytes
        return Claim.from_dict(read_json_capped(root / HOLDER, HOLDER_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return UNREADABLE


@dataclass
class Lease:
    """A claim this process holds; ``keep()`` renews it when due, ``renew()`` at once."""

    root: Path
    claim: Claim
    ttl_s: float
    clock: Callable[[], float] = field(default=time.time, repr=False)

    def renew(self) -> None:
        """Extend the claim by ``ttl_s``; ``LineageBusy`` if another claim replaced it meanwhile."""
        now = self.clock()
        with _locked(self.root):
            current = read_claim(self.root)
            if current is None or current.token != self.claim.token:
                raise LineageBusy(_lost(self.root, self.claim, current, now))
            self.claim = _write(self.root, Claim(**{**asdict(current), "renewed": now, "expires": now + self.ttl_s}))

    def keep(self) -> None:
        """Renew once a quarter of the lease has passed: cheap enough to call at every poll."""
        if self.clock() - self.claim.renewed >= self.ttl_s / 4:
            self.renew()

    def release(self) -> None:
        """Give the lineage up, if this claim still holds it."""
        with _locked(self.root):
            current = read_claim(self.root)
            if current is not None and current.token == self.claim.token:
                (self.root / HOLDER).unlink()


def hold(
    root: Path,
    dag_id: str,
    run_id: str,
    ledger: Ledger,
    ttl_s: float = LEASE_S,
    run_state: RunState | None = None,
    clock: Callable[[], float] = time.time,
) -> Lease:
    """Claim the lineage for ``run_id`` for ``ttl_s`` seconds (renew with the returned lease).

    The same run takes its own claim again under a new token (a retried task);
    another run's claim is taken only as ``takeover_reason`` allows, else
    ``LineageBusy`` names the holder and what to do.
    """
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root):
        now = clock()
        current = read_claim(root)
        state = (
            run_state(current.dag_id, current.run_id)
            if run_state and current and needs_state(current, run_id, now)
            else None
        )
        reason = takeover_reason(current, run_id, now, state)
        if reason is None:
            assert current is not None
            raise LineageBusy(
                f"{root}: {current.describe(now)} holds these checkpoints and is still running"
                f"{f' (Airflow: {state})' if state else ''}; runs of one pipeline train one at a time (backfill with"
                f" --max-active-runs 1). If that run is dead, `trainyard lineage release {root}` frees it"
            )
        claim = _write(
            root,
            Claim(
                dag_id=dag_id,
                run_id=run_id,
                token=uuid.uuid4().hex,
                since=now,
                renewed=now,
                expires=now + ttl_s,
                ledger=str(ledger.path),
            ),
        )
    if reason == "same run":
        return Lease(root, claim, ttl_s, clock)  # a deferred wake or a retry: no news for the ledger
    previous = None if current in (None, UNREADABLE) else asdict(current)
    ledger.append(
        STAGE,
        "lineage_held",
        root=str(root),
        reason=reason,
        expires=claim.expires,
        **({"previous": {k: previous[k] for k in ("dag_id", "run_id", "expires")}} if previous else {}),
    )
    if previous:
        log.warning("took the lineage %s over from run %s (%s)", root, previous["run_id"], reason)
    return Lease(root, claim, ttl_s, clock)


def renew_held(root: Path, run_id: str, ttl_s: float = LEASE_S, clock: Callable[[], float] = time.time) -> bool:
    """Extend ``run_id``'s claim, whatever its token (a later task of the same run); False if it holds none."""
    if not root.is_dir():
        return False
    with _locked(root):
        current = read_claim(root)
        if current is None or current is UNREADABLE or current.run_id != run_id:
            return False
        now = clock()
        _write(root, Claim(**{**asdict(current), "renewed": now, "expires": now + ttl_s}))
        return True


def keeper(
    root: Path, run_id: str, ttl_s: float = LEASE_S, clock: Callable[[], float] = time.time
) -> Callable[[], None]:
    """``renew_held`` once a quarter of the lease has passed, cheap enough to call per uploaded file:
    a stage after training (a long publish) must not let the claim lapse under it."""
    last = [clock()]

    def keep() -> None:
        if clock() - last[0] >= ttl_s / 4:
            last[0] = clock()
            renew_held(root, run_id, ttl_s, clock)

    return keep


def release(root: Path, run_id: str) -> None:
    """Give the lineage up, if ``run_id`` holds it (the run's report)."""
    if not root.is_dir():
        return
    with _locked(root):
        current = read_claim(root)
        if current is not None and current is not UNREADABLE and current.run_id == run_id:
            (root / HOLDER).unlink()


def force_release(root: Path, seen: Claim) -> bool:
    """Remove the claim a person looked at (``seen``), unless it changed since; True if removed."""
    with _locked(root):
        current = read_claim(root)
        if current is None or current != seen:
            return False
        (root / HOLDER).unlink()
        return True


def _write(root: Path, claim: Claim) -> Claim:
    write_json_atomic(root / HOLDER, asdict(claim))  # temp name then rename: whole or not at all
    return claim


@contextmanager
def _locked(root: Path, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """Exclusive ``flock`` on ``root/.HOLDER.lock`` for one read-compare-write; not forever (pods can open it too)."""
    try:
        fd = os.open(root / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:  # a link or a folder planted under that name
        raise LineageBusy(
            f"{root / LOCK}: cannot open the lineage's lock file ({exc.strerror}); it must be a plain"
            " file: remove it and run again"
        ) from None
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN) or time.monotonic() >= deadline:
                    raise LineageBusy(
                        f"{root / LOCK}: locked by another process for {wait_s:.0f} s; try again"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # closing drops the lock


def _lost(root: Path, mine: Claim, current: Claim | None, now: float) -> str:
    who = (
        current.describe(now)
        if current not in (None, UNREADABLE)
        else "nobody"
        if current is None
        else "a damaged claim"
    )
    return (
        f"{root}: run {mine.run_id} lost its claim on these checkpoints (it lapsed at {_utc(mine.expires)} UTC"
        f" or was released by hand); {who} holds them now. This run stops so that two runs never train on one"
        " lineage; clear its train task once the other run is done"
    )


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t))
