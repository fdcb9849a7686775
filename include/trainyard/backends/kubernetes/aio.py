"""The async executor of ``trainyard.backends.kubernetes.api``: the same requests, sent with ``kubernetes_asyncio``.

The deferrable trigger waits with it; it asks nothing the sync launcher does not ask the same way.
"""

from __future__ import annotations

from typing import Any, TypeVar

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from trainyard.backends.kubernetes.api import Apis, ClientApis, Operation, Request

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
