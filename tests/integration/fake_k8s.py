"""A fake Kubernetes API server over HTTP on 127.0.0.1, for the launcher's integration tests.

It speaks just enough of the API for the calls trainyard makes -- create, get,
list (with equality and existence label selectors), watch, delete and merge-patch
of any resource, pod logs -- and keeps objects in memory. A watch (``watch=true``)
streams ``ADDED``/``MODIFIED``/``DELETED`` events after its ``resourceVersion``
as newline-delimited JSON until its ``timeoutSeconds``; changes between two looks
of a watch may reach it as one event, as a real server's may after a gap. A watch
from a version ``compact`` has dropped gets the real server's ``ERROR`` event with
code 410 (Gone), after which a client must list again. It is strict where the
real server is: creating an existing name is 409, deleting or reading a
missing one 404, a merge patch with a stale ``resourceVersion`` 409, a
JSON Patch content type with a non-list body 400, and a label or annotation
value that is not a string 400; a label or annotation map a patch empties is
left out of the object, as the server's ``omitempty`` does. Every request is recorded
(verb, API group, resource, namespaced) so tests can check it against RBAC.

The test plays the Job controller and the kubelet: ``spawn_job_pods`` creates
the pods of an Indexed Job, ``set_pod`` moves one through its states; or
``Kubelet`` does both, running each pod's container as a local process.
Its processes share this machine's file system (no mount namespace);
``claim_path`` says where a path a container sees lies on a claim, through
its ``subPath``/``subPathExpr`` mount, as the kubelet resolves it.

``Scheduler`` places pods as kube-scheduler does, with no promise about which
feasible node a pod gets: a random one (seeded) among the nodes its
``nodeSelector``, required node affinity (``matchExpressions`` and
``matchFields``, terms ORed), taints/tolerations and required pod
anti-affinity allow, in a random order, some pods only on a later pass. A pod
that fits no node stays Pending with the condition ``PodScheduled=False``,
reason ``Unschedulable`` and the scheduler's "0/N nodes are available: ..."
message, and is tried again on each pass.
"""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

import forks

from trainyard.backends.local.launcher import process_tree, signal_all

_PATH = re.compile(
    r"^/(?P<prefix>api/v1|apis/[^/]+/[^/]+)(?:/namespaces/(?P<ns>[^/]+))?/(?P<resource>[^/]+)"
    r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$"
)
INDEX = "batch.kubernetes.io/job-completion-index"
_ips = random.Random()  # cluster IPs: distinct across the fake clusters of tests that run at once
HOSTNAME = "kubernetes.io/hostname"
NOW = "2026-01-01T00:00:00Z"


@dataclass(frozen=True)
class Call:
    verb: str
    group: str
    resource: str
    namespaced: bool


def _group(prefix: str) -> str:
    return "" if prefix == "api/v1" else prefix.split("/")[1]


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def _metadata_error(obj: dict[str, Any]) -> str | None:
    """The API server's decoding error for a label or annotation value that is not a string (Go map[string]string)."""
    for field in ("labels", "annotations"):
        for value in (obj.get("metadata", {}).get(field) or {}).values():
            if not isinstance(value, str):
                kind = {bool: "bool", int: "number", float: "number", dict: "object", list: "array"}[type(value)]
                return f"json: cannot unmarshal {kind} into Go struct field ObjectMeta.metadata.{field} of type string"
    return None


def _drop_empty_maps(obj: dict[str, Any]) -> None:
    """What ``omitempty`` does to ObjectMeta: a label or annotation map left empty is not in the object."""
    meta = obj.get("metadata", {})
    for field in ("labels", "annotations"):
        if field in meta and not meta[field]:
            del meta[field]


def _matches(labels: dict[str, str], selector: str) -> bool:
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = re.split(r"==?", term, maxsplit=1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


_TRUE = ("1", "t", "T", "true", "True", "TRUE")  # what the server's strconv.ParseBool takes as true


def _labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["metadata"].get("labels") or {}


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def airflow_connection(server: FakeKube, folder: Path, namespace: str) -> str:
    """An ``AIRFLOW_CONN_*`` value (type kubernetes) reaching ``server`` through a kubeconfig written in ``folder``."""
    config = folder / "kubeconfig"
    config.write_text(
        json.dumps(
            {  # JSON is YAML: kubeconfig loaders read it as is
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": server.url}}],
                "users": [{"name": "fake", "user": {"token": "t"}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake", "namespace": namespace}}],
            }
        )
    )
    return json.dumps({"conn_type": "kubernetes", "extra": {"kube_config_path": str(config), "namespace": namespace}})


class FakeKube:
    """In-memory API server; ``url`` is where a client points its ``host``."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str, str, str], dict[str, Any]] = {}
        self.logs: dict[tuple[str, str], str] = {}
        self.live_logs: dict[tuple[str, str], Path] = {}
        """A running container's output so far (the kubelet's file), served as a real API server serves it."""
        self.calls: list[Call] = []
        self.deletes: list[tuple[str, str, dict[str, Any]]] = []
        """(resource, name, DeleteOptions) of every delete."""
        self.lock = threading.RLock()
        self._changed = threading.Condition(self.lock)
        self._version = 0
        self.compacted = 0
        """Watches from a version older than this get 410 Gone (``compact``)."""
        self.tombstones: list[tuple[int, tuple[str, str, str], dict[str, Any]]] = []
        """(version of the deletion, (prefix, resource, namespace), the object) of every delete, for watches."""
        self._stopping = False
        self._watch_era = 0  # ``end_watches`` ends the watches of earlier eras
        self.forbidden: set[tuple[str, str]] = set()
        """(verb, resource) pairs answered 403 Forbidden, as a Role without them would be."""
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def client(self) -> Any:
        """A real ``kubernetes`` API client pointed at this server."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        return client.ApiClient(config)

    def start(self) -> FakeKube:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self.lock:
            self._stopping = True  # open watches end
            self._changed.notify_all()
        self._server.shutdown()
        self._server.server_close()

    # ------------------------------------------------------------ state, for tests

    def _next_version(self) -> str:
        with self.lock:
            self._version += 1
            self._changed.notify_all()  # open watches look again
            return str(self._version)

    def end_watches(self) -> None:
        """End every open watch, as the server does at its timeout or a restart; clients watch again."""
        with self.lock:
            self._watch_era += 1
            self._changed.notify_all()

    def compact(self) -> None:
        """What etcd's compaction does: the history so far is gone; a watch from before now gets 410 Gone."""
        with self.lock:
            self.compacted = self._version

    def _forget(self, key: tuple[str, str, str, str]) -> dict[str, Any]:
        """Delete an object; a deletion is a change with a version of its own, which watches report."""
        obj = self.objects.pop(key)
        self.tombstones.append((int(self._next_version()), key[:3], obj))
        return obj

    def get(self, prefix: str, resource: str, ns: str, name: str) -> dict[str, Any] | None:
        with self.lock:
            return self.objects.get((prefix, resource, ns, name))

    def items(self, prefix: str, resource: str, ns: str = "") -> list[dict[str, Any]]:
        with self.lock:
            return [o for (p, r, n, _), o in self.objects.items() if p == prefix and r == resource and n == ns]

    def put(self, prefix: str, resource: str, ns: str, obj: dict[str, Any]) -> dict[str, Any]:
        with self.lock:
            meta = obj.setdefault("metadata", {})
            if ns:
                meta["namespace"] = ns
            meta.setdefault("uid", str(uuid.uuid4()))
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            meta["resourceVersion"] = self._next_version()
            self.objects[(prefix, resource, ns, meta["name"])] = obj
            return obj

    def add_node(
        self, name: str, labels: dict[str, str] | None = None, taints: list[dict[str, str]] | None = None
    ) -> None:
        self.put(
            "api/v1",
            "nodes",
            "",
            {
                "apiVersion": "v1",
                "kind": "Node",
                # Every real node carries its hostname label (the topology key of one-pod-per-host).
                "metadata": {"name": name, "labels": {HOSTNAME: name, **(labels or {})}},
                "spec": {"taints": list(taints or [])},
                "status": {"conditions": [{"type": "Ready", "status": "True"}]},
            },
        )

    def spawn_job_pods(self, ns: str, job_name: str) -> list[str]:
        """What the Job controller does for an Indexed Job: one pending pod per completion index."""
        job = self.get("apis/batch/v1", "jobs", ns, job_name)
        assert job is not None, f"no Job {ns}/{job_name}"
        template = job["spec"]["template"]
        names = []
        for i in range(job["spec"]["completions"]):
            meta = template.get("metadata", {})
            pod = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": f"{job_name}-{i}-x{i:04d}",
                    "labels": {**meta.get("labels", {}), "job-name": job_name, INDEX: str(i)},
                    "annotations": {**meta.get("annotations", {}), INDEX: str(i)},
                    "ownerReferences": [
                        {
                            "apiVersion": "batch/v1",
                            "kind": "Job",
                            "name": job_name,
                            "uid": job["metadata"]["uid"],
                            "controller": True,
                        }
                    ],
                },
                "spec": {**json.loads(json.dumps(template["spec"])), "hostname": f"{job_name}-{i}"},
                "status": {"phase": "Pending"},
            }
            names.append(self.put("api/v1", "pods", ns, pod)["metadata"]["name"])
        return names

    def set_pod(
        self,
        ns: str,
        name: str,
        phase: str,
        *,
        node: str | None = None,
        reason: str | None = None,
        message: str | None = None,
        state: dict[str, Any] | None = None,
        log: str | None = None,
        conditions: list[dict[str, Any]] | None = None,
    ) -> None:
        """Move a pod to ``phase``; ``state`` is the trainer container's state (``{"terminated": {...}}``)."""
        with self.lock:
            pod = self.get("api/v1", "pods", ns, name)
            assert pod is not None, f"no pod {ns}/{name}"
            if node:
                pod["spec"]["nodeName"] = node
            status: dict[str, Any] = {"phase": phase}
            if ip := pod.get("status", {}).get("podIP"):
                status["podIP"] = ip  # a pod keeps its IP for life
            if reason:
                status["reason"] = reason
            if message:
                status["message"] = message
            if conditions:
                status["conditions"] = conditions
            if state is not None:
                status["containerStatuses"] = [
                    {
                        "name": "trainer",
                        "image": "trainer",
                        "imageID": "",
                        "ready": False,
                        "restartCount": 0,
                        "state": state,
                    }
                ]
            pod["status"] = status
            pod["metadata"]["resourceVersion"] = self._next_version()
            if log is not None:
                self.logs[(ns, name)] = log

    # ------------------------------------------------------------ HTTP

    def handle(self, method: str, path: str, query: dict[str, list[str]], ctype: str, body: bytes) -> tuple[int, Any]:
        m = _PATH.match(path)
        if not m:
            return 404, _status(404, "NotFound", f"no route {path}")
        prefix, ns, resource, name, sub = m["prefix"], m["ns"] or "", m["resource"], m["name"], m["sub"]
        verb = {"POST": "create", "DELETE": "delete", "PATCH": "patch", "PUT": "update"}.get(method)
        watching = not name and method == "GET" and query.get("watch", [""])[0] in _TRUE
        verb = verb or ("get" if name else "watch" if watching else "list")
        with self.lock:
            self.calls.append(Call(verb, _group(prefix), f"{resource}/{sub}" if sub else resource, bool(ns)))
            if (verb, resource) in self.forbidden:
                return 403, _status(403, "Forbidden", f'cannot {verb} resource "{resource}"')
            key = (prefix, resource, ns, name or "")
            data = json.loads(body) if body else None
            if method == "POST" and not name:
                return self._create(prefix, resource, ns, data)
            if watching:
                since = query.get("resourceVersion", ["0"])[0] or "0"
                timeout = float(query.get("timeoutSeconds", ["1800"])[0])
                selector = query.get("labelSelector", [""])[0]
                # The era when the request came, not when its stream starts: a watch ended between the two ends.
                return 200, self._watch(prefix, resource, ns, selector, int(since), timeout, self._watch_era)
            if method == "GET" and not name:
                selector = query.get("labelSelector", [""])[0]
                items = [
                    o for o in self.items(prefix, resource, ns) if _matches(o["metadata"].get("labels", {}), selector)
                ]
                return 200, {
                    "kind": "List",
                    "apiVersion": "v1",
                    "metadata": {"resourceVersion": str(self._version)},
                    "items": items,
                }
            obj = self.objects.get(key)
            if obj is None:
                return 404, _status(404, "NotFound", f'{resource} "{name}" not found')
            if method == "GET" and sub == "log":
                text = self.logs.get((ns, name))
                live = self.live_logs.get((ns, name))
                if text is None and live is not None and live.exists():
                    text = live.read_text(errors="replace")
                if text is None:
                    return 400, _status(400, "BadRequest", f'container "trainer" in pod "{name}" is waiting to start')
                return 200, text
            if method == "GET":
                return 200, obj
            if method == "DELETE":
                # DeleteOptions come as a body or as query parameters; the API server takes either.
                options = {**(data or {}), **{k: v[0] for k, v in query.items()}}
                return self._delete(key, options)
            if method == "PATCH":
                return self._patch(key, obj, ctype, data)
        return 405, _status(405, "MethodNotAllowed", method)

    def _watch(
        self, prefix: str, resource: str, ns: str, selector: str, since: int, timeout: float, era: int
    ) -> Iterator[dict[str, Any]]:
        """The events of a watch from version ``since``, as the server sends them, until ``timeout`` seconds or
        until ``end_watches`` leaves era ``era``."""
        deadline = time.monotonic() + timeout
        with self.lock:
            if since and since < self.compacted:
                gone = _status(410, "Expired", f"too old resource version: {since} ({self.compacted})")
                events = [{"type": "ERROR", "object": gone}]
            else:
                events = [
                    {"type": "DELETED", "object": obj}
                    for version, where, obj in self.tombstones
                    if version > since and where == (prefix, resource, ns) and _matches(_labels(obj), selector)
                ]
            seen = {}  # name -> the version this watch last reported (or that its client listed)
            for obj in self.items(prefix, resource, ns):
                if _matches(_labels(obj), selector):
                    version = int(obj["metadata"]["resourceVersion"])
                    seen[obj["metadata"]["name"]] = version if version <= since else 0
            events = [json.loads(json.dumps(e)) for e in events]  # copies: the objects change under the lock
        yield from events
        if events and events[0]["type"] == "ERROR":
            return
        while not self._stopping and era == self._watch_era and time.monotonic() < deadline:
            with self.lock:
                now = {
                    o["metadata"]["name"]: o for o in self.items(prefix, resource, ns) if _matches(_labels(o), selector)
                }
                events = []
                for name, obj in now.items():
                    version = int(obj["metadata"]["resourceVersion"])
                    if seen.get(name) != version:
                        events.append({"type": "MODIFIED" if name in seen else "ADDED", "object": obj})
                        seen[name] = version
                for name in [n for n in seen if n not in now]:
                    del seen[name]
                    obj = next(o for _, where, o in reversed(self.tombstones) if o["metadata"]["name"] == name)
                    events.append({"type": "DELETED", "object": obj})
                events = [json.loads(json.dumps(e)) for e in events]
                if not events:
                    self._changed.wait(min(0.5, max(0.0, deadline - time.monotonic())))
            yield from events

    def _create(self, prefix: str, resource: str, ns: str, data: Any) -> tuple[int, Any]:
        name = (data or {}).get("metadata", {}).get("name")
        if not name:
            return 422, _status(422, "Invalid", "metadata.name: Required value")
        if (prefix, resource, ns, name) in self.objects:
            return 409, _status(409, "AlreadyExists", f'{resource} "{name}" already exists')
        error = _metadata_error(data)
        if error:
            return 400, _status(400, "BadRequest", error)
        spec = data.get("spec") or {}
        if resource == "services" and spec.get("clusterIP") != "None":
            # The API server allocates a ClusterIP Service its address. Here a loopback one of its own (all of
            # 127/8 is this machine's), which the kubelet gives the Service's pod too: kube-proxy's part.
            spec["clusterIP"] = f"127.{_ips.randint(1, 254)}.{_ips.randint(0, 255)}.{_ips.randint(1, 254)}"
            data["spec"] = spec
        return 201, self.put(prefix, resource, ns, data)

    def _delete(self, key: tuple[str, str, str, str], options: dict[str, Any]) -> tuple[int, Any]:
        _prefix, resource, ns, name = key
        obj = self._forget(key)
        self.deletes.append((resource, name, options))
        if resource == "jobs" and options.get("propagationPolicy") in ("Foreground", "Background"):
            # The garbage collector: the Job's pods go with it.
            for pod in self.items("api/v1", "pods", ns):
                if any(ref.get("uid") == obj["metadata"]["uid"] for ref in pod["metadata"].get("ownerReferences", [])):
                    self._forget(("api/v1", "pods", ns, pod["metadata"]["name"]))
        return 200, obj

    def _patch(self, key: tuple[str, str, str, str], obj: dict[str, Any], ctype: str, data: Any) -> tuple[int, Any]:
        if ctype.startswith("application/json-patch+json") and not isinstance(data, list):
            return 400, _status(
                400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch"
            )
        if not ctype.startswith(("application/merge-patch+json", "application/strategic-merge-patch+json")):
            return 415, _status(415, "UnsupportedMediaType", ctype)
        wanted = (data or {}).get("metadata", {}).get("resourceVersion")
        if wanted is not None and wanted != obj["metadata"]["resourceVersion"]:
            return 409, _status(
                409, "Conflict", "the object has been modified; please apply your changes to the latest version"
            )
        merged = _merge(obj, data)
        error = _metadata_error(merged)
        if error:
            return 400, _status(400, "BadRequest", error)
        _drop_empty_maps(merged)
        merged["metadata"]["resourceVersion"] = self._next_version()
        self.objects[key] = merged
        return 200, merged


def _handler(fake: FakeKube) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the clients expect
        disable_nagle_algorithm = True  # headers and body are two writes; no 40 ms delayed-ACK stall between

        def _serve(self) -> None:
            url = urlparse(self.path)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            code, payload = fake.handle(
                self.command, url.path, parse_qs(url.query), self.headers.get("Content-Type", ""), body
            )
            if isinstance(payload, Iterator):
                self._stream(code, payload)
                return
            raw = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _stream(self, code: int, events: Iterator[dict[str, Any]]) -> None:
            """A watch: one JSON event a line, each its own chunk, as the API server sends them."""
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                for event in events:
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client went away

        do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _serve

        def log_message(self, format: str, *args: Any) -> None:
            pass  # one line per request otherwise

    return Handler


# ---------------------------------------------------------------- the rest of the cluster

_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
_FIELD = re.compile(r"^metadata\.annotations\['(?P<key>[^']+)'\]$")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` (left as is when undefined) and ``$$`` in command, args and env."""
    return _VAR.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def container_env(pod: dict[str, Any], fake: FakeKube | None = None) -> dict[str, str]:
    """The trainer container's environment as the kubelet builds it: values expanded, downward API resolved,
    a Secret's key read from ``fake`` (``KeyError`` when it is not there: the kubelet does not start it)."""
    env: dict[str, str] = {}
    for item in pod["spec"]["containers"][0].get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
            continue
        if "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            secret = fake.get("api/v1", "secrets", pod["metadata"]["namespace"], ref["name"]) if fake else None
            if secret is None or ref["key"] not in secret.get("data", {}):
                raise KeyError(f"secret {ref['name']} has no key {ref['key']}")
            env[item["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
            continue
        path = item["valueFrom"]["fieldRef"]["fieldPath"]
        if path == "status.podIP":
            env[item["name"]] = pod.get("status", {}).get("podIP", "")
            continue
        field = _FIELD.match(path)
        env[item["name"]] = (
            pod["metadata"].get("annotations", {})[field["key"]]
            if field
            else pod["spec"]["nodeName"]
            if path == "spec.nodeName"
            else ""
        )
    return env


def claim_path(pod: dict[str, Any], path: str, claims: dict[str, Path]) -> Path:
    """Where ``path``, as the trainer container sees it, lies on the persistent volume claims (``claims``:
    claim name -> its root here), as the kubelet mounts them: the deepest ``volumeMount`` holding ``path``,
    then its ``subPath``, or its ``subPathExpr`` expanded with the container's environment (``$(VAR)`` and
    ``$$``, as in env values). As the real ones refuse it: a mount with both (the API server's validation),
    and an expanded ``subPathExpr`` that is absolute or climbs with ``..`` (the kubelet fails the pod).
    ``ValueError`` if no claim's mount holds ``path``."""
    claim_of = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod["spec"].get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    env = container_env(pod)
    held = [
        m
        for m in pod["spec"]["containers"][0].get("volumeMounts", [])
        if m["name"] in claim_of and (path == m["mountPath"] or path.startswith(m["mountPath"].rstrip("/") + "/"))
    ]
    if not held:
        raise ValueError(f"no claim is mounted at {path}")
    mount = max(held, key=lambda m: len(m["mountPath"]))
    if "subPath" in mount and "subPathExpr" in mount:
        raise ValueError(f"volumeMount {mount['mountPath']}: subPath and subPathExpr are mutually exclusive")
    sub = expand(mount["subPathExpr"], env) if "subPathExpr" in mount else mount.get("subPath", "")
    if sub.startswith("/") or ".." in Path(sub).parts:
        raise ValueError(f"volumeMount {mount['mountPath']}: subPath {sub!r} must be relative and not climb")
    rest = path[len(mount["mountPath"]) :].lstrip("/")
    return claims[claim_of[mount["name"]]] / sub / rest


# ---------------------------------------------------------------- the scheduler


def _requirement(req: dict[str, Any], value: str | None) -> bool:
    op, values = req["operator"], req.get("values") or []
    if op == "In":
        return value is not None and value in values
    if op == "NotIn":
        return value is None or value not in values
    if op == "Exists":
        return value is not None
    if op == "DoesNotExist":
        return value is None
    if op in ("Gt", "Lt") and value is not None and value.lstrip("-").isdigit():
        return int(value) > int(values[0]) if op == "Gt" else int(value) < int(values[0])
    return False


def _term(term: dict[str, Any], node: dict[str, Any]) -> bool:
    """One node selector term: every requirement holds (an empty term matches nothing, as in Kubernetes)."""
    labels = node["metadata"].get("labels", {})
    fields = {"metadata.name": node["metadata"]["name"]}
    exprs, flds = term.get("matchExpressions") or [], term.get("matchFields") or []
    if not exprs and not flds:
        return False
    return all(_requirement(r, labels.get(r["key"])) for r in exprs) and all(
        _requirement(r, fields.get(r["key"])) for r in flds
    )


def _node_affinity(pod: dict[str, Any], node: dict[str, Any]) -> bool:
    labels = node["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in (pod["spec"].get("nodeSelector") or {}).items()):
        return False
    required = ((pod["spec"].get("affinity") or {}).get("nodeAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    )
    return required is None or any(_term(t, node) for t in required.get("nodeSelectorTerms") or [])


def _tolerates(tolerations: list[dict[str, Any]], taint: dict[str, Any]) -> bool:
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        if not t.get("key"):
            if t.get("operator") == "Exists":
                return True
            continue
        if t["key"] != taint.get("key"):
            continue
        if t.get("operator") == "Exists" or t.get("value", "") == taint.get("value", ""):
            return True
    return False


def _untolerated(pod: dict[str, Any], node: dict[str, Any]) -> dict[str, Any] | None:
    tolerations = pod["spec"].get("tolerations") or []
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not _tolerates(tolerations, taint):
            return taint
    return None


def _anti_affinity(
    pod: dict[str, Any], node: dict[str, Any], others: list[dict[str, Any]], nodes: dict[str, Any]
) -> bool:
    """True if a required anti-affinity term forbids ``node``: a matching pod already in its topology domain."""
    terms = ((pod["spec"].get("affinity") or {}).get("podAntiAffinity") or {}).get(
        "requiredDuringSchedulingIgnoredDuringExecution"
    ) or []
    for term in terms:
        key, wanted = term["topologyKey"], (term.get("labelSelector") or {}).get("matchLabels") or {}
        domain = node["metadata"].get("labels", {}).get(key)
        for other in others:
            there = nodes.get(other["spec"].get("nodeName") or "")
            if there is None or other.get("status", {}).get("phase") in ("Succeeded", "Failed"):
                continue
            labels = other["metadata"].get("labels", {})
            same = domain is not None and there["metadata"].get("labels", {}).get(key) == domain
            if same and all(labels.get(k) == v for k, v in wanted.items()):
                return True
    return False


def why_not(
    pod: dict[str, Any], node: dict[str, Any], others: list[dict[str, Any]], nodes: dict[str, Any]
) -> str | None:
    """Why ``pod`` cannot go to ``node``, in kube-scheduler's words; None if it fits."""
    if (node.get("spec") or {}).get("unschedulable"):
        return "node(s) were unschedulable"
    if not _node_affinity(pod, node):
        return "node(s) didn't match Pod's node affinity/selector"
    taint = _untolerated(pod, node)
    if taint is not None:
        value = f": {taint['value']}" if taint.get("value") else ""
        return f"node(s) had untolerated taint {{{taint['key']}{value}}}"
    if _anti_affinity(pod, node, others, nodes):
        return "node(s) didn't match pod anti-affinity rules"
    return None


def unschedulable_message(reasons: list[str]) -> str:
    n = len(reasons)
    counts = ", ".join(f"{c} {r}" for r, c in sorted(Counter(reasons).items()))
    return (
        f"0/{n} nodes are available: {counts}. preemption: 0/{n} nodes are available: "
        f"{n} Preemption is not helpful for scheduling."
    )


class Scheduler:
    """Binds the namespace's pending pods as kube-scheduler would, with a seeded random choice.

    ``eagerness``: the chance a pending pod is looked at on a pass, so pods are
    placed in any order and some only later. ``placed`` records every binding.
    """

    def __init__(self, fake: FakeKube, namespace: str, seed: int = 0, eagerness: float = 0.6):
        self.fake, self.ns, self.rng, self.eagerness = fake, namespace, random.Random(seed), eagerness
        self.placed: dict[str, str] = {}

    def run_once(self, everyone: bool = False) -> None:
        """One pass over the unbound pods (``everyone``: all of them, none deferred)."""
        with self.fake.lock:
            pods = [p for p in self.fake.items("api/v1", "pods", self.ns) if not p["spec"].get("nodeName")]
            pods = [p for p in pods if p.get("status", {}).get("phase", "Pending") == "Pending"]
            self.rng.shuffle(pods)
            for pod in pods:
                if everyone or self.rng.random() < self.eagerness:
                    self._schedule(pod)

    def _schedule(self, pod: dict[str, Any]) -> None:
        nodes = {n["metadata"]["name"]: n for n in self.fake.items("api/v1", "nodes")}
        others = [p for p in self.fake.items("api/v1", "pods", self.ns) if p is not pod]
        verdicts = {name: why_not(pod, node, others, nodes) for name, node in sorted(nodes.items())}
        fits = [name for name, why in verdicts.items() if why is None]
        status = pod.setdefault("status", {})
        status.setdefault("phase", "Pending")  # what the API server defaults a new pod to
        if not fits:
            message = unschedulable_message([w for w in verdicts.values() if w])
            status["conditions"] = [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": message,
                    "lastTransitionTime": NOW,
                }
            ]
        else:
            node = self.rng.choice(fits)
            pod["spec"]["nodeName"] = node
            status["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": NOW}]
            self.placed[pod["metadata"]["name"]] = node
        pod["metadata"]["resourceVersion"] = self.fake._next_version()


# ---------------------------------------------------------------- the kubelets


class Kubelet:
    """Plays the Job controller, the scheduler (``Scheduler``), the cluster DNS and the kubelets of ``namespace``.

    A new Job gets one pod per completion index; the scheduler binds each pod
    to a node it fits; a bound pod's container starts on a later pass (in any
    order) as a local process with the pod's environment and arguments
    (``python`` is this interpreter; a rendezvous endpoint under a headless
    Service resolves to 127.0.0.1 on a port of its own), and its exit becomes
    the pod's phase, exit code and log. A deleted pod's process is killed;
    ``lose_node`` takes a node away with its pods.
    """

    def __init__(self, fake: FakeKube, namespace: str, log_dir: Any = None, seed: int = 0):
        self.fake, self.ns = fake, namespace
        self.scheduler = Scheduler(fake, namespace, seed)
        self.rng = random.Random(seed + 1)
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="kubelet-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, Any] = {}
        self.jobs: set[str] = set()
        self.ports: dict[str, int] = {}
        self._stop = threading.Event()
        self._crash: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def placed(self) -> dict[str, str]:
        """Pod name -> the node the scheduler bound it to, for every pod so far."""
        return self.scheduler.placed

    def __enter__(self) -> Kubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        for proc in self.procs.values():
            self._kill(proc)
        if self._crash is not None:  # a dead kubelet starts no pod: the test's own failure would mislead
            raise RuntimeError("the fake kubelet's loop crashed") from self._crash

    @staticmethod
    def _kill(proc: Any) -> None:
        """End the pod's whole process tree, as a kubelet ends the container's cgroup.

        Not just the process group: torchrun starts its workers in sessions of their own.
        """
        if proc.poll() is None:
            signal_all(process_tree(proc.pid), signal.SIGKILL)
        proc.wait()

    def lose_node(self, node: str) -> list[str]:
        """The node stops answering: NotReady with the unreachable taints, its pods' processes gone and the
        pods failed with reason NodeLost (what a pod on a lost node reports); returns those pods."""
        with self.fake.lock:
            obj = self.fake.get("api/v1", "nodes", "", node)
            assert obj is not None, f"no node {node}"
            obj["status"] = {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown"}]}
            obj["spec"]["taints"] = [
                *obj["spec"].get("taints", []),
                {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule"},
                {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"},
            ]
            obj["metadata"]["resourceVersion"] = self.fake._next_version()
            lost = [
                p["metadata"]["name"]
                for p in self.fake.items("api/v1", "pods", self.ns)
                if p["spec"].get("nodeName") == node
                and p.get("status", {}).get("phase", "Pending") in ("Pending", "Running")
            ]
            for name in lost:
                if name in self.procs:
                    self._kill(self.procs[name])
                else:
                    self.procs[name] = None  # never to start now
                self.fake.set_pod(
                    self.ns, name, "Failed", reason="NodeLost",
                    message=f"Node {node} which was running pod {name} is unresponsive",
                )  # fmt: skip
        return lost

    def _loop(self) -> None:
        try:
            while not self._stop.wait(0.1):
                self._pass()
        except BaseException as exc:  # raised where the test leaves the kubelet (``__exit__``)
            self._crash = exc

    def _pass(self) -> None:
        """One look at the API and what follows from it. The launcher may delete a Job and its pods at any
        moment of it (it does at a failure), as on a cluster, where the controllers act on a cache."""
        for job in self.fake.items("apis/batch/v1", "jobs", self.ns):
            name = job["metadata"]["name"]
            with self.fake.lock:
                if name not in self.jobs and self.fake.get("apis/batch/v1", "jobs", self.ns, name) is not None:
                    self.jobs.add(name)
                    self.fake.spawn_job_pods(self.ns, name)
        self.scheduler.run_once()
        pods = {p["metadata"]["name"]: p for p in self.fake.items("api/v1", "pods", self.ns)}
        bound = [n for n, p in pods.items() if n not in self.procs and p["spec"].get("nodeName")]
        self.rng.shuffle(bound)
        for name in bound:
            if self.rng.random() < 0.6 and pods[name].get("status", {}).get("phase", "Pending") == "Pending":
                self._start(name, pods[name])
        for name, pod in pods.items():
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is not None and pod.get("status", {}).get("phase") == "Running":
                code = proc.returncode
                self._report(
                    name,
                    "Succeeded" if code == 0 else "Failed",
                    log=(self.log_dir / f"{name}.log").read_text(errors="replace"),
                    state={"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error"}},
                )
        for name, proc in self.procs.items():
            if name not in pods and proc is not None:
                self._kill(proc)  # the pod was deleted

    def _pod_ip(self, pod: dict[str, Any]) -> str:
        """The pod's IP: the cluster IP of a ClusterIP Service that selects it (kube-proxy's part), else loopback."""
        labels = pod["metadata"].get("labels", {})
        for svc in self.fake.items("api/v1", "services", self.ns):
            spec = svc.get("spec") or {}
            wanted = spec.get("selector") or {}
            if (
                spec.get("clusterIP") not in (None, "None")
                and wanted
                and all(labels.get(k) == v for k, v in wanted.items())
            ):
                return spec["clusterIP"]
        return "127.0.0.1"

    def _dns(self, text: str) -> str:
        """Cluster DNS: ``<service>.<ns>.svc.<domain>`` of a ClusterIP Service is its cluster IP."""
        for svc in self.fake.items("api/v1", "services", self.ns):
            ip = (svc.get("spec") or {}).get("clusterIP")
            if ip not in (None, "None"):
                text = re.sub(rf"\b{re.escape(svc['metadata']['name'])}\.{self.ns}\.svc\.[a-z.]+?(?=:|$)", ip, text)
        return text

    def kill_pod(self, name: str) -> None:
        """The pod's container dies (SIGKILL of its process tree, as an OOM kill or a crash would): the pod
        fails with exit code -9 on the next pass."""
        with self.fake.lock:
            proc = self.procs.get(name)
            assert proc is not None, f"pod {name} runs no process"
            signal_all(process_tree(proc.pid), signal.SIGKILL)

    def _start(self, name: str, pod: dict[str, Any]) -> None:
        node = pod["spec"]["nodeName"]
        pod.setdefault("status", {})["podIP"] = self._pod_ip(pod)
        try:
            env = {k: self._dns(v) for k, v in container_env(pod, self.fake).items()}
        except KeyError:
            return  # CreateContainerConfigError: it stays pending until the Secret is there
        container = pod["spec"]["containers"][0]
        argv = [expand(a, env) for a in [*container["command"], *container.get("args", [])]]
        argv = [sys.executable if a == "python" else self._resolve(a) for a in argv]
        with self.fake.lock:  # admitted only if still pending: not deleted, nor failed with its node, since the look
            now = self.fake.get("api/v1", "pods", self.ns, name)
            if now is None or now.get("status", {}).get("phase", "Pending") != "Pending" or name in self.procs:
                return
            # A container running torchrun is a fork of a zygote that imported torch once for every pod (``forks``).
            self.procs[name] = forks.start(argv, {**os.environ, **env}, self.log_dir / f"{name}.log")
            self.fake.live_logs[(self.ns, name)] = self.log_dir / f"{name}.log"
            self.fake.set_pod(self.ns, name, "Running", node=node, state={"running": {"startedAt": NOW}})

    def _report(self, name: str, phase: str, **status: Any) -> None:
        """A status update of the pod; one deleted since the kubelet looked is a 404 it lets go."""
        with self.fake.lock:
            if self.fake.get("api/v1", "pods", self.ns, name) is not None:
                self.fake.set_pod(self.ns, name, phase, **status)

    def _resolve(self, arg: str) -> str:
        """A rendezvous endpoint ``<job>-0.<job>.<ns>.svc.<domain>:<port>``: the DNS answer is 127.0.0.1."""
        prefix = "--rdzv-endpoint="
        if not arg.startswith(prefix) or f".{self.ns}.svc." not in arg:
            return arg
        host = arg[len(prefix) :].rsplit(":", 1)[0]
        if host not in self.ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.ports[host] = s.getsockname()[1]
        return f"{prefix}127.0.0.1:{self.ports[host]}"
