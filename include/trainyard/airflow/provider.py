"""What Airflow learns about trainyard as a provider package (entry point ``apache_airflow_provider``).

``airflow providers list`` shows it with its version, ``airflow providers links`` its "Training run"
link, ``airflow providers notifications`` its notifier, ``airflow config list`` its ``[trainyard]`` section
(``RETENTION_DAYS`` is the same default where Airflow has not loaded provider configs). The training-runs view is a plugin of its own
(entry point ``airflow.plugins``: ``trainyard.airflow.plugin``), not listed here: a plugin both in this
dict and in the entry point would be registered twice, and Airflow reports the second as an import error.
Nothing here imports Airflow or the library: every Airflow process reads this at start.
"""

from __future__ import annotations

from typing import Any

from trainyard import __version__

PACKAGE = "trainyard"


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": PACKAGE,
        "name": "trainyard",
        "description": "Declarative, self-healing distributed-training pipelines: one YAML spec becomes a DAG that "
        "stages data, checks it, pressure-tests the nodes, trains with torchrun (local processes or Kubernetes "
        "pods), validates checkpoints and publishes them.",
        "versions": [__version__],
        "integrations": [
            {
                "integration-name": "trainyard",
                "external-doc-url": "https://github.com/trainyard/trainyard",
                "tags": ["software"],
            }
        ],
        "operators": [{"integration-name": "trainyard", "python-modules": ["trainyard.airflow.operators"]}],
        "triggers": [{"integration-name": "trainyard", "python-modules": ["trainyard.airflow.triggers"]}],
        "extra-links": ["trainyard.airflow.operators.RunPageLink"],
        "notifications": ["trainyard.airflow.notify.RunNotifier"],
        "config": {
            "trainyard": {
                "description": "trainyard's settings for every pipeline of this deployment.",
                "options": {
                    "runs_retention_days": {
                        "description": "A pipeline's run folders (ledger, report, logs) whose ledger has been quiet "
                        "for longer than this many days are removed by the next run's report task; 0 keeps them all.",
                        "version_added": "0.1.0",
                        "type": "float",
                        "example": "90",
                        "default": "30",
                    },
                    "spec_variables": {
                        "description": "Environment variables a pipeline spec may name as ${VAR}, comma-separated, "
                        "besides TRAINYARD_HOME, HOME, USER and TMPDIR. A rendered value reaches the training "
                        "processes, pod specs and lineage events: never list a secret.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "DATA_ROOT,CKPT_ROOT",
                        "default": "",
                    },
                    "notify_connections": {
                        "description": "Airflow connection ids a spec's notify (email, slack, webhook) may send "
                        "through, comma-separated, besides smtp_default and slack_default. A notice carries the "
                        "connection's credentials to its host: list only connections meant for notices.",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "oncall_hook,team_slack",
                        "default": "",
                    },
                    "pod_service_accounts": {
                        "description": "Service accounts a spec's nodes.kubernetes.service_account may name, "
                        "comma-separated, besides trainyard-trainer. Training pods run untrusted code: list only "
                        "accounts whose permissions that code may have (never Airflow's or the launcher's).",
                        "version_added": "0.1.0",
                        "type": "string",
                        "example": "ml-team-a-trainer",
                        "default": "",
                    },
                },
            }
        },
    }
