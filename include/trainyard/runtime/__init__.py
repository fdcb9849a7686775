"""The workload contract: what a training script calls to be run by trainyard.

Any script launched by trainyard (the reference ``python -m trainyard.workload`` or
a user's own) reads its settings from environment variables the launcher sets
and reports through a few calls::

    ctx = runtime.context()                 # the TRAINYARD_* environment, validated
    start = runtime.load_latest(state)      # resume (or 0 for a fresh run)
    micro, accumulation = runtime.follow_batch(ctx)  # TRAINYARD_GLOBAL_BATCH on this world: a scale-down keeps it
    checkpoints = runtime.Checkpointer(ctx) # saves in the background if TRAINYARD_CHECKPOINT_ASYNC=1
    for step in range(start + 1, ctx.max_steps + 1):
        ...
        runtime.heartbeat(step, {"loss": loss})
        if ctx.should_checkpoint(step):
            checkpoints.save(step, state, {"loss": loss})
    checkpoints.close()                     # the last save is committed before "finished"
    runtime.finish(step, {"loss": loss})

``runtime.save_checkpoint(step, state, metrics)`` is the blocking save on its own.

A script that trains through the elastic group instead (``trainyard.runtime.group``)
is one that can regroup in place when a peer is lost: the same loop, with the
group forming each generation, resuming, and marking each step's commit point.
Without TRAINYARD_STORE it is torchrun's world and each call does only what the
loop above does (the reference workload trains this way, always)::

    state = {"train": TrainState(module, optimizer)}          # Stateful, over the bare module
    group = runtime.elastic_group(ctx, state, wrap=lambda: DDP(module))
    while group.form():                                       # wraps the model, resumes or receives the state
        with group.guard(checkpoints):                        # a failed collective ends a generation, not the run
            for step in group.steps():                        # ends early where the world grows in place
                ...forward and backward through group.model (never kept elsewhere)...
                loss = group.all_reduce(loss)                 # the step's one last collective
                optimizer.step()
                group.commit(step)                            # the commit point: a regroup continues after it
                runtime.heartbeat(step, {"loss": loss.item()})
                ...checkpoints.save as above...
    if not group.left_out:                                    # a generation without this node: it just stops
        runtime.finish(max(group.step, ctx.max_steps), {"loss": loss.item()})

With TRAINYARD_STORE set, form no process group yourself: each generation forms its own (gloo, CPU).
The supervisor sets it only for the reference workload today; for any other entrypoint it relaunches.

Environment (set by the launcher; ``trainyard.protocol.env`` declares it):

    TRAINYARD_DATA_DIR          directory of *.tok shards (the hot tier); required
    TRAINYARD_CHECKPOINT_DIR    checkpoint root (step_NNNNNN/ below it); shared by all ranks; required
    TRAINYARD_MAX_STEPS         last step to train (steps are numbered from 1); required
    TRAINYARD_RESUME_FROM       "" or "none": fresh; "latest": newest valid checkpoint under the checkpoint dir
                                (fresh if none); else a checkpoint dir (mounted read-only)
    TRAINYARD_HEARTBEAT_DIR     the node's folder: its beat (node.json) and pulse (node.alive), written by its
                                local rank 0, and each rank's failure record, failure-rank-<RANK>.json (unset:
                                none written)
    TRAINYARD_EVENTS_DIR        the run's events.d/: each writing process appends to a file of its own there
                                (unset: no events)
    TRAINYARD_RUN_ID            default "local"
    TRAINYARD_PIPELINE          the pipeline (the DAG id) the run belongs to
    TRAINYARD_NODE              the node's name in the plan, e.g. "node-1"; set per node (default: host name)
    TRAINYARD_HOST              the machine the node runs on (Kubernetes: the pod's spec.nodeName); set per node
                                (default: host name)
    TRAINYARD_ATTEMPT           attempt number, default 1
    TRAINYARD_GLOBAL_BATCH      sequences per optimizer step over all ranks, default 32
    TRAINYARD_MICRO_BATCH       sequences per forward pass (unset: global / world, no accumulation)
    TRAINYARD_CHECKPOINT_EVERY  steps between checkpoints, default 50 (0: only the last step)
    TRAINYARD_CHECKPOINT_ASYNC  1: ``Checkpointer`` writes checkpoints in the background (default 0)
    TRAINYARD_SEED              default 0
    TRAINYARD_PROGRESS_EVERY_S  seconds between ledger ``step`` events, default 30 (0: one per step); see
                                ``trainyard.protocol.steps``
    TRAINYARD_DRILLS            JSON list of fault drills to act out (``trainyard.runtime.drills``); unset: none
    TRAINYARD_STORE             host:port of the supervisor's coordination store: the run recovers in place
                                (``trainyard.runtime.elastic``); unset: torchrun's process group, as before
    TRAINYARD_STORE_KEY         with TRAINYARD_STORE: this node's key (64 hex digits) that seals what it writes
                                there and opens what the supervisor sealed for it; set per node, never on a
                                command line
    TRAINYARD_COLLECTIVE_TIMEOUT_S with TRAINYARD_STORE: seconds a collective may wait for a silent peer before
                                the node regroups (default 10)
    TRAINYARD_SNAPSHOT_DIR      the run's in-memory snapshot tier (node-local shared memory): each node keeps
                                the training state of recent steps in <dir>/<node>/ for a relaunch of the same
                                run (``trainyard.runtime.snapshots``); unset: no snapshots
    TRAINYARD_SNAPSHOT_EVERY    with TRAINYARD_SNAPSHOT_DIR: steps between snapshots, default 1 (0: none)
    TRAINYARD_METRICS_OTLP      the OTLP/HTTP URL rank 0 pushes live training metrics to, once per progress
                                interval (``trainyard.protocol.live_metrics``); unset: none

Heartbeats are files rather than ledger events because the watcher needs the
latest state of *every* rank cheaply; rank 0 alone writes ledger events (to a
file of its own in TRAINYARD_EVENTS_DIR, see ``trainyard.events.ledger``), and
folds its steps into one ``step`` event per ``TRAINYARD_PROGRESS_EVERY_S``
(plus the first step, checkpoint steps, the last step and any non-finite
loss, which stay exact), so a long run's ledger stays small. Collective calls
(``save_checkpoint``, ``load_latest``) must be made by every rank; rank 0
decides and writes the shared files and broadcasts its outcome, so ranks never
disagree or deadlock on an error.

A rank that dies of an exception leaves a failure record in the heartbeat
folder (``record_failure``; ``trainyard.protocol.records``) saying what kind of
failure it saw, which the supervisor's classifier trusts before any log line.
``context()`` installs a ``sys.excepthook`` that writes it for an uncaught
exception; a script that catches its exceptions itself calls ``record_failure``.
"""

from trainyard.runtime.batch import Batch, follow_batch
from trainyard.runtime.checkpoints import Checkpointer, load_latest, save_checkpoint
from trainyard.runtime.failures import record_failure
from trainyard.runtime.group import ElasticGroup, elastic_group
from trainyard.runtime.process import RunContext, context, rank, share_with_group, world_size
from trainyard.runtime.progress import finish, flush_progress, heartbeat, regrouped
from trainyard.runtime.snapshots import Snapshotter
from trainyard.runtime.state import TrainState

__all__ = [
    "Batch",
    "Checkpointer",
    "ElasticGroup",
    "RunContext",
    "Snapshotter",
    "TrainState",
    "context",
    "elastic_group",
    "finish",
    "flush_progress",
    "follow_batch",
    "heartbeat",
    "load_latest",
    "rank",
    "record_failure",
    "regrouped",
    "save_checkpoint",
    "share_with_group",
    "world_size",
]
