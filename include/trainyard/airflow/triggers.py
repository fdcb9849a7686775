"""Deferrable wait for a Kubernetes training attempt: ``KubernetesAttemptTrigger``.

While an attempt runs for hours, the train task need not hold a worker slot:
it defers to this trigger, which polls the attempt's pods from the triggerer
and fires once with the same ``NodeStatus`` records the launcher's ``poll``
returns (``trainyard.backends.kubernetes.status.attempt_status``), so the task that
resumes decides exactly as the supervisor would. It only waits: every API call
is a request of ``trainyard.backends.kubernetes.api``, the launcher's own,
sent with the async client (``trainyard.backends.kubernetes.aio``).

The connection to the cluster goes through the cncf-kubernetes provider's
``AsyncKubernetesHook`` (an Airflow Kubernetes connection, in-cluster
config, or a kubeconfig file), as the provider's own ``KubernetesJobTrigger``
does.

Its pods are listed once and then watched (``airflow.podwatch.PodFollower``); what each poll saw is
judged by the one look every driver shares (``recovery.look``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
from airflow.triggers.base import BaseTrigger, TriggerEvent
from kubernetes_asyncio.client.exceptions import ApiException

from trainyard.airflow.podwatch import PodFollower, _Client
from trainyard.backends.base import AttemptStatus
from trainyard.backends.kubernetes import aio, api
from trainyard.backends.kubernetes.podcache import PodCache
from trainyard.backends.kubernetes.status import (
    status_from_dicts,
    status_to_dicts,
)
from trainyard.protocol.coordstore import attempt_prefix, faulted_key, peek
from trainyard.recovery.look import ERROR, FAILED, FAULT, REPORTS, SUCCEEDED, TIMEOUT, AttemptView, Reads, look
from trainyard.recovery.observations import Reported
from trainyard.recovery.progress import ProgressLog
from trainyard.recovery.watch import CRASH, HANG, STARTUP_GRACE_S, Detection

CLASSPATH = "trainyard.airflow.triggers.KubernetesAttemptTrigger"
_ARGUMENTS = (
    "namespace",
    "job_name",
    "nodes",
    "poll_interval",
    "kubernetes_conn_id",
    "config_file",
    "cluster_context",
    "in_cluster",
    "timeout_s",
    "max_api_errors",
    "heartbeat_dir",
    "heartbeat_timeout_s",
    "world_size",
    "started",
    "startup_grace_s",
    "podgroup",
    "attempt",
    "target_step",
    "tokens_per_step",
    "progress_every_s",
    "checkpoint_dir",
    "in_place",
    "regrouped",
    "store",
    "generation",
    "faults_seen",
)


class KubernetesAttemptTrigger(PodFollower, BaseTrigger):
    """Fire when the attempt's Job ends: every pod succeeded, or any failed, or a rank hung (or the waiting timed out).

    The event payload (read back by ``reported``, the one place that knows it): ``status``
    (``succeeded``, ``failed``, ``hang``, ``timeout`` or ``error``), ``attempt``, ``namespace``, ``job_name``, ``nodes``
    (``NodeStatus`` records as dicts, in node order; empty with ``error``),
    ``suspects`` (with ``hang``: the nodes whose ranks stopped pulsing) and ``message``.

    Hangs are seen only where the triggerer can read the attempt's heartbeat
    folder (it mounts the hot tier); elsewhere the task checks them when it wakes.
    There, too, it logs a progress line every ``progress_every_s``: the
    triggerer writes a trigger's log lines beside the task's log file
    (``<task log>.trigger.<triggerer id>.log``), and the UI shows them in the task's log.

    :param namespace: namespace of the Job.
    :param job_name: the Job (and label value ``trainyard.io/job`` of its pods).
    :param nodes: node names of the plan, in completion-index order.
    :param poll_interval: seconds between polls.
    :param kubernetes_conn_id: Airflow Kubernetes connection; ignored when ``config_file`` is set.
    :param config_file: path of a kubeconfig file on the triggerer.
    :param cluster_context: kubeconfig context to use.
    :param in_cluster: use the triggerer pod's service account.
    :param timeout_s: give up waiting after this long (``timeout`` event); None: wait as long as the Job runs.
    :param max_api_errors: consecutive failed polls (5xx, connection errors) before an ``error`` event.
    :param heartbeat_dir: the attempt's heartbeat folder (``TRAINYARD_HEARTBEAT_DIR``); None: no hang check.
    :param heartbeat_timeout_s: a rank without progress for this long is hung.
    :param world_size: ranks expected to beat.
    :param started: when the attempt was launched (epoch seconds), for the startup grace.
    :param startup_grace_s: how long a rank may take to beat for the first time.
    :param podgroup: the attempt has a Volcano PodGroup (deleted with the Job on a kill).
    :param attempt: the attempt's number, for the progress lines.
    :param target_step: the run's final step, for the progress lines.
    :param tokens_per_step: tokens of one optimizer step where the spec knows them; None: from the heartbeats or unknown.
    :param progress_every_s: seconds between progress lines; None: none logged.
    :param checkpoint_dir: the pipeline's hot checkpoint root, for the last valid checkpoint; None: unknown.
    :param in_place: the attempt regroups in place: bare pods per node and a coordinator pod, no Job; a node
        without a pod failed (deleted), and so does every node once the coordinator is gone.
    :param regrouped: it regrouped since its launch (``started``: the regroup's time); only ``nodes`` beat.
    :param store: in place, ``host:port`` of the attempt's coordination store: a change of generation
        ``generation``'s fault counter from ``faults_seen`` (a rank's fault or notice to leave) is a ``fault``
        event at once. The counter is only a wake-up (anyone on the pod network can add to it): the task
        believes only the sealed records it then reads, and hands the next trigger the value it saw.
    """

    def __init__(
        self,
        namespace: str,
        job_name: str,
        nodes: list[str],
        poll_interval: float = 10.0,
        kubernetes_conn_id: str | None = None,
        config_file: str | None = None,
        cluster_context: str | None = None,
        in_cluster: bool | None = None,
        timeout_s: float | None = None,
        max_api_errors: int = 5,
        heartbeat_dir: str | None = None,
        heartbeat_timeout_s: float = 300.0,
        world_size: int = 0,
        started: float = 0.0,
        startup_grace_s: float = STARTUP_GRACE_S,
        podgroup: bool = False,
        attempt: int = 0,
        target_step: int = 0,
        tokens_per_step: int | None = None,
        progress_every_s: float | None = None,
        checkpoint_dir: str | None = None,
        in_place: bool = False,
        regrouped: bool = False,
        store: str = "",
        generation: int = 0,
        faults_seen: str = "",
    ) -> None:
        super().__init__()
        self.namespace = namespace
        self.job_name = job_name
        self.nodes = list(nodes)
        self.poll_interval = poll_interval
        self.kubernetes_conn_id = kubernetes_conn_id
        self.config_file = config_file
        self.cluster_context = cluster_context
        self.in_cluster = in_cluster
        self.timeout_s = timeout_s
        self.max_api_errors = max_api_errors
        self.heartbeat_dir = heartbeat_dir
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.world_size = world_size
        self.started = started
        self.startup_grace_s = startup_grace_s
        self.podgroup = podgroup
        self.attempt = attempt
        self.target_step = target_step
        self.tokens_per_step = tokens_per_step
        self.progress_every_s = progress_every_s
        self.checkpoint_dir = checkpoint_dir
        self.in_place = in_place
        self.regrouped = regrouped
        self.store = store
        self.generation = generation
        self.faults_seen = faults_seen
        self._counter: Any = None  # the store's client, once connected
        self._blind = False  # warned once that the heartbeats are out of sight
        # While ``watching`` (made there: asyncio's events belong to the loop that runs the trigger):
        self._client: _Client | None = None
        self._cache = PodCache()
        self._changed = asyncio.Event()  # the cache changed, or the follower failed
        self._settled = asyncio.Event()  # the first list was answered, or failed
        self._list_only = False  # the Role allows no watch: a list every poll

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # Every constructor argument, as stored: the triggerer rebuilds the trigger from these.
        return CLASSPATH, {name: getattr(self, name) for name in _ARGUMENTS}

    def hook(self) -> AsyncKubernetesHook:
        # The provider's async hook reads a kubeconfig path only from the connection's
        # extras (its config_file argument is for the sync hook), so a file is passed as extras.
        extras = {"kube_config_path": self.config_file} if self.config_file else None
        return AsyncKubernetesHook(
            conn_id=self.kubernetes_conn_id,
            in_cluster=self.in_cluster,
            cluster_context=self.cluster_context,
            connection_extras=extras,
        )

    async def on_kill(self) -> None:
        """The user marked the deferred task failed (or cleared it): end the attempt, as ``on_kill`` does
        in the worker. Not on a triggerer restart or a timeout: those leave the attempt running."""
        async with self.hook().get_conn() as client:
            await aio.drive(aio.apis(client), api.delete(self.namespace, self.job_name, self.podgroup, self.in_place))
        self.log.info("task killed: deleted attempt %s/%s", self.namespace, self.job_name)

    def view(self) -> AttemptView:
        """The attempt as the task saw it when it deferred (the one view every driver's look takes)."""
        assert self.heartbeat_dir
        return AttemptView(self.attempt, list(self.nodes), self.world_size, Path(self.heartbeat_dir), self.started,
                           self.heartbeat_timeout_s, self.startup_grace_s, self.regrouped)  # fmt: skip

    async def hang(self, status: AttemptStatus) -> Detection | None:
        """A hung rank, by the supervisor's own rule (``AttemptView.detect``); file reads off the loop."""
        if not self.heartbeat_dir:
            return None
        folder = Path(self.heartbeat_dir)
        if not await asyncio.to_thread(os.path.isdir, folder):
            if not self._blind:
                self._blind = True  # created before the launch: the triggerer does not mount the hot tier
                self.log.warning("heartbeat folder %s is not visible here; the task checks hangs when it wakes", folder)
            return None
        found = await asyncio.to_thread(self.view().detect, status)
        return found if found is not None and found.trigger == HANG else None

    async def faulted(self) -> bool:
        """Whether generation ``generation``'s fault counter changed since the task looked (read off the loop)."""
        if not self.store or not self.generation:
            return False
        return await asyncio.to_thread(self._counter_changed)

    def _counter_changed(self) -> bool:
        from torch.distributed import PrefixStore, TCPStore

        try:
            if self._counter is None:
                host, _, port = self.store.rpartition(":")
                client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
                self._counter = PrefixStore(attempt_prefix(self.attempt), client)
            raw = peek(self._counter, faulted_key(self.generation))
        except (RuntimeError, ValueError, OSError) as exc:  # the pods' status still tells a dead pod
            self._counter = None
            self.log.warning("coordination store %s unreadable: %s", self.store, exc)
            return False
        return (raw or b"").decode(errors="replace") != self.faults_seen

    def progress_log(self) -> ProgressLog | None:
        """Paces this trigger's progress lines, from now (each wake-up starts a new trigger)."""
        if not self.progress_every_s or not self.heartbeat_dir:
            return None
        return ProgressLog(
            self.progress_every_s,
            time.time(),
            attempt=self.attempt,
            world_size=self.world_size,
            target=self.target_step,
            tokens_per_step=self.tokens_per_step,
            heartbeat_dir=Path(self.heartbeat_dir),
            checkpoint_root=Path(self.checkpoint_dir) if self.checkpoint_dir else None,
        )

    async def progress(self, pace: ProgressLog | None) -> None:
        """Log a progress line if one is due; not while the heartbeats are out of sight (all would be unknown)."""
        if pace is None or self._blind:
            return
        if line := await asyncio.to_thread(pace.poll, time.time()):  # file reads off the loop
            self.log.info("%s", line)

    def _event(
        self, status: str, nodes: AttemptStatus | None, message: str, suspects: Sequence[str] = ()
    ) -> TriggerEvent:
        return TriggerEvent(
            {
                "status": status,
                "attempt": self.attempt,
                "namespace": self.namespace,
                "job_name": self.job_name,
                "nodes": status_to_dicts(nodes) if nodes is not None else [],
                "suspects": list(suspects),
                "message": message,
            }
        )

    async def _looked(self, status: AttemptStatus) -> TriggerEvent | None:
        """What this poll saw (``recovery.look``, the rule every driver shares) as the event that wakes the
        task; None: the attempt runs on. The store's word first: a pod that ended after its rank reported a
        fault or a notice to leave is explained by the report (a busy triggerer that polled late saw only the
        end)."""
        crashed = ", ".join(f"{n.where}: {n.reason or f'exit {n.exit_code}'}" for n in status.failed())
        found = Detection(CRASH, crashed) if status.state == FAILED else None
        if status.state == "running":
            found = await self.hang(status)
        faulted = status.state != SUCCEEDED and (found is None or found.trigger == CRASH) and await self.faulted()
        sight = look(self.view() if self.heartbeat_dir else _BLIND, Reads(status, found, faulted=faulted))
        if sight is None:
            return None
        if sight.what == SUCCEEDED:
            return self._event(SUCCEEDED, status, "every node succeeded")
        status_of = {CRASH: FAILED, HANG: HANG, FAULT: FAULT}
        return self._event(status_of[sight.what], status, sight.reason, sight.nodes)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async with self.watching():
            async for event in self._events():
                yield event
                return

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        pace = self.progress_log()
        errors, last = 0, None
        while True:
            try:
                last = await self.poll()
                errors = 0
            except ApiException as exc:
                # 4xx other than throttling (403 from RBAC, 401 expired credentials) will not heal by waiting.
                errors = self.max_api_errors if exc.status and exc.status < 500 and exc.status != 429 else errors + 1
                message = f"Kubernetes API: {exc.status} {exc.reason}"
            except (TimeoutError, aiohttp.ClientError, OSError) as exc:
                errors += 1
                message = f"Kubernetes API unreachable: {exc!r}"
            else:
                if event := await self._looked(last):
                    yield event
                    return
                await self.progress(pace)
            if errors >= self.max_api_errors:
                yield self._event(ERROR, None, message)
                return
            if errors:
                self.log.warning(
                    "poll of %s/%s failed (%d in a row): %s", self.namespace, self.job_name, errors, message
                )
            if deadline is not None and loop.time() >= deadline:
                yield self._event(TIMEOUT, last, f"still running after {self.timeout_s:.0f} s")
                return
            wait = self.poll_interval if deadline is None else min(self.poll_interval, deadline - loop.time())
            await self._quiet(wait)


_STATUSES = REPORTS
_BLIND = AttemptView(0, [], 0, Path(), 0.0, 0.0)
"""The view of a trigger that reads no heartbeats: it judges the pods and the store only."""


def reported(payload: Mapping[str, Any]) -> Reported:
    """The ``KubernetesAttemptTrigger`` event's payload, typed for the deferred driver."""
    status = payload.get("status")
    if status not in _STATUSES:
        raise ValueError(f"attempt trigger event: status {status!r} is not one of {', '.join(_STATUSES)}")
    attempt = payload.get("attempt")
    return Reported(
        status=status,
        message=str(payload.get("message", "")),
        attempt=int(attempt) if attempt else None,  # 0: a trigger not told its attempt
        nodes=status_from_dicts(payload.get("nodes") or []).nodes,
        suspects=[str(n) for n in payload.get("suspects") or []],
    )
