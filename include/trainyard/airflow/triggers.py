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
from trainyard.protocol.coordstore import attempt_prefix, faulted_key, peek
from trainyard.recovery.deferred import AttemptWatch
from trainyard.recovery.look import AS_REPORTED, ERROR, FAILED, SUCCEEDED, TIMEOUT, AttemptView, Reads, look, report
from trainyard.recovery.progress import ProgressLog
from trainyard.recovery.watch import CRASH, HANG, Detection

CLASSPATH = "trainyard.airflow.triggers.KubernetesAttemptTrigger"


class KubernetesAttemptTrigger(PodFollower, BaseTrigger):
    """Fire when the attempt's Job ends: every pod succeeded, or any failed, or a rank hung (or the waiting timed out).

    It takes the ``AttemptWatch`` the deferred driver built and serializes it as is; of its ``handle`` (the
    launcher's ``describe``) it reads the Job's ``namespace`` and ``name``, ``podgroup``, the seconds between
    polls (``poll_s``) and the Airflow connection (``connection``). The event payload is ``look.report``'s
    (read back by ``look.reported``), with the ``namespace`` and ``job_name`` for the log.

    Hangs are seen only where the triggerer can read the attempt's heartbeat
    folder (it mounts the hot tier); elsewhere the task checks them when it wakes.
    There, too, it logs a progress line every ``progress_every_s``: the
    triggerer writes a trigger's log lines beside the task's log file
    (``<task log>.trigger.<triggerer id>.log``), and the UI shows them in the task's log.

    In place (``in_place``: bare pods per node and a coordinator pod, no Job) a node without a pod failed
    (deleted), and so does every node once the coordinator is gone; a change of the store's fault counter of
    ``generation`` from ``faults_seen`` (a rank's fault or notice to leave) is a ``fault`` event at once. The
    counter is only a wake-up (anyone on the pod network can add to it): the task believes only the sealed
    records it then reads, and hands the next trigger the value it saw.

    :param watch: the attempt's ``AttemptWatch`` (or its JSON, as ``serialize`` stored it).
    :param config_file: path of a kubeconfig file on the triggerer, instead of the watch's connection.
    :param max_api_errors: consecutive failed polls (5xx, connection errors) before an ``error`` event.
    :param legacy: the 26 arguments of a trigger serialized before it took a watch (``old_form``).
    """

    def __init__(
        self,
        watch: AttemptWatch | Mapping[str, Any] | None = None,
        config_file: str | None = None,
        max_api_errors: int = 5,
        **legacy: Any,
    ) -> None:
        super().__init__()
        watch = old_form(legacy) if watch is None else watch
        self.watch = watch if isinstance(watch, AttemptWatch) else AttemptWatch.from_json(dict(watch))
        self.config_file, self.max_api_errors = config_file, max_api_errors
        handle = self.watch.handle
        # What the pod follower reads (``PodFollower``).
        self.namespace, self.job_name = str(handle["namespace"]), str(handle["name"])
        self.nodes, self.in_place = list(self.watch.nodes), self.watch.in_place
        self.poll_interval = float(handle.get("poll_s", 5.0))
        self._counter: Any = None  # the store's client, once connected
        self._blind = False  # warned once that the heartbeats are out of sight
        # While ``watching`` (made there: asyncio's events belong to the loop that runs the trigger):
        self._client: _Client | None = None
        self._cache = PodCache()
        self._changed = asyncio.Event()  # the cache changed, or the follower failed
        self._settled = asyncio.Event()  # the first list was answered, or failed
        self._list_only = False  # the Role allows no watch: a list every poll

    def serialize(self) -> tuple[str, dict[str, Any]]:
        # The watch as it came: the triggerer rebuilds the trigger from it.
        return CLASSPATH, {"watch": self.watch.to_json(), "config_file": self.config_file,
                           "max_api_errors": self.max_api_errors}  # fmt: skip

    def hook(self) -> AsyncKubernetesHook:
        # The provider's async hook reads a kubeconfig path only from the connection's
        # extras (its config_file argument is for the sync hook), so a file is passed as extras.
        extras = {"kube_config_path": self.config_file} if self.config_file else None
        return AsyncKubernetesHook(conn_id=self.watch.handle.get("connection"), connection_extras=extras)

    async def on_kill(self) -> None:
        """The user marked the deferred task failed (or cleared it): end the attempt, as ``on_kill`` does
        in the worker. Not on a triggerer restart or a timeout: those leave the attempt running."""
        async with self.hook().get_conn() as client:
            podgroup = bool(self.watch.handle.get("podgroup"))
            await aio.drive(aio.apis(client), api.delete(self.namespace, self.job_name, podgroup, self.in_place))
        self.log.info("task killed: deleted attempt %s/%s", self.namespace, self.job_name)

    async def hang(self, status: AttemptStatus) -> Detection | None:
        """A hung rank, by the supervisor's own rule (``AttemptView.detect``); file reads off the loop."""
        if not self.watch.heartbeat_dir:
            return None
        folder = Path(self.watch.heartbeat_dir)
        if not await asyncio.to_thread(os.path.isdir, folder):
            if not self._blind:
                self._blind = True  # created before the launch: the triggerer does not mount the hot tier
                self.log.warning("heartbeat folder %s is not visible here; the task checks hangs when it wakes", folder)
            return None
        found = await asyncio.to_thread(self.watch.view().detect, status)
        return found if found is not None and found.trigger == HANG else None

    async def faulted(self) -> bool:
        """Whether generation ``generation``'s fault counter changed since the task looked (read off the loop)."""
        if not self.watch.store or not self.watch.generation:
            return False
        return await asyncio.to_thread(self._counter_changed)

    def _counter_changed(self) -> bool:
        from torch.distributed import PrefixStore, TCPStore

        watch = self.watch
        try:
            if self._counter is None:
                host, _, port = watch.store.rpartition(":")
                client = TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=5))
                self._counter = PrefixStore(attempt_prefix(watch.attempt), client)
            raw = peek(self._counter, faulted_key(watch.generation))
        except (RuntimeError, ValueError, OSError) as exc:  # the pods' status still tells a dead pod
            self._counter = None
            self.log.warning("coordination store %s unreadable: %s", watch.store, exc)
            return False
        return (raw or b"").decode(errors="replace") != watch.faults_seen

    async def progress(self, pace: ProgressLog | None) -> None:
        """Log a progress line if one is due; not while the heartbeats are out of sight (all would be unknown)."""
        if pace is None or self._blind:
            return
        if line := await asyncio.to_thread(pace.poll, time.time()):  # file reads off the loop
            self.log.info("%s", line)

    def _event(
        self, status: str, nodes: AttemptStatus | None, message: str, suspects: Sequence[str] = ()
    ) -> TriggerEvent:
        return TriggerEvent(report(status, self.watch.attempt, nodes, message, suspects,
                                   namespace=self.namespace, job_name=self.job_name))  # fmt: skip

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
        sight = look(self.watch.view() if self.watch.heartbeat_dir else _BLIND, Reads(status, found, faulted=faulted))
        if sight is None:
            return None
        if sight.what == SUCCEEDED:
            return self._event(SUCCEEDED, status, "every node succeeded")
        return self._event(AS_REPORTED[sight.what], status, sight.reason, sight.nodes)

    async def run(self) -> AsyncIterator[TriggerEvent]:
        async with self.watching():
            async for event in self._events():
                yield event
                return

    async def _events(self) -> AsyncIterator[TriggerEvent]:
        loop = asyncio.get_running_loop()
        timeout_s = self.watch.wake_s
        deadline = loop.time() + timeout_s
        pace = self.watch.progress_log(time.time())
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
            if loop.time() >= deadline:
                yield self._event(TIMEOUT, last, f"still running after {timeout_s:.0f} s")
                return
            wait = min(self.poll_interval, deadline - loop.time())
            await self._quiet(wait)


_BLIND = AttemptView(0, [], 0, Path(), 0.0, 0.0)
"""The view of a trigger that reads no heartbeats: it judges the pods and the store only."""
_RENAMED = {"job_name": "name", "poll_interval": "poll_s", "kubernetes_conn_id": "connection"}
_HANDLE = ("namespace", "job_name", "podgroup", "poll_interval", "kubernetes_conn_id")
_DROPPED = ("cluster_context", "in_cluster")  # never set by the task that deferred


def old_form(kwargs: Mapping[str, Any]) -> AttemptWatch:
    """The watch of a trigger serialized before it took one (a task deferred by an older version, resumed by
    this one): its arguments were the watch's fields, its handle's, and ``timeout_s`` for ``wake_s``."""
    old = {k: v for k, v in kwargs.items() if k not in _DROPPED and v is not None}
    handle = {_RENAMED.get(k, k): old.pop(k) for k in _HANDLE if k in old}
    if "timeout_s" in old:
        old["wake_s"] = old.pop("timeout_s")
    known = {"attempt": 0, "started": 0.0, "world_size": 0, "heartbeat_dir": "", "target_step": 0}
    return AttemptWatch(**{**known, **old, "nodes": list(old["nodes"]), "handle": handle})
