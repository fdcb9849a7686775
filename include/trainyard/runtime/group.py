"""The elastic group: the object a training loop calls so that a lost peer costs a regroup, not the run.

A loop asks it for each *generation* it trains in (``form``), runs that
generation's steps inside ``guard`` and marks each step's commit point; the
group does the rest (in the spirit of torchft's ``Manager``: errors are
recorded at one commit point per step, not raised mid-step)::

    group = runtime.elastic_group(ctx, state, wrap=lambda: DDP(module))
    while group.form():                        # a generation: group formed, model wrapped, state resumed
        with group.guard(checkpoints):         # a failed collective ends the generation, not the process
            for step in group.steps():         # after the committed step; ends early where the world grows
                ...forward and backward through group.model...
                loss = group.all_reduce(loss)  # the step's last collective, before the optimizer changes anything
                optimizer.step()
                group.commit(step)
                ...heartbeat, checkpoint...
    if not group.left_out:
        runtime.finish(max(group.step, ctx.max_steps), metrics)

Without ``TRAINYARD_STORE`` the group is the world torchrun formed (``ElasticGroup``
itself): one generation, in which ``form`` wraps the model and resumes from the
checkpoint and every other call is what the loop would do anyway (torchtitan's
habit: fault tolerance is a component that does nothing when off; one loop, not
two). With it, ``InPlaceGroup`` forms each generation the supervisor publishes
(``trainyard.runtime.elastic``): a failed collective in ``guard`` is reported, the
broken group destroyed and the next generation formed with the survivors, which
agree on the last committed step and hand the state to any member behind it
(a joiner); the failed step is redone once. A generation published while one
trains (the world grows back) is taken at a step boundary by every rank at
once: rank 0 reads the store in ``all_reduce`` and the step's one all-reduce
carries its word to the others, so in place costs no extra collective per step
(a loop that never calls ``all_reduce`` pays one small one: the group agrees alone).
The word is a sum any rank adds into, so it only says where to look: each node moves
to the generation it names only if the supervisor sealed that number for it and it is
newer than the current one (``Membership.grown_to``), and reads the members from that
record; an old or forged number is logged and training goes on.

Notice (preemption: SIGTERM, which the kubelet sends on a pod deletion, or a spot interruption's drain)
is taken the same way. The in-place group's SIGTERM handler only sets a flag while the node trains; the
step's all-reduce carries it, so every rank leaves the generation after the same committed step. The
node given notice reports ``leave/<node>`` on the store and exits cleanly (``left_out``); the others wait
for the supervisor's next generation, which leaves it out, and go on from that step with their state:
nothing is lost and no timeout is waited out. A SIGTERM while the node does not train (a spare waiting
to be listed, a regroup in progress) ends it as before (the handler it replaced, or the default).

``state`` is what a joiner receives and a resume loads (``Stateful`` values over
the bare module and the optimizer: nothing in it may hold the process group).
``wrap`` builds the model wrapper (DDP) for the current group; hold the wrapper
only through ``group.model``, which the group drops before it destroys a broken
group (while anything holds it, its sockets stay open and a peer blocked on
this rank waits out the collective timeout).
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from trainyard.errors import TrainingFailed
from trainyard.protocol.coordstore import Generation
from trainyard.runtime import process
from trainyard.runtime.checkpoints import Checkpointer, load_latest
from trainyard.runtime.device import local_ranks
from trainyard.runtime.elastic import Membership, Superseded, is_collective_error
from trainyard.runtime.progress import regrouped, regrouping
from trainyard.runtime.snapshots import Snapshotter
from trainyard.runtime.state import stateful

log = logging.getLogger("trainyard.workload")
SPARE_WAIT_S = 24 * 3600.0  # a node not yet listed is a spare: it waits until used or killed with the attempt


def elastic_group(
    ctx: process.RunContext, state: dict[str, Stateful], wrap: Callable[[], torch.nn.Module]
) -> ElasticGroup:
    """The group this process trains in: in place with ``TRAINYARD_STORE`` (``ctx.store``), else torchrun's world.

    With ``TRAINYARD_STORE`` the process forms no process group of its own: each generation forms one.
    """
    return InPlaceGroup(ctx, state, wrap) if ctx.store is not None else ElasticGroup(ctx, state, wrap)


def params_digest(model: torch.nn.Module) -> str:
    """A short hash of the parameters (of the wrapped module): equal on every rank of a healthy data-parallel run."""
    inner = getattr(model, "module", model)
    h = hashlib.sha256()
    for name, p in sorted(inner.state_dict().items()):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


class ElasticGroup:
    """The calls a loop makes; this base is the fixed world (no ``TRAINYARD_STORE``), where each does nothing
    beyond what the loop would do itself. ``rank``, ``world_size``, ``micro_batch`` (None: the context's),
    ``number`` (of the generation) and ``model`` describe the generation ``form`` made; ``step`` is the last
    committed step on this rank."""

    in_place = False

    def __init__(self, ctx: process.RunContext, state: dict[str, Stateful], wrap: Callable[[], torch.nn.Module]):
        self.ctx, self.state, self.wrap = ctx, stateful(state), wrap  # a bare optimizer keeps its moments
        self.model: Any = None
        self.step = 0
        self.number = 0
        self.rank, self.world_size = 0, 1
        self.micro_batch: int | None = ctx.micro_batch
        self.left_out = False
        """True when a generation left this process out: it stops without finishing (the others go on)."""
        self.snapshots = Snapshotter(ctx)
        """Each trained step's state in the node's memory (``runtime.snapshots``), for a relaunch of the run."""

    def form(self) -> bool:
        """Form the next generation: wrap the model, resume or receive the state. False: there is none (the run
        is done, or this process is left out)."""
        if self.number:
            return False
        self.number, self.rank, self.world_size = 1, process.rank(), process.world_size()
        self.model = self.wrap()
        self.step = load_latest(self.state, ctx=self.ctx)
        return True

    def steps(self) -> Iterator[int]:
        """The steps this generation trains: after the committed one, to ``ctx.max_steps``."""
        for step in range(self.step + 1, self.ctx.max_steps + 1):
            yield step
            self.snapshots.take(step, self.state)  # the loop's body is done: the step is whole

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group in place and return it: the step's last collective, once per step."""
        dist.all_reduce(tensor)
        return tensor

    def commit(self, step: int) -> None:
        """``step`` is applied on this rank (its optimizer step ran): a regroup continues after it."""
        self.step = step

    @contextmanager
    def guard(self, checkpoints: Checkpointer | None = None) -> Iterator[None]:
        """Run a generation's steps: ``checkpoints`` is closed at its end (its last save committed); an error
        leaves a save in flight (it may wait on a dead peer: fail now, not at its timeout) and ends the
        process, except a failed collective in place, which ends the generation."""
        if checkpoints is not None:
            checkpoints.prepare()  # while every member is here: a peer that dies later fails a collective
        try:
            yield
            if checkpoints is not None:
                checkpoints.close()
        except BaseException as exc:
            if checkpoints is not None:
                checkpoints.close(wait=False)
            if not self._survive(exc, checkpoints):
                raise

    def _survive(self, exc: BaseException, checkpoints: Checkpointer | None) -> bool:
        """Whether the group heals ``exc`` (then it has already started to); a fixed world heals nothing."""
        return False


def _as_count(value: float) -> int:
    """A sum of the step's word as a count: any rank adds what it likes, and ``int`` of an infinity or a NaN
    would raise out of every rank's step. A value no honest sum makes (not finite, negative) counts nothing, on
    every rank alike (they all hold the same sum)."""
    return int(value) if math.isfinite(value) and 0 <= value < 2**31 else 0


class InPlaceGroup(ElasticGroup):
    """This process's generations on the supervisor's coordination store (``ctx.store``): gloo on CPU, NCCL on a GPU."""

    in_place = True

    def __init__(
        self,
        ctx: process.RunContext,
        state: dict[str, Stateful],
        wrap: Callable[[], torch.nn.Module],
        membership: Membership | None = None,
    ):
        super().__init__(ctx, state, wrap)
        assert ctx.store is not None, "an in-place group needs TRAINYARD_STORE"
        if membership is None and ctx.store_key is None:
            raise TrainingFailed(
                "TRAINYARD_STORE is set but TRAINYARD_STORE_KEY is not: the supervisor sets both", kind="user_error"
            )
        if membership is None:
            try:
                local_rank, per_node = local_ranks(os.environ)
            except ValueError as exc:
                raise TrainingFailed(str(exc), kind="user_error") from None
            membership = Membership.connect(ctx.store, ctx.node, ctx.store_key or "", ctx.collective_timeout_s,
                                            attempt=ctx.attempt, local_rank=local_rank, per_node=per_node)  # fmt: skip
        self.membership = membership
        self.step = -1  # a joiner holds nothing
        self._after = "start"  # how the last generation ended: "start" (none yet), "done", "grown", "fault"
        self._first = 0  # this process's first generation: the attempt's first resumes from the checkpoint
        self._word: int | None = 0  # the generation rank 0 saw published (None: not reduced yet this step)
        self._grown: Generation | None = None  # the newer generation the word named, as verified by this node
        self._failed_at: int | None = None
        self._fault_at: float | None = None
        self._notice = self._training = self._reported = False  # SIGTERM seen; in a generation; leave reported
        self._noticed = 0  # ranks whose notice the step's all-reduce carried (this rank's own: ``_gave``)
        self._gave = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread only
            self._previous = signal.signal(signal.SIGTERM, self._on_notice)

    def _on_notice(self, signum: int, frame: Any) -> None:
        """SIGTERM: while training, a flag (the next step boundary acts on it); otherwise end as before."""
        if self._training:
            self._notice = True
            return
        signal.signal(signal.SIGTERM, self._previous if self._previous is not None else signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    def form(self) -> bool:
        after, self._after, node = self._after, "done", self.ctx.node
        self._training = False
        gen: Generation | None
        if after == "leave":
            self._release()
            self.membership.leave()
            gen = None if self._reported else self.membership.next_generation()
            if gen is None:
                log.info(
                    "%s: %s at step %d", node, "given notice, leaving" if self._reported else "left out", self.step
                )
        elif after == "start":
            gen = self.membership.next_generation(timeout_s=SPARE_WAIT_S)
            assert gen is not None  # a process that was never a member waits on
            self._first = gen.number
        elif after == "fault":
            gen = self.membership.next_generation()
            if gen is None:
                log.info("%s: left out of the next generation; exiting", node)
        elif after == "grown":
            self._release()  # the group's sockets close with its last reference (see ``_survive``)
            self.membership.leave()
            grown = self._grown
            assert grown is not None  # ``steps`` set it with "grown"
            gen = grown if node in grown.members else None  # the supervisor's sealed record says so, not the word
            if gen is None:
                log.info("%s: left out of generation %d; exiting", node, grown.number)
            else:
                log.info("%s: the world grows to generation %d at step %d", node, grown.number, self.step)
                self._fault_at = None
        else:
            log.info("%s: finished at step %d in generation %d, params %s",
                     node, self.step, self.number, params_digest(self.model))  # fmt: skip
            return False
        if gen is None or not self._join(gen):
            self.left_out = True
            return False
        return True

    def _join(self, gen: Generation) -> bool:
        """Form ``gen``'s group, wrap the model and agree on the committed step (sending the state behind).
        False if the generation that superseded ``gen`` before it formed leaves this node out."""
        ctx, member = self.ctx, self.membership
        self._training = True  # notice from here on waits for a step boundary
        while True:
            try:
                self.rank = member.form(gen)
                break
            except Superseded as newer:
                log.info("%s: %s; forming the newest instead", ctx.node, newer)
                later = member.next_generation()
                if later is None:
                    log.info("%s: left out of the generation after %d; exiting", ctx.node, newer.number)
                    return False
                gen = later
        self.number, self.world_size, self.micro_batch = gen.number, member.world(gen), gen.micro_batch
        self.model = self.wrap()  # DDP broadcasts rank 0's parameters: rank 0 is a survivor (see sync_state)
        if self._first == 1 and member.formed == 1 and ctx.node not in gen.joiners:  # the attempt's first group
            self.step = load_latest(self.state, ctx=ctx)
        elif ctx.node in gen.joiners:
            self.step = -1
        self.step = member.sync_state(self.state, self.step)
        member.ready(self.step)
        if gen.number > self._first or ctx.node in gen.joiners:
            regrouped(gen.number, gen.micro_batch, self.step, gen.joiners, ctx=ctx)
        since = f", {time.monotonic() - self._fault_at:.3f}s after the fault" if self._fault_at is not None else ""
        log.info("%s: generation %d, rank %d of %d, micro batch %d, from step %d, params %s%s", ctx.node, gen.number,
                 self.rank, self.world_size, gen.micro_batch, self.step, params_digest(self.model), since)  # fmt: skip
        self._word = 0
        return True

    def steps(self) -> Iterator[int]:
        for step in range(self.step + 1, self.ctx.max_steps + 1):
            self._word, self._noticed = None, 0
            yield step
            # No snapshot here: in place, the survivors keep the state in their processes, and a snapshot's copy at
            # every step would cost every step of the path that needs none (the relaunch path takes them, above).
            if self._word is None:  # the loop reduced nothing through the group: agree on the word alone
                self.all_reduce(torch.zeros(()))
            if self._noticed and self.step < self.ctx.max_steps:  # notice: every rank leaves after this step
                self._leave()
                return
            if self._word and self.step < self.ctx.max_steps:  # a newer generation: every rank leaves after this step
                self._grown = self.membership.grown_to(self._word)  # if this node can verify it (any rank adds in)
                if self._grown is not None:
                    self._after = "grown"
                    return

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        # One collective for both: a second would cost a round trip per step.
        news = float(self.membership.newer()) if self.rank == 0 else 0.0
        self._gave = self._notice  # the flag as reduced: a later SIGTERM counts at the next step
        word = torch.tensor([news, float(self._gave)], dtype=tensor.dtype, device=tensor.device)
        both = torch.cat([tensor.reshape(-1), word])
        dist.all_reduce(both)
        self._word, self._noticed = (
            _as_count(both[-2].item()),
            _as_count(both[-1].item()),
        )  # on a GPU: waits, or its abort
        self.membership.raise_if_aborted()  # NCCL aborted for a lost peer: the sums are void, the step failed
        return tensor.copy_(both[:-2].view_as(tensor))

    def _leave(self) -> None:
        """Leave the generation after this step because a node was given notice: that node reports it (the
        supervisor publishes a generation without it); every rank then lets the group go, like a world that grows."""
        if self._gave:
            self.membership.report_leave()
            self._reported = True
            log.info("%s: given notice (SIGTERM); leaving generation %d after step %d", self.ctx.node, self.number,
                     self.step)  # fmt: skip
        regrouping(self.step, self.ctx)  # the steps so far reach the ledger while this rank's number holds
        self._fault_at = time.monotonic()
        self._after = "leave"  # ``form`` lets the group go, once ``guard`` committed the last save

    def _survive(self, exc: BaseException, checkpoints: Checkpointer | None) -> bool:
        """A failed collective: report it, let the broken group go and regroup (``form``); at most one step lost."""
        if not isinstance(exc, Exception) or not is_collective_error(exc):
            return False
        failing = self.step + 1
        if self._failed_at == failing:  # the redo failed too: more than one step would be lost
            raise TrainingFailed(
                f"step {failing} failed again after regrouping ({exc}); giving up in-place recovery",
                kind="transient",
            ) from exc
        self._failed_at = failing
        log.warning("%s: collective failed in step %d (%s); regrouping", self.ctx.node, failing, exc)
        regrouping(self.step, self.ctx)  # the steps before the fault, while this rank's number still holds
        self._fault_at = time.monotonic()
        # Nothing may hold the broken group once it is destroyed: DDP (its reducer) does, and while anything
        # does its sockets stay open and a peer blocked on this rank waits out the collective timeout instead
        # of failing at once (measured: 20 s instead of 0.02 s).
        self._release()
        keep = checkpoints.abandon() if checkpoints is not None else None
        self.membership.on_fault(exc, keep=[keep])
        self._after = "fault"
        return True

    def _release(self) -> None:
        """Detach the generation's wrapper from the parameters (the reducer's hooks would use the dead group)
        and drop it: it holds the group alive."""
        model, self.model = self.model, None
        if model is not None and hasattr(model, "reducer"):
            model.reducer._remove_autograd_hooks()
