"""Placeholders in spec strings: ``{{ ds }}`` run templates and ``${VAR}`` environment.

Run templates are filled per DAG run (a nightly partition by logical date);
environment references let one spec serve a laptop and a cluster. Both are
checked when the spec is validated, so a typo fails ``trainyard check`` rather
than a run at 2 a.m. We render with a regex, not Jinja: specs are data, and
only the names below may appear.

``${VAR}`` names an allow-list, not the whole environment: a rendered root lands
in the training processes' environment, pod specs and OpenLineage events, and
the orchestrator's environment holds its secrets (``AIRFLOW__CORE__FERNET_KEY``,
connection URIs). The defaults are harmless names; an admin adds more with the
``[trainyard] spec_variables`` Airflow setting, which the spec layer (no Airflow
import) reads as ``AIRFLOW__TRAINYARD__SPEC_VARIABLES`` (``spec.admin``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

from trainyard.spec.admin import SPEC_VARIABLES, admin_list, setting_env

RUN_VARIABLES = ("ds", "ds_nodash", "dag_id", "run_id")
TEMPLATE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
ENV_REF = re.compile(r"\$\{([^{}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# The one variable with a default: the embedded setup must run with none set.
HOME_VARIABLE = "TRAINYARD_HOME"
# Names every deployment may use: where trainyard and the user keep files, who runs it. None holds a secret.
DEFAULT_VARIABLES = (HOME_VARIABLE, "HOME", "USER", "TMPDIR")
ALLOWED_ENV = setting_env(SPEC_VARIABLES)
HOW_TO_ALLOW = (
    f"use one of {', '.join(DEFAULT_VARIABLES)}, or have the Airflow admin add it to [trainyard] spec_variables"
    f" ({ALLOWED_ENV}); never a secret: the value reaches the training processes and lineage events"
)


def allowed_variables(environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The ``${VAR}`` names a spec may use: the defaults and the admin's ``[trainyard] spec_variables``."""
    return frozenset(n for n in admin_list(SPEC_VARIABLES, DEFAULT_VARIABLES, environ) if _ENV_NAME.match(n))


def default_home() -> str:
    return str(Path.home() / ".trainyard")


def placeholder_problems(
    text: str,
    environ: Mapping[str, str] | None = None,
    names: tuple[str, ...] = RUN_VARIABLES,
    require_set: bool = False,
) -> list[str]:
    """What is wrong with the placeholders in ``text`` (empty when all are known and allowed): template ``names``
    only; ``require_set``: a ``${VAR}`` must also have a value (a training argument would get the literal text)."""
    problems = []
    env = os.environ if environ is None else environ
    allowed = allowed_variables(env)
    for name in TEMPLATE.findall(text):
        if name not in names:
            problems.append(f"unknown template variable {{{{ {name} }}}}; allowed: {', '.join(names)}")
    for name in ENV_REF.findall(text):
        if not _ENV_NAME.match(name):
            problems.append(f"${{{name}}} is not an environment variable name")
        elif name not in allowed:
            problems.append(f"${{{name}}} is not an allowed variable: {HOW_TO_ALLOW}")
        elif require_set and not env.get(name) and name != HOME_VARIABLE:
            problems.append(f"environment variable {name} is not set here; set it where trainyard runs, or drop it")
    leftover = ENV_REF.sub("", TEMPLATE.sub("", text))
    if "{{" in leftover or "}}" in leftover:
        problems.append("unbalanced '{{ }}' template braces")
    return problems


def render(text: str, run: Mapping[str, str], environ: Mapping[str, str] | None = None) -> str:
    """Fill run templates from ``run`` and ``${VAR}`` from the environment.

    Raises ``KeyError`` naming the missing or refused variable; callers add the field path. The allow-list
    is checked here too, not only at validation: a pinned run or a hand-built spec reaches this without
    ``trainyard check``, and this is where a value would leave the orchestrator.
    """
    env = os.environ if environ is None else environ
    allowed = allowed_variables(env)

    def run_value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in run:
            raise KeyError(f"template variable {{{{ {name} }}}} has no value in this context")
        return str(run[name])

    def env_value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in allowed:
            raise KeyError(f"${{{name}}} is not an allowed variable: {HOW_TO_ALLOW}")
        if env.get(name):
            return env[name]
        if name == HOME_VARIABLE:
            return default_home()
        raise KeyError(f"environment variable {name} is not set")

    return ENV_REF.sub(env_value, TEMPLATE.sub(run_value, text))
