"""What the deployment's admin lets a spec name: allow-lists read from Airflow's ``[trainyard]`` settings.

A spec is written by a pipeline author, who may not hold the deployment's secrets or accounts; so a
spec names an environment variable (``${VAR}``) or a pod service account only from a list the admin
controls. The spec layer never imports Airflow (docs/architecture.md, rule 2): it reads each setting
under Airflow's own environment name (``AIRFLOW__TRAINYARD__<OPTION>``); the Airflow layer exports a
value set in ``airflow.cfg`` under that name (``airflow.operators.export_admin_settings``), so the CLI's
``trainyard check`` and every Airflow process read the same list.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

_NAME = re.compile(r"[A-Za-z0-9_.-]+\Z")


def setting_env(option: str) -> str:
    """Airflow's environment name of ``[trainyard] <option>``."""
    return f"AIRFLOW__TRAINYARD__{option.upper()}"


def admin_list(option: str, defaults: tuple[str, ...], environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """``defaults`` and the names the admin set in ``[trainyard] <option>`` (comma- or space-separated)."""
    env = os.environ if environ is None else environ
    extra = re.split(r"[\s,]+", env.get(setting_env(option), "").strip())
    return frozenset(defaults) | {name for name in extra if _NAME.match(name)}


SPEC_VARIABLES = "spec_variables"
POD_SERVICE_ACCOUNTS = "pod_service_accounts"
# The training pods' own account (docker/k8s/trainer-rbac.yaml): no Role is bound to it, so a pod that
# runs as it can call no API; it exists for what a cluster attaches to accounts (image pull secrets,
# workload identity for the object store).
TRAINER_SERVICE_ACCOUNT = "trainyard-trainer"
DEFAULT_POD_SERVICE_ACCOUNTS = (TRAINER_SERVICE_ACCOUNT,)
NOTIFY_CONNECTIONS = "notify_connections"
# A notice carries a connection's credentials to that connection's host: a spec may name only the connections the
# admin meant for notices (the notifiers' own default ids), not the warehouse's or the object store's.
DEFAULT_NOTIFY_CONNECTIONS = ("smtp_default", "slack_default")
OPTIONS = (SPEC_VARIABLES, POD_SERVICE_ACCOUNTS, NOTIFY_CONNECTIONS)


def pod_service_accounts(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The service accounts a spec may run training pods as."""
    return admin_list(POD_SERVICE_ACCOUNTS, DEFAULT_POD_SERVICE_ACCOUNTS, environ)


def notify_connections(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The Airflow connection ids a spec's ``notify`` may send through."""
    return admin_list(NOTIFY_CONNECTIONS, DEFAULT_NOTIFY_CONNECTIONS, environ)
