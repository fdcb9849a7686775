"""The attempt trigger's view of its pods: one list, then watches (``PodFollower``), on a client renewed
every ``WATCH_S`` (``_Client``).

What a poll costs does not grow with the attempt: the pods are listed once and then watched
(``backends.kubernetes.podcache``), so a poll reads the cache and one small object (the Job, or in place
the coordinator pod), on a client kept for ``WATCH_S``. A pod's change that ends the attempt wakes the
trigger at once rather than at the next poll. A Role without ``watch`` on pods (a deployment older than
this) gets a list every poll, as before, and one warning.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager, suppress
from typing import TYPE_CHECKING, Any

import aiohttp
from airflow.providers.cncf.kubernetes.hooks.kubernetes import AsyncKubernetesHook
from kubernetes_asyncio.client.exceptions import ApiException

from trainyard.backends.base import AttemptStatus

if TYPE_CHECKING:
    from airflow._shared.logging.types import Logger
from trainyard.backends.kubernetes import aio, api
from trainyard.backends.kubernetes.podcache import PodCache
from trainyard.backends.kubernetes.status import attempt_status, pod_node_status

WATCH_S = 240
"""How long a watch of the pods, and the client it runs on, lasts: then a new client (the hook reloads
short-lived credentials on each: EKS and GKE tokens expire within the hour) and a new watch from where the
last one ended."""


class PodFollower:
    """Keeps an attempt's pods current for its trigger's polls (a mixin of ``KubernetesAttemptTrigger``:
    its ``namespace``, ``job_name``, ``nodes``, ``in_place``, ``poll_interval`` and ``hook``)."""

    namespace: str
    job_name: str
    nodes: list[str]
    in_place: bool
    poll_interval: float
    _client: _Client | None
    _cache: PodCache
    _changed: asyncio.Event
    _settled: asyncio.Event
    _list_only: bool

    if TYPE_CHECKING:  # the trigger's (Airflow's ``LoggingMixin``): declared here, never shadowed

        @property
        def log(self) -> Logger: ...

    def hook(self) -> AsyncKubernetesHook:
        raise NotImplementedError  # the trigger's: its connection

    @asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """A client and the watch that keeps the pods for ``poll``, for as long as the block runs."""
        self._client = _Client(self.hook())
        self._cache, self._changed, self._settled = PodCache(), asyncio.Event(), asyncio.Event()
        follower = asyncio.create_task(self._follow())
        try:
            yield
        finally:
            follower.cancel()
            with suppress(asyncio.CancelledError):
                await follower
            await self._client.close()
            self._client = None

    async def poll(self) -> AttemptStatus:
        """The attempt's state (inside ``watching``): its pods as the watch keeps them, and one read of why
        it failed beyond them (``api.attempt_reason``). Raises the watch's failure until it recovers."""
        assert self._client is not None, "poll() runs inside watching()"
        await self._settled.wait()
        if self._cache.failure is not None:
            raise self._cache.failure
        apis = await self._client.apis()
        reason = await aio.drive(apis, api.attempt_reason(self.namespace, self.job_name, self.in_place))
        return attempt_status(self._cache.pods.values(), self.nodes, reason, in_place=self.in_place)

    async def _follow(self) -> None:
        """Keep the pods current while the trigger runs: a list, then watches one after another (a list again
        after a 410 Gone). A failure is left in the cache for the poll to count, and retried a poll later."""
        assert self._client is not None
        cache = self._cache
        while True:
            try:
                apis = await self._client.apis()
                if cache.version is None or self._list_only:
                    pods, version = await aio.call(apis, api.pod_list(self.namespace, self.job_name))
                    cache.listed(pods, version)
                    self._settled.set()
                    self._changed.set()
                    if self._list_only:
                        await asyncio.sleep(self.poll_interval)
                    continue
                request = api.watch_pods(self.namespace, self.job_name, cache.version, WATCH_S)
                await aio.watch(apis, request, cache, self._pod_changed)
                continue
            except ApiException as exc:
                if exc.status == 403 and cache.version is not None and not self._list_only:
                    self._list_only = True  # it may list but not watch: a Role from before the watch
                    self.log.warning(
                        "may not watch pods in %s (%s): listing them every poll instead; the Role in "
                        "docker/k8s/launcher-rbac.yaml grants watch", self.namespace, exc.reason,
                    )  # fmt: skip
                    continue
                cache.failure = exc
            except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
                cache.failure = exc  # ValueError: a line that is not JSON, or too long for the reader
            self._settled.set()
            self._changed.set()  # the poll counts it now
            await asyncio.sleep(self.poll_interval)

    def _pod_changed(self, kind: str, pod: Any) -> None:
        """Wake ``_quiet`` for a pod gone or no longer running: the changes of pods that start (hundreds at an
        attempt's start) wait for the next poll, so the attempt's status is not worked out again for each."""
        if kind == "DELETED" or pod_node_status(pod, "").state != "running":
            self._changed.set()

    async def _quiet(self, seconds: float) -> None:
        """Wait ``seconds`` for the next poll; less when a pod's change ends the attempt (or the watch failed)."""
        loop = asyncio.get_running_loop()
        until = loop.time() + seconds
        while (left := until - loop.time()) > 0:
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                return
            pods = attempt_status(self._cache.pods.values(), self.nodes, None, in_place=self.in_place)
            if self._cache.failure is not None or pods.state != "running":
                return


class _Client:
    """The trigger's client to the cluster, made anew every ``WATCH_S`` (the hook reloads short-lived
    credentials on each). One replaced is closed at the next renewal: nothing begun on it can still run
    then (a watch lasts ``WATCH_S``, a read seconds)."""

    def __init__(self, hook: AsyncKubernetesHook) -> None:
        self.hook = hook
        self._current: tuple[AsyncExitStack, api.ClientApis, float] | None = None
        self._retired: AsyncExitStack | None = None
        self._lock = asyncio.Lock()  # the poll and the watch may ask at once

    async def apis(self) -> api.ClientApis:
        async with self._lock:
            now = time.monotonic()
            if self._current is None or now - self._current[2] >= WATCH_S:
                if self._retired is not None:
                    await self._retired.aclose()
                self._retired = self._current[0] if self._current else None
                stack = AsyncExitStack()
                client = await stack.enter_async_context(self.hook.get_conn())
                self._current = (stack, aio.apis(client), now)
            return self._current[1]

    async def close(self) -> None:
        for stack in (self._retired, self._current[0] if self._current else None):
            if stack is not None:
                await stack.aclose()
        self._current = self._retired = None
