"""The async executor of ``trainyard.backends.kubernetes.api``: the same requests, sent with ``kubernetes_asyncio``.

The deferrable trigger waits with it; it asks nothing the sync launcher does not ask the same way.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any, TypeVar

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from trainyard.backends.kubernetes.api import Apis, ClientApis, Operation, Request
from trainyard.backends.kubernetes.podcache import PodCache

T = TypeVar("T")


def apis(api_client: Any) -> ClientApis:
    """The API objects of a ``kubernetes_asyncio`` client (the provider's ``AsyncKubernetesHook.get_conn``)."""
    return ClientApis.of(client, api_client)


async def call(apis: Apis, request: Request) -> Any:
    try:
        response = await request.send(apis)
    except ApiException as exc:
        return request.refused(exc)
    return request.answer(response)


async def drive(apis: Apis, operation: Operation[T]) -> T:
    try:
        request = next(operation)
        while True:
            request = operation.send(await call(apis, request))
    except StopIteration as done:
        return done.value


async def watch(apis: Apis, request: Request, cache: PodCache, changed: Callable[[str, Any], None]) -> None:
    """Apply the events of watch ``request`` (``api.watch_pods``) to ``cache`` until the server ends the watch,
    calling ``changed(kind, pod)`` after each change. An expired version (410 Gone) leaves ``cache`` to be
    listed again.

    Read line by line here rather than with ``kubernetes_asyncio.watch``: the cache learns that the watch is
    connected (an earlier failure is over) before any event comes, which may be minutes later.
    """
    response = await request.send(apis)
    try:
        if response.status != 200:
            raise ApiException(status=response.status, reason=response.reason)
        cache.connected()
        async for line in response.content:
            if not line.strip():
                continue
            event = json.loads(line)
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                if obj.get("code") == 410:
                    cache.expire()
                    return
                raise ApiException(status=obj.get("code"), reason=f"{obj.get('reason')}: {obj.get('message')}")
            if kind == "BOOKMARK":
                cache.bookmark(obj["metadata"]["resourceVersion"])
                continue
            if kind not in ("ADDED", "MODIFIED", "DELETED"):
                raise ValueError(f"not a watch event: {line[:120]!r}")
            # One pod into the client's model, as a list would: ``status`` reads models.
            pod = apis.core.api_client.deserialize(SimpleNamespace(data=json.dumps(obj)), "V1Pod")
            cache.seen(kind, pod)
            changed(kind, pod)
    finally:
        response.release()
