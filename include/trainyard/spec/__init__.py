"""The pipeline spec: models, loading, error wording and cross-field checks of ``dags/pipelines/*.yaml``.

``models`` holds the pydantic tree and its vocabularies; ``load`` reads YAML
into it (``load_spec``, ``with_params``); ``messages`` words
validation errors; ``review`` is ``trainyard check`` (``check_files``: every rule
of a file and of a folder of specs, ``ids``: DAG ids, ``ondisk``: what must exist
here, ``present``: text or JSON); ``uris`` words tier URIs; ``checks`` relates fields, files and rendered values,
``folders`` the dataset folders of a spec and of a folder of specs, ``resume``
where a run may resume from. The
Airflow trigger form built from a spec lives in ``trainyard.airflow.params``.
"""

from trainyard.spec.checks import CRON_PRESETS, cross_field_problems, positive_number
from trainyard.spec.folders import dataset_name_problems, nested_roots, nested_specs
from trainyard.spec.load import (
    PARAM_FIELDS,
    load_spec,
    parse_yaml,
    spec_files,
    spec_from_data,
    spec_from_text,
    with_params,
)
from trainyard.spec.models import (
    DEFAULT_ACTIONS,
    FORMAT_SUFFIXES,
    LAUNCHER_SERVICE_ACCOUNT,
    MAX_NODES,
    PROBES,
    Action,
    BurnInDrill,
    CheckpointSpec,
    DataExpectations,
    DataFile,
    DataFormat,
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
    TokenDtype,
    TrainingSpec,
)
from trainyard.spec.resume import resume_problems, resume_root_fields, valid_resume
from trainyard.spec.review import FileReport, Finding, check_files, review
from trainyard.spec.uris import URI_SCHEMES, uri_problems

__all__ = [
    "CRON_PRESETS",
    "DEFAULT_ACTIONS",
    "FORMAT_SUFFIXES",
    "LAUNCHER_SERVICE_ACCOUNT",
    "MAX_NODES",
    "PARAM_FIELDS",
    "PROBES",
    "URI_SCHEMES",
    "Action",
    "BurnInDrill",
    "CheckpointSpec",
    "DataExpectations",
    "DataFile",
    "DataFormat",
    "DatasetSpec",
    "Drill",
    "DrillFault",
    "FailureKind",
    "FileReport",
    "Finding",
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
    "TokenDtype",
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
    "review",
    "spec_files",
    "spec_from_data",
    "spec_from_text",
    "uri_problems",
    "valid_resume",
    "with_params",
]
