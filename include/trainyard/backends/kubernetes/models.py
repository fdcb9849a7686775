"""The ``kubernetes`` client's module as ``k8s``, its models built with one shared ``Configuration``.

A model built without one makes its own (``Configuration.get_default_copy``), whose ``debug`` setter
calls ``logging.Logger.setLevel`` twice, and each call clears the level cache of every logger of the
process: ~0.07 ms with Airflow's ~200 loggers, ~0.5 ms in a process with more, for each of the ~60
models of a training pod. An in-place launch of 512 pods spent 16 of its 19 s there. Models only read
their configuration (client-side validation), so one serves them all: the same ~60 models then cost
~0.05 ms.

Type checkers see the module itself; at run time ``k8s.V1Pod(...)`` is the class with the shared
configuration passed, and every other name (``k8s.CoreV1Api``, ``k8s.ApiClient``) is the module's own.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kubernetes import client as _client

SHARED = _client.Configuration()


class _Models:
    def __getattr__(self, name: str) -> Any:
        found = getattr(_client, name)
        if isinstance(found, type) and hasattr(found, "openapi_types"):
            built = functools.partial(found, local_vars_configuration=SHARED)
            setattr(self, name, built)  # looked up once
            return built
        return found


if TYPE_CHECKING:
    from kubernetes import client as k8s
else:
    k8s = _Models()

__all__ = ["SHARED", "k8s"]
