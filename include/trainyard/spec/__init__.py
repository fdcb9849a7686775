"""The pipeline spec: models, loading, error wording and cross-field checks of ``dags/pipelines/*.yaml``.

``models`` holds the pydantic tree and its vocabularies; ``load`` reads YAML
into it (``load_spec``, ``check_files``, ``with_params``); ``messages`` words
validation errors; ``checks`` relates fields, files and rendered values,
``folders`` the dataset folders of a spec and of a folder of specs, ``resume``
where a run may resume from. The
Airflow trigger form built from a spec lives in ``trainyard.airflow.params``.
"""

from trainyard.spec.checks import CRON_PRESETS, URI_SCHEMES, cross_field_problems, positive_number, uri_problems
from trainyard.spec.folders import dataset_name_problems, nested_roots, nested_specs
from trainyard.spec.load import (
    PARAM_FIELDS,
    check_files,
    load_spec,
    parse_yaml,
    spec_files,
    spec_from_data,
    spec_from_text,
    with_params,
)
from trainyard.spec.models import (
    DEFAULT_ACTIONS,
    LAUNCHER_SERVICE_ACCOUNT,
    MAX_NODES,
    PROBES,
    Action,
    BurnInDrill,
    CheckpointSpec,
    DataExpectations,
    DatasetSpec,
    Drill,
    DrillFault,
    FailureKind,
    KubernetesSpec,
    Lifecycle,
    MetricExpectations,
    NodesSpec,
    NotifyOn,
    NotifySpec,
    ParamName,
    PipelineSpec,
    PressureTestSpec,
    Probe,
    RecoverySpec,
    TrainingSpec,
)
from trainyard.spec.resume import resume_problems, resume_root_fields, valid_resume

__all__ = [
    "CRON_PRESETS",
    "DEFAULT_ACTIONS",
    "LAUNCHER_SERVICE_ACCOUNT",
    "MAX_NODES",
    "PARAM_FIELDS",
    "PROBES",
    "URI_SCHEMES",
    "Action",
    "BurnInDrill",
    "CheckpointSpec",
    "DataExpectations",
    "DatasetSpec",
    "Drill",
    "DrillFault",
    "FailureKind",
    "KubernetesSpec",
    "Lifecycle",
    "MetricExpectations",
    "NodesSpec",
    "NotifyOn",
    "NotifySpec",
    "ParamName",
    "PipelineSpec",
    "PressureTestSpec",
    "Probe",
    "RecoverySpec",
    "TrainingSpec",
    "check_files",
    "cross_field_problems",
    "dataset_name_problems",
    "load_spec",
    "nested_roots",
    "nested_specs",
    "parse_yaml",
    "positive_number",
    "resume_problems",
    "resume_root_fields",
    "spec_files",
    "spec_from_data",
    "spec_from_text",
    "uri_problems",
    "valid_resume",
    "with_params",
]
