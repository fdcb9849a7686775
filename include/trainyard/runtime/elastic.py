"""The worker side of in-place recovery on the store: membership in generations, state sent to the ones behind.

A loop does not call this module; it calls the elastic group (``trainyard.runtime.group``),
which is built on it. When ``TRAINYARD_STORE=host:port`` names the supervisor's coordination store
(``trainyard.protocol.coordstore``), a training process does not take its
process group from torchrun: it forms the group of each *generation* the
supervisor publishes (gloo on the CPU, NCCL on a GPU: ``trainyard.runtime.collectives``;
a ``PrefixStore`` per generation, so two generations never share keys).
Membership is per node: a node of ``L`` ranks (``LOCAL_WORLD_SIZE``)
has ranks ``index * L + LOCAL_RANK`` of a world of ``len(members) * L``
(``generation_rank``), so a node lost takes all its ranks out and a joiner node
brings all of them; its local rank 0 alone tells the supervisor it is a spare or
ready (the group's forming is a barrier of every rank), any rank reports a fault. When a collective fails
(a peer died, or the ``TRAINYARD_COLLECTIVE_TIMEOUT_S`` backstop fired) the
process:

1. reports ``fault/<node>`` (the peer it blames if it can tell, else "unknown";
   gloo's error names an address, not a rank, so today it is "unknown");
2. destroys the broken group: its only operation has failed, so the destructor
   does not block, and closing its sockets fails the peers still waiting on
   this process at once (measured: without it, a 4-rank world's non-neighbour
   waits out the full timeout); an NCCL group's communicators are aborted
   instead, by a hang watch as soon as the supervisor's next generation drops a
   member, so no survivor waits out NCCL's timeout either;
3. keeps any *other* group that a thread may still use (the background
   checkpoint group) in a graveyard, never destructed: a destructor would wait
   for that thread's collective with the dead peer;
4. waits for the next generation that lists it (one that does not: it exits
   cleanly), forms it and agrees with the others on the last committed step;
   a member behind it (a joiner, or a survivor whose last step failed where a
   peer's succeeded) receives the model and optimizer state by broadcast from
   the lowest rank that holds it.

The default process group of each generation is a fresh ``init_process_group``
over the generation's store prefix, so everything built on ``torch.distributed``
(DDP, ``runtime``'s rank-0 broadcasts, DCP) works unchanged.

Everything this node writes to the store is sealed with its key
(``TRAINYARD_STORE_KEY``), and it believes only a generation the supervisor
sealed for it (``trainyard.protocol.coordstore``): a forged or malformed one is
logged and ignored, and the node waits on for an authentic one.
"""

from __future__ import annotations

import gc
import logging
import time
import traceback
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from trainyard.errors import TrainingFailed
from trainyard.protocol import coordstore
from trainyard.protocol.coordstore import Generation
from trainyard.protocol.sealing import KEY_PATTERN
from trainyard.runtime import collectives, device
from trainyard.runtime.broadcast import broadcast_tree
from trainyard.runtime.collectives import is_collective_error  # noqa: F401  (its home before NCCL)

log = logging.getLogger("trainyard.workload")

GATHER_POLL_S = 0.02  # a generation's ranks wait this long at most for the last one to arrive (see ``_gather``)


class Superseded(Exception):
    """The supervisor published a newer generation before every rank of the one being formed arrived."""

    def __init__(self, number: int):
        self.number = number
        super().__init__(f"a generation newer than {number} was published before {number} formed")


DEFAULT_COLLECTIVE_TIMEOUT_S = 10.0
DEFAULT_REGROUP_TIMEOUT_S = 120.0


def parse_address(text: str) -> tuple[str, int]:
    """``host:port`` of TRAINYARD_STORE, or a ``ValueError`` that says what to set."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"TRAINYARD_STORE={text!r} is not host:port; the supervisor sets it to its store's address")
    return host, int(port)


def generation_rank(gen: Generation, node: str, local_rank: int = 0, per_node: int = 1) -> int | None:
    """The rank of ``node``'s local rank ``local_rank`` in ``gen``, whose nodes have ``per_node`` ranks each:
    ``index * per_node + local_rank``; None when ``gen`` does not list ``node``."""
    index = gen.rank_of(node)
    return None if index is None else index * per_node + local_rank


class Membership:
    """This process's membership in the generations published on the coordination store, as local rank
    ``local_rank`` of its node's ``per_node``.

    ``key`` is this node's key (``TRAINYARD_STORE_KEY``): it seals what the node writes and opens what the
    supervisor sealed for it."""

    def __init__(
        self,
        store: dist.Store,
        node: str,
        key: str,
        collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S,
        regroup_timeout_s: float = DEFAULT_REGROUP_TIMEOUT_S,
        local_rank: int = 0,
        per_node: int = 1,
    ):
        if not KEY_PATTERN.match(key):
            raise ValueError(f"{coordstore.KEY_ENV} must hold {node}'s key (64 hex digits); the supervisor sets it")
        if not 0 <= local_rank < per_node:
            raise ValueError(f"local rank {local_rank} of {per_node}: need 0 <= LOCAL_RANK < LOCAL_WORLD_SIZE")
        self.store, self.node, self.key = store, node, key
        self.local_rank, self.per_node = local_rank, per_node
        self.collective_timeout_s, self.regroup_timeout_s = collective_timeout_s, regroup_timeout_s
        self.generation: Generation | None = None
        self.formed = 0  # generations this process has formed
        self.spare_announced = False
        self.graveyard: list[Any] = []  # groups a thread may still block in: never destructed (see module doc)
        self.backend = "gloo"  # the current generation's (``collectives.plan``)
        self.watch: collectives.HangWatch | None = None  # NCCL: aborts a collective a lost peer hangs
        self._refused = ""  # the last refusal logged: a forged value polled at 10 Hz is logged once

    @classmethod
    def connect(
        cls,
        address: str,
        node: str,
        key: str,
        collective_timeout_s: float | None = None,
        timeout_s: float = 30.0,
        attempt: int | None = None,
        local_rank: int = 0,
        per_node: int = 1,
    ) -> Membership:
        """Join the store at ``address`` as local rank ``local_rank`` of ``node``'s ``per_node``, holding ``key``;
        ``attempt``: the keys of that attempt only (``coordstore.attempt_prefix``)."""
        host, port = parse_address(address)
        try:
            store: dist.Store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        except Exception as exc:  # RuntimeError / DistStoreError: the supervisor's store is gone
            raise TrainingFailed(
                f"cannot reach the coordination store TRAINYARD_STORE={address}: {exc}", kind="transient"
            ) from exc
        if attempt is not None:
            store = dist.PrefixStore(coordstore.attempt_prefix(attempt), store)
        timeout = collective_timeout_s or DEFAULT_COLLECTIVE_TIMEOUT_S
        return cls(store, node, key, timeout, local_rank=local_rank, per_node=per_node)

    @property
    def rank(self) -> int:
        gen = self.generation
        rank = self.rank_in(gen) if gen is not None else None
        if rank is None:
            raise RuntimeError(f"{self.node} is not a member of the current generation")
        return rank

    def rank_in(self, gen: Generation) -> int | None:
        """This process's rank in ``gen`` (None: it does not list this node)."""
        return generation_rank(gen, self.node, self.local_rank, self.per_node)

    def world(self, gen: Generation) -> int:
        """The ranks of ``gen``: each member node brings all of its own."""
        return gen.world * self.per_node

    def next_generation(self, timeout_s: float | None = None) -> Generation | None:
        """Wait for a generation newer than the current one; None if it leaves this node out (it should exit).

        A process that has not been a member yet (a warm spare) waits on, until one lists it.
        ``TrainingFailed`` (kind ``transient``: a symptom, the supervisor judges) if none comes within ``timeout_s`` (default: the regroup timeout).
        """
        after = self.generation.number if self.generation is not None else 0
        deadline = time.monotonic() + (self.regroup_timeout_s if timeout_s is None else timeout_s)
        name = coordstore.current_key(self.node)
        while True:
            try:
                gen = self._open(name, coordstore.peek(self.store, name))
                if gen is not None:
                    if gen.number > after and self.node in gen.members:
                        return gen
                    if gen.number > after and self.formed:
                        return None
                    if not self.formed and not self.spare_announced and self.local_rank == 0:  # a spare is ready
                        coordstore.announce_spare(self.store, self.node, self.key, gen.number)
                        self.spare_announced = True
            except (RuntimeError, dist.DistError) as exc:
                raise TrainingFailed(f"lost the coordination store while regrouping: {exc}", kind="transient") from exc
            if time.monotonic() >= deadline:
                raise TrainingFailed(
                    f"{self.node}: no generation after {after} within {self.regroup_timeout_s:.0f}s; "
                    "the supervisor did not regroup",
                    kind="transient",
                )
            time.sleep(coordstore.POLL_S)

    def newer(self) -> int:
        """The number of a generation published after the current one, else 0 (a world that grows publishes
        one while this one trains: rank 0 asks each step and the commit all-reduce tells the others)."""
        name = coordstore.current_key(self.node)
        try:
            gen = self._open(name, coordstore.peek(self.store, name))  # one read per step, as ever
        except (RuntimeError, dist.DistError) as exc:
            raise TrainingFailed(f"lost the coordination store: {exc}", kind="transient") from exc
        current = self.generation.number if self.generation is not None else 0
        return gen.number if gen is not None and gen.number > current else 0

    def grown_to(self, number: int) -> Generation | None:
        """Generation ``number``, named by the step's word, if this node can verify it is the supervisor's and
        newer than the current one; else None (logged once), and the node trains on in its generation.

        The word is a sum every rank adds into, so any rank can name any number: an old generation that
        does not list this node, or one never published. Only the record the supervisor sealed for this node
        under ``number`` says who the members are (the caller reads them from it, never from the word), and
        only a number past the current one moves the node. It is read once, not waited for: the supervisor
        seals every node's copy of a generation before it makes that generation current, so the copy of the
        number rank 0 saw is already there when an honest word arrives."""
        name = coordstore.gen_key(number, self.node)
        current = self.generation.number if self.generation is not None else 0
        try:
            gen = self._open(name, coordstore.peek(self.store, name)) if number > current else None
        except (RuntimeError, dist.DistError) as exc:
            raise TrainingFailed(f"lost the coordination store: {exc}", kind="transient") from exc
        if gen is not None and gen.number == number:
            return gen
        if (why := f"word {number}") != self._refused:
            self._refused = why
            log.warning("%s: the step's word names generation %d, which is not one sealed for it after %d; ignored",
                        self.node, number, current)  # fmt: skip
        return None

    def _open(self, name: str, raw: bytes | None) -> Generation | None:
        """The generation the supervisor sealed under ``name``; None when there is none, or (logged once) when it
        is forged or malformed."""
        if raw is None:
            return None
        try:
            return coordstore.open_generation(self.key, name, raw)
        except ValueError as exc:  # Forged is one: neither may end or crash a healthy node
            if (why := f"{name}: {exc}") != self._refused:
                self._refused = why
                log.warning("%s: refused %s; waiting for the supervisor's own", self.node, why)
            return None

    def leave(self) -> None:
        """Destroy the current group at a step boundary, healthy (every member leaves it at the same step)."""
        self._unwatch()
        if dist.is_initialized():
            dist.destroy_process_group()

    def report_leave(self) -> None:
        """Tell the supervisor this node was given notice and leaves the current generation at this step boundary
        (a lost store: its peers wait for a generation that does not come, and the supervisor sees the exit)."""
        g = self.generation.number if self.generation is not None else 0
        try:
            coordstore.report_leave(self.store, self.node, self.key, g)
        except Exception as problem:
            log.warning("%s: could not report its leave to the coordination store: %s", self.node, problem)

    def form(self, gen: Generation) -> int:
        """Make ``gen``'s group (NCCL on a GPU, else gloo: ``collectives``) this process's default group (a store
        barrier of its members' ranks); the rank."""
        rank = self.rank_in(gen)
        if rank is None:
            raise ValueError(f"generation {gen.number} does not list {self.node}: {gen.members}")
        self._gather(gen, rank)
        prefix = dist.PrefixStore(f"g{gen.number}/pg", self.store)
        group_plan = collectives.form(prefix, rank, self.world(gen), self.collective_timeout_s, device.current())
        self.backend = group_plan.backend
        self.watch = collectives.watch(group_plan, gen, self._newest, coordstore.POLL_S)
        self.generation, self.formed = gen, self.formed + 1
        return rank

    def _gather(self, gen: Generation, rank: int) -> None:
        """Wait until every rank of ``gen`` arrived to form it, or raise ``Superseded`` once the supervisor
        publishes a newer generation first: a member it listed will not come (given notice while ``gen`` was
        published, it left), and gloo's or NCCL's own rendezvous would wait the whole collective timeout for it.

        Every rank must make the same choice, or some would wait in the rendezvous for one that left: the first
        word on ``g<n>/fate`` (one atomic ``compare_set``) decides for all -- "go" from a rank that saw every
        arrival, "abandon" from one that saw a newer generation first. An arrival is a plain key: a forged one
        only lets the ranks on into that rendezvous, as before."""
        arrived = [f"g{gen.number}/arrived/{r}" for r in range(self.world(gen))]
        deadline = time.monotonic() + self.collective_timeout_s
        try:
            self.store.set(arrived[rank], "1")
            while True:
                if self.store.check(arrived):
                    want = "go"
                elif (newest := self._newest()) is not None and newest.number > gen.number:
                    want = "abandon"
                elif time.monotonic() >= deadline:
                    return  # the group's own rendezvous times out and reports, as before
                else:
                    time.sleep(GATHER_POLL_S)
                    continue
                if self.store.compare_set(f"g{gen.number}/fate", "", want) == b"abandon":
                    raise Superseded(gen.number)
                return
        except (RuntimeError, dist.DistError) as exc:
            raise TrainingFailed(f"lost the coordination store while forming a group: {exc}", kind="transient") from exc

    def on_fault(self, exc: BaseException, keep: list[Any] | None = None) -> None:
        """Report the failed collective, bury ``keep`` (groups a thread may use) and destroy the broken group.

        The caller must have dropped its own references to the group (DDP holds one): the group's sockets
        close only when the last reference goes. The failed call's frames hold one too; they are cleared here.
        """
        g = self.generation.number if self.generation is not None else 0
        try:
            coordstore.report_fault(self.store, self.node, self.key, g, f"{type(exc).__name__}: {exc}", suspect=None)
        except Exception as problem:  # the supervisor still sees the death through its launcher
            log.warning("could not report the fault to the coordination store: %s", problem)
        self.graveyard.extend(group for group in keep or [] if group is not None)
        began = time.monotonic()
        traceback.clear_frames(exc.__traceback__)  # the collective's frames hold the group in their locals
        self._unwatch()
        # Its op failed: no wait. gloo: closing its sockets fails the peers still waiting on this process; NCCL:
        # its communicators are aborted. Either unregisters the buried groups, which the graveyard keeps alive.
        how = collectives.abort(self.backend)
        gc.collect()
        log.info("%s: %s generation %d's %s group in %.3fs", self.node, how, g, self.backend, time.monotonic() - began)

    def _newest(self) -> Generation | None:
        """The current generation as the supervisor sealed it for this node (the hang watch's one read)."""
        name = coordstore.current_key(self.node)
        return self._open(name, coordstore.peek(self.store, name))

    def _unwatch(self) -> None:
        watch, self.watch = self.watch, None
        if watch is not None:
            watch.stop()

    def raise_if_aborted(self) -> None:
        """A failed-collective error if the hang watch aborted this generation (its last results are void)."""
        if self.watch is not None:
            self.watch.raise_if_fired()

    def sync_state(self, state: Mapping[str, Stateful], step: int) -> int:
        """Agree on the last committed step; members behind it receive the state. The step, on every member.

        ``step`` is this member's committed step (-1 for a joiner, which holds nothing). The lowest rank that
        holds the newest step sends its state to the others; a member whose last step failed while a peer's
        committed it is brought forward the same way, so no member ever trains on a state the others lack.
        """
        steps = [torch.zeros((), dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(steps, torch.tensor(step, dtype=torch.int64))
        held = [int(s) for s in steps]
        newest = max(held)
        if min(held) == newest:
            return newest
        src = held.index(newest)
        tree = {k: v.state_dict() for k, v in state.items()} if dist.get_rank() == src else None
        received = broadcast_tree(tree, src)
        if step != newest:
            for key, value in state.items():
                value.load_state_dict(received[key])
        behind = [r for r, s in enumerate(held) if s != newest]
        number = self.generation.number if self.generation is not None else 0
        log.info("generation %d: rank %d sent the state of step %d to ranks %s", number, src, newest, behind)
        return newest

    def ready(self, step: int) -> None:
        """Tell the supervisor this node formed the current generation and continues after ``step`` (its local
        rank 0 alone: the group formed only once every rank of every member joined it)."""
        if self.generation is not None and self.local_rank == 0:
            coordstore.report_ready(self.store, self.generation.number, self.node, self.key, step)
