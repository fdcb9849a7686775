"""Placeholders in spec strings: ``{{ ds }}`` run templates and ``${VAR}`` environment.

Run templates are filled per DAG run (a nightly partition by logical date);
environment references let one spec serve a laptop and a cluster. Both are
checked when the spec is validated, so a typo fails ``trainyard check`` rather
than a run at 2 a.m. We render with a regex, not Jinja: specs are data, and
only the names below may appear.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

RUN_VARIABLES = ("ds", "ds_nodash", "dag_id", "run_id")
TEMPLATE = re.compile(r"\{\{\s*([^{}]*?)\s*\}\}")
ENV_REF = re.compile(r"\$\{([^{}]*)\}")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")

# The one variable with a default: the embedded setup must run with none set.
HOME_VARIABLE = "TRAINYARD_HOME"


def default_home() -> str:
    return str(Path.home() / ".trainyard")


def placeholder_problems(text: str) -> list[str]:
    """What is wrong with the placeholders in ``text`` (empty when all are known)."""
    problems = []
    for name in TEMPLATE.findall(text):
        if name not in RUN_VARIABLES:
            problems.append(f"unknown template variable {{{{ {name} }}}}; allowed: {', '.join(RUN_VARIABLES)}")
    for name in ENV_REF.findall(text):
        if not _ENV_NAME.match(name):
            problems.append(f"${{{name}}} is not an environment variable name")
    leftover = ENV_REF.sub("", TEMPLATE.sub("", text))
    if "{{" in leftover or "}}" in leftover:
        problems.append("unbalanced '{{ }}' template braces")
    return problems


def render(text: str, run: Mapping[str, str], environ: Mapping[str, str] | None = None) -> str:
    """Fill run templates from ``run`` and ``${VAR}`` from the environment.

    Raises ``KeyError`` naming the missing variable; callers add the field path.
    """
    env = os.environ if environ is None else environ

    def run_value(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in run:
            raise KeyError(f"template variable {{{{ {name} }}}} has no value in this context")
        return str(run[name])

    def env_value(match: re.Match[str]) -> str:
        name = match.group(1)
        if env.get(name):
            return env[name]
        if name == HOME_VARIABLE:
            return default_home()
        raise KeyError(f"environment variable {name} is not set")

    return ENV_REF.sub(env_value, TEMPLATE.sub(run_value, text))
