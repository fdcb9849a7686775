"""The Kubernetes API calls of an attempt, written once for the sync launcher and the async trigger.

A call is a ``Request``: which API (``core``, ``batch``, ``custom``), which
method, its arguments, how the response maps to what trainyard wants, and
which error statuses are answers rather than failures (a 404 on delete:
already gone; a 409 on create: ours already). An operation of several calls
is a generator of requests (``look``, ``create``, ``delete``) that receives each
answer; ``drive`` runs one with the ``kubernetes`` client, and
``trainyard.backends.kubernetes.aio.drive`` with ``kubernetes_asyncio``. The
executors only send and await; what is asked and what an answer means is here.

Imports neither SDK: both clients' models have the same attribute names, and
the executor hands its own ``ApiException`` to ``Request.refused``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar

from trainyard.backends.kubernetes.names import LABEL_NODE, label_value, selector, store_name
from trainyard.backends.kubernetes.status import job_failure_reason

T = TypeVar("T")
ApiName = Literal["core", "batch", "custom"]

PODGROUP_GROUP, PODGROUP_VERSION, PODGROUP_PLURAL = "scheduling.volcano.sh", "v1beta1", "podgroups"
JOB_DELETED = "JobDeleted"
"""The Job's reason when it is gone (deleted by someone else, or by its TTL): no pod will report again."""


class Apis(Protocol):
    """The three API objects of one client (``kubernetes`` or ``kubernetes_asyncio``), by the names requests use."""

    @property
    def core(self) -> Any: ...

    @property
    def batch(self) -> Any: ...

    @property
    def custom(self) -> Any: ...


@dataclass(frozen=True)
class ClientApis:
    core: Any
    batch: Any
    custom: Any

    @classmethod
    def of(cls, client: Any, api_client: Any) -> ClientApis:
        """``client``: the ``kubernetes.client`` or ``kubernetes_asyncio.client`` module (same class names)."""
        return cls(client.CoreV1Api(api_client), client.BatchV1Api(api_client), client.CustomObjectsApi(api_client))


def _same(response: Any) -> Any:
    return response


@dataclass(frozen=True)
class Request:
    api: ApiName
    method: str
    args: tuple[Any, ...] = ()
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    answer: Callable[[Any], Any] = _same
    """The response as the caller wants it."""
    settled: Mapping[int, Any] = field(default_factory=dict)
    """Error status -> the answer it means (404 on delete: None, gone already)."""
    otherwise: Callable[[Any], Any] | None = None
    """The answer to any other error (given the exception); None: it is raised."""

    def send(self, apis: Apis) -> Any:
        """The SDK call (a coroutine with ``kubernetes_asyncio``)."""
        return getattr(getattr(apis, self.api), self.method)(*self.args, **self.kwargs)

    def refused(self, exc: Any) -> Any:
        """What the API's error ``exc`` (either SDK's ``ApiException``) answers; raises it when it is a failure."""
        if exc.status in self.settled:
            return self.settled[exc.status]
        if self.otherwise is not None:
            return self.otherwise(exc)
        raise exc


Operation = Generator[Request, Any, T]


def call(apis: Apis, request: Request) -> Any:
    """One request with the ``kubernetes`` client (sync)."""
    from kubernetes.client.exceptions import ApiException

    try:
        response = request.send(apis)
    except ApiException as exc:
        return request.refused(exc)
    return request.answer(response)


def drive(apis: Apis, operation: Operation[T]) -> T:
    """Run ``operation`` with the ``kubernetes`` client: each request's answer is sent back into it."""
    try:
        request = next(operation)
        while True:
            request = operation.send(call(apis, request))
    except StopIteration as done:
        return done.value


# ---------------------------------------------------------------- requests


def list_pods(namespace: str, name: str) -> Request:
    """The attempt's pods (every pod the Job made, by its label)."""
    return Request("core", "list_namespaced_pod", (namespace,), {"label_selector": selector(name)}, lambda r: r.items)


def pod_list(namespace: str, name: str) -> Request:
    """The attempt's pods and the list's ``resourceVersion``, after which a watch goes on (``watch_pods``)."""
    return Request(
        "core", "list_namespaced_pod", (namespace,), {"label_selector": selector(name)},
        lambda r: (r.items, r.metadata.resource_version),
    )  # fmt: skip


def watch_pods(namespace: str, name: str, version: str, timeout_s: int) -> Request:
    """The changes to the attempt's pods after ``version``, streamed until the server ends the watch after
    ``timeout_s``. The answer is the raw response: the executor reads its events line by line."""
    return Request(
        "core",
        "list_namespaced_pod",
        (namespace,),
        {
            "label_selector": selector(name),
            "watch": True,
            "resource_version": version,
            "timeout_seconds": timeout_s,
            "allow_watch_bookmarks": True,
            "_preload_content": False,
            "_request_timeout": timeout_s + 30,  # a connection gone silent (a partition) ends too
        },
    )


def job_reason(namespace: str, name: str) -> Request:
    """Why the Job failed (None while it has not); ``JOB_DELETED`` when it is gone."""
    return Request(
        "batch", "read_namespaced_job", (name, namespace), answer=job_failure_reason, settled={404: JOB_DELETED}
    )


def pod_log(name: str, namespace: str, container: str, lines: int) -> Request:
    """The last ``lines`` of a pod's container log as text; a note when it has none (never started)."""
    # Raw bytes: the client's "str" deserializer would hand back "b'...'" (or parse a log
    # that happens to be JSON), so the response is read and decoded here.
    return Request(
        "core",
        "read_namespaced_pod_log",
        (name, namespace),
        {"container": container, "tail_lines": lines, "_preload_content": False},
        answer=lambda raw: raw.data.decode("utf-8", errors="replace"),
        otherwise=lambda exc: f"# no container log: {exc.status} {exc.reason}",
    )


def _create(api: ApiName, method: str, *args: Any) -> Request:
    """Create; True if made, False if it existed (names come from the plan: it is this attempt's own)."""
    return Request(api, method, args, answer=lambda _: True, settled={409: False})


def _delete(api: ApiName, method: str, *args: Any, **kwargs: Any) -> Request:
    return Request(api, method, args, kwargs, answer=lambda _: None, settled={404: None})


# ---------------------------------------------------------------- operations


STORE_LOST = "CoordinatorLost"
"""An in-place attempt's coordinator pod is gone or ended: no group can form again, every node fails."""


def look(namespace: str, name: str, in_place: bool = False) -> Operation[tuple[list[Any], str | None]]:
    """The attempt's pods and its Job's failure reason: what ``status.attempt_status`` reads."""
    pods = yield list_pods(namespace, name)
    reason = yield from attempt_reason(namespace, name, in_place)
    return pods, reason


def attempt_reason(namespace: str, name: str, in_place: bool = False) -> Operation[str | None]:
    """Why the attempt failed beyond its pods: its Job's failure reason. ``in_place``: no Job; the reason is
    ``STORE_LOST`` when the coordinator pod is not running (or pending)."""
    if not in_place:
        reason = yield job_reason(namespace, name)
        return reason
    store = yield list_pods(namespace, store_name(name))
    alive = [p for p in store if p.metadata.deletion_timestamp is None and _phase(p) in ("Pending", "Running")]
    return None if alive else STORE_LOST


def _phase(pod: Any) -> str:
    return (pod.status.phase if pod.status is not None else None) or "Pending"


def create(namespace: str, job: Any, service: Any, podgroup: Mapping[str, Any] | None) -> Operation[list[str]]:
    """PodGroup (Volcano), Service, then Job: the Job last, so its pods find both. Returns the kinds adopted."""
    adopted = []
    if podgroup is not None:
        made = yield _create(
            "custom", "create_namespaced_custom_object", PODGROUP_GROUP, PODGROUP_VERSION, namespace, PODGROUP_PLURAL,
            podgroup,
        )  # fmt: skip
        adopted += [] if made else ["PodGroup"]
    made = yield _create("core", "create_namespaced_service", namespace, service)
    adopted += [] if made else ["Service"]
    made = yield _create("batch", "create_namespaced_job", namespace, job)
    return adopted + ([] if made else ["Job"])


def delete(namespace: str, name: str, podgroup: bool, in_place: bool = False) -> Operation[None]:
    """Delete Job (with its pods), Service and PodGroup; anything already gone is fine. ``in_place``: the
    attempt's bare pods, its coordinator pod, store Service and keys' Secret instead of a Job and its Service.

    Foreground propagation keeps the Job visible, marked for deletion, until
    its pods are gone, so nobody mistakes a still-draining attempt for none.
    """
    if in_place:
        yield from kill_pods(namespace, name, None)
        store = store_name(name)
        yield _delete("core", "delete_namespaced_pod", store, namespace, grace_period_seconds=0)
        yield _delete("core", "delete_namespaced_service", store, namespace)
        yield _delete("core", "delete_namespaced_secret", store, namespace)
    else:
        yield _delete("batch", "delete_namespaced_job", name, namespace, propagation_policy="Foreground")
        yield _delete("core", "delete_namespaced_service", name, namespace)
    if podgroup:
        yield _delete(
            "custom", "delete_namespaced_custom_object", PODGROUP_GROUP, PODGROUP_VERSION, namespace, PODGROUP_PLURAL,
            name,
        )  # fmt: skip


def create_job(namespace: str, job: Any) -> Operation[bool]:
    """One Job (a checkpoint's verification); True if made, False if it existed."""
    made = yield _create("batch", "create_namespaced_job", namespace, job)
    return bool(made)


def create_in_place(namespace: str, objects: Any) -> Operation[list[str]]:
    """An in-place attempt (``regroup.InPlaceObjects``): PodGroup, the keys' Secret, the store's Service and
    pod, then the nodes' pods (which find both); None for a part not to create. Returns the kinds adopted (a launch interrupted half-way)."""
    adopted = []
    if objects.podgroup is not None:
        made = yield _create(
            "custom", "create_namespaced_custom_object", PODGROUP_GROUP, PODGROUP_VERSION, namespace, PODGROUP_PLURAL,
            objects.podgroup,
        )  # fmt: skip
        adopted += [] if made else ["PodGroup"]
    for kind, method, body in (
        ("Secret", "create_namespaced_secret", objects.secret),
        ("Service", "create_namespaced_service", objects.service),
        ("Pod", "create_namespaced_pod", objects.coordinator),
        *(("Pod", "create_namespaced_pod", pod) for pod in objects.pods),
    ):
        if body is None:  # served already (``KubernetesLauncher.serve_store``)
            continue
        made = yield _create("core", method, namespace, body)
        adopted += [] if made else [kind]
    return adopted


def create_pod(namespace: str, pod: Any) -> Operation[bool]:
    """One more pod in a running in-place attempt (a joiner); True if made."""
    made = yield _create("core", "create_namespaced_pod", namespace, pod)
    return bool(made)


def kill_pods(namespace: str, name: str, nodes: list[str] | None) -> Operation[list[str]]:
    """Delete now (no grace: a hung rank must close its sockets) the pods of attempt ``name`` on ``nodes``
    (None: every node's); returns the pods deleted."""
    pods = yield list_pods(namespace, name)
    wanted = None if nodes is None else {label_value(n) for n in nodes}
    gone = []
    for pod in pods:
        if wanted is None or (pod.metadata.labels or {}).get(LABEL_NODE) in wanted:
            yield _delete("core", "delete_namespaced_pod", pod.metadata.name, namespace, grace_period_seconds=0)
            gone.append(pod.metadata.name)
    return gone


def service_address(namespace: str, name: str, port: int) -> Request:
    """``clusterIP:port`` of Service ``name`` (what the orchestrator dials on the pod network); None if gone."""
    return Request(
        "core",
        "read_namespaced_service",
        (name, namespace),
        answer=lambda svc: f"{svc.spec.cluster_ip}:{port}" if svc.spec and svc.spec.cluster_ip else None,
        settled={404: None},
    )
