"""Spec validation: every bad file gets one clear line naming file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.airflow.params import param_schemas
from trainyard.cli import main as cli
from trainyard.errors import SpecError
from trainyard.spec import check_files, load_spec, with_params

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "dags" / "pipelines").glob("*.yaml"))

GOOD = """\
dataset: {source: "file:///data/tokens/{{ ds }}", name: "tokens/{{ ds }}"}
nodes: {count: 2}
training: {max_steps: 10, global_batch: 8, micro_batch: 2, checkpoint_every: 5}
"""


def spec_text(**sections: str) -> str:
    """GOOD with whole top-level sections replaced or added (``key=None`` text removes one)."""
    lines = {line.split(":", 1)[0]: line for line in GOOD.splitlines()}
    for key, value in sections.items():
        if value is None:
            lines.pop(key)
        else:
            lines[key] = f"{key}: {value}"
    return "\n".join(lines.values()) + "\n"


# (case id, file text, expected fragment of the one problem line after "FILE: ")
BAD = [
    ("yaml-syntax", "nodes: [1\n", "line 2, column 1: invalid YAML"),
    ("empty", "", "the file is empty"),
    ("only-comments", "# nothing here\n", "the file is empty"),
    ("top-level-list", "- a\n- b\n", "the top level must be a mapping of fields, not a list"),
    ("duplicate-key", GOOD + "nodes: {count: 3}\n", "duplicate key 'nodes'"),
    ("unknown-top-key", spec_text(colour="red"), "colour: unknown field; allowed here: catchup, checkpoint"),
    (
        "unknown-nested-key",
        spec_text(nodes="{count: 2, gpus: 8}"),
        "nodes.gpus: unknown field; allowed here: backend, count",
    ),
    ("missing-section", spec_text(dataset=None), "dataset: required field is missing"),
    (
        "missing-field",
        spec_text(training="{max_steps: 10, global_batch: 8, micro_batch: 2}"),
        "training.checkpoint_every: required field is missing",
    ),
    ("wrong-type", spec_text(nodes="{count: two}"), "nodes.count: input should be a valid integer"),
    ("min-above-count", spec_text(nodes="{count: 4, min: 5}"), "nodes.min: 5 must be <= nodes.count (4)"),
    (
        "negative-steps",
        spec_text(training="{max_steps: -3, global_batch: 8, micro_batch: 2, checkpoint_every: 5}"),
        "training.max_steps: -3 is out of range; it should be greater than or equal to 1",
    ),
    ("negative-spare", spec_text(nodes="{count: 2, spare: -1}"), "nodes.spare: -1 is out of range"),
    ("bad-cron", spec_text(schedule='"61 2 * * *"'), "schedule: '61 2 * * *' is not a cron expression"),
    ("bad-preset", spec_text(schedule="'@fortnightly'"), "schedule: '@fortnightly' is not a cron expression"),
    (
        "bad-backend",
        spec_text(nodes="{count: 2, backend: slurm}"),
        "nodes.backend: 'slurm' is not allowed; expected 'local' or 'kubernetes'",
    ),
    (
        "k8s-without-settings",
        spec_text(nodes="{count: 2, backend: kubernetes}"),
        "nodes.kubernetes: required when nodes.backend is kubernetes",
    ),
    (
        "name-escapes-root",
        spec_text(dataset='{source: "file:///d", name: "../../etc"}'),
        "dataset.name: '../../etc' escapes the hot root",
    ),
    (
        "absolute-name",
        spec_text(dataset='{source: "file:///d", name: "/etc"}'),
        "dataset.name: '/etc' escapes the hot root",
    ),
    (
        "uri-with-dotdot",
        spec_text(dataset='{source: "file:///data/../etc", name: t}'),
        "dataset.source: 'file:///data/../etc' may not contain '..'",
    ),
    (
        "relative-file-uri",
        spec_text(dataset='{source: "file://data/x", name: t}'),
        "dataset.source: 'file://data/x' must be an absolute path",
    ),
    (
        "bad-scheme",
        spec_text(dataset='{source: "http://host/x", name: t}'),
        "dataset.source: 'http://host/x' must start with file:// or s3://",
    ),
    (
        "s3-without-connection",
        spec_text(dataset='{source: "s3://bucket/x", name: t}'),
        "dataset.connection: required for an s3:// source",
    ),
    (
        "unknown-template",
        spec_text(dataset='{source: "file:///d/{{ dss }}", name: t}'),
        "dataset.source: unknown template variable {{ dss }}; allowed: ds",
    ),
    (
        "template-in-root",
        spec_text(checkpoint='{hot: "file:///ck/{{ ds }}"}'),
        "checkpoint.hot: run templates are only allowed in dataset.source and dataset.name",
    ),
    (
        "indivisible-batch",
        spec_text(nodes="{count: 3}"),
        "training.global_batch: 8 must be divisible by training.micro_batch x nodes.count x nodes.procs_per_node (2 x 3 x 1 = 6)",
    ),
    (
        "unknown-failure-kind",
        spec_text(recovery="{actions: {meteor: retry}}"),
        "recovery.actions.meteor: 'meteor' is not allowed",
    ),
    (
        "unknown-action",
        spec_text(recovery="{actions: {oom: pray}}"),
        "recovery.actions.oom: 'pray' is not allowed; expected 'retry', 'scale_down', 'rollback' or 'fail'",
    ),
    (
        "bad-entrypoint",
        spec_text(
            training="{entrypoint: 'my script', max_steps: 1, global_batch: 8, micro_batch: 2, checkpoint_every: 5}"
        ),
        "training.entrypoint: 'my script' is neither a dotted module name nor a .py script",
    ),
    (
        "relative-resume",
        spec_text(training="{resume_from: ckpt/x, max_steps: 1, global_batch: 8, micro_batch: 2, checkpoint_every: 5}"),
        "training.resume_from: 'ckpt/x' must be 'latest', 'none' or an absolute checkpoint path",
    ),
    ("unknown-param", spec_text(params="[nodes, gpus]"), "params[1]: 'gpus' is not allowed"),
    (
        "gpus-without-a-rank-each",
        spec_text(nodes="{count: 2, gpus_per_node: 2}"),
        "nodes.procs_per_node: 1 must equal nodes.gpus_per_node (2): trainyard.workload runs one rank per GPU",
    ),
    (
        "pod-gpus-without-a-rank-each",
        spec_text(nodes="{count: 2, backend: kubernetes, kubernetes: {image: t, gpus: 4}}"),
        "nodes.procs_per_node: 1 must equal nodes.kubernetes.gpus (4)",
    ),
    (
        "gpus-per-node-on-kubernetes",
        spec_text(nodes="{count: 2, gpus_per_node: 1, backend: kubernetes, kubernetes: {image: t}}"),
        "nodes.gpus_per_node: local backend only; on Kubernetes set nodes.kubernetes.gpus",
    ),
    (
        "lr-param-without-lr",
        spec_text(params="[nodes, lr]"),
        "params[1]: 'lr' overrides training.args.lr, which is not set",
    ),
    (
        "ratio-above-one",
        spec_text(pressure_test="{straggler_ratio: 1.5}"),
        "pressure_test.straggler_ratio: 1.5 is out of range",
    ),
    (
        "unknown-framework",
        spec_text(training="{max_steps: 10, global_batch: 8, micro_batch: 2, checkpoint_every: 5, framework: jax}"),
        "training.framework: 'jax' is not allowed; expected 'auto', 'none', 'torch', 'hf' or 'lightning'",
    ),
    ("notify-nobody", spec_text(notify="{email: []}"), "notify: nowhere to send: give email (a list of addresses)"),
    (
        "notify-not-an-address",
        spec_text(notify="{email: [ml-oncall]}"),
        "notify.email[0]: 'ml-oncall' is not an email address; write one address as name@domain.tld",
    ),
    (
        "notify-two-in-one",
        spec_text(notify="{email: ['a@example.com, b@example.com']}"),
        "notify.email[0]: 'a@example.com, b",
    ),
    (
        "notify-bad-sender",
        spec_text(notify="{email: [a@example.com], from_email: airflow}"),
        "notify.from_email: 'airflow' is not an email",
    ),
    (
        "notify-unknown-event",
        spec_text(notify="{email: [a@example.com], on: [failure, success]}"),
        "notify.on[1]: 'success' is not allowed; expected 'failure' or 'recovery'",
    ),
    (
        "notify-never",
        spec_text(notify="{email: [a@example.com], on: []}"),
        "notify.on: list should have at least 1 item",
    ),
    (
        "notify-twice",
        spec_text(notify="{email: [a@example.com, a@example.com]}"),
        "notify.email[1]: 'a@example.com' is listed twice",
    ),
    (
        "notify-unknown-key",
        spec_text(notify="{email: [a@example.com], sms: '+100'}"),
        "notify.sms: unknown field; allowed here: connection, email, from_email, on, slack, webhook",
    ),
]


@pytest.mark.parametrize("text,expected", [(t, e) for _, t, e in BAD], ids=[c for c, _, _ in BAD])
def test_bad_file_gets_one_clear_line(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "pipeline.yaml"
    path.write_text(text)
    problems = check_files([path])
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"{path}: "), problems
    assert expected in problems[0], problems


def test_undecodable_file_is_a_problem_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    [problem] = check_files([path])
    assert problem.startswith(f"{path}: cannot read the file")


def test_missing_file(tmp_path: Path) -> None:
    [problem] = check_files([tmp_path / "nope.yaml"])
    assert "cannot read the file" in problem


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_are_valid(path: Path) -> None:
    spec = load_spec(path)
    assert spec.dag_id(path) == path.stem


@pytest.mark.parametrize("example", sorted((ROOT / "examples").glob("*/*.yaml")), ids=lambda p: p.name)
def test_each_example_spec_copied_beside_the_demo_specs_checks_clean(example: Path) -> None:
    """The README's steps copy an example into dags/pipelines: its dataset must not nest in the demo's."""
    assert check_files([ROOT / "dags" / "pipelines", example]) == []


def test_the_kubernetes_gpu_example_is_a_complete_gpu_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    path = ROOT / "examples" / "specs" / "kubernetes_gpu.yaml"
    assert cli(["check", str(path)]) == 0, capsys.readouterr().out
    spec = load_spec(path)
    nodes, pods = spec.nodes, spec.nodes.kubernetes
    assert nodes.backend == "kubernetes" and pods is not None
    assert pods.gpus > 0 and nodes.procs_per_node == pods.gpus and pods.scheduler == "volcano" and pods.hot_pvc
    assert spec.dataset.source.startswith("s3://") and spec.dataset.connection
    assert spec.checkpoint.cold.startswith("s3://") and spec.checkpoint.connection
    assert spec.dataset.hot.startswith("file://") and spec.pressure_test.enabled


def test_the_s3_example_stages_from_the_cold_bucket_beside_the_stack_pipelines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = ROOT / "examples" / "specs" / "s3_pretrain.yaml"
    # The compose stack mounts it beside dags/pipelines: checked together, no dataset nests in another's.
    assert cli(["check", str(ROOT / "dags" / "pipelines"), str(path)]) == 0, capsys.readouterr().out
    spec = load_spec(path)
    assert spec.dag_id(path) == "s3_pretrain"
    assert spec.dataset.source.startswith("s3://trainyard-cold/") and spec.dataset.connection == "trainyard_cold"
    assert spec.checkpoint.cold.startswith("s3://trainyard-cold/") and spec.checkpoint.connection == "trainyard_cold"
    assert spec.dataset.hot.startswith("file://") and spec.checkpoint.hot.startswith("file://")
    assert spec.nodes.backend == "local"  # the compose stack's scheduler runs it (LocalExecutor)


def test_a_spec_may_give_local_nodes_gpus_one_rank_each(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(spec_text(nodes="{count: 2, procs_per_node: 2, gpus_per_node: 2}"))
    assert (load_spec(path).nodes.gpus_per_node, load_spec(path).nodes.procs_per_node) == (2, 2)
    # a script of one's own places its ranks itself: one process may drive several GPUs
    path.write_text(
        spec_text(
            nodes="{count: 2, gpus_per_node: 4}",
            training="{entrypoint: my.train, max_steps: 10, global_batch: 8, micro_batch: 2, checkpoint_every: 5}",
        )
    )
    assert load_spec(path).nodes.gpus_per_node == 4


def test_notify_defaults_and_a_full_section(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(spec_text(notify="{email: [ml-oncall@example.com]}"))
    notify = load_spec(path).notify
    assert (notify.email, notify.on, notify.connection, notify.from_email) == (
        ["ml-oncall@example.com"],
        ["failure", "recovery"],
        "smtp_default",
        None,
    )
    path.write_text(
        spec_text(
            notify="{email: [a@example.com, b.c@ml.example.org], on: [failure], connection: mail,"
            " from_email: trainyard@example.com}"
        )
    )
    notify = load_spec(path).notify
    assert (notify.email, notify.on, notify.connection) == (
        ["a@example.com", "b.c@ml.example.org"],
        ["failure"],
        "mail",
    )
    path.write_text(GOOD)
    assert load_spec(path).notify is None


def test_every_field_is_documented() -> None:
    from trainyard.spec.models import PipelineSpec, model_types

    assert PipelineSpec in model_types()
    undocumented = [
        f"{m.__name__}.{name}" for m in model_types() for name, field in m.model_fields.items() if not field.description
    ]
    assert undocumented == []


def test_cli_check_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(spec_text(nodes="{count: 4, min: 5}"))
    assert cli(["check", *map(str, EXAMPLES)]) == 0
    assert cli(["check", str(bad), *map(str, EXAMPLES)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert f"{bad}: nodes.min: 5 must be <= nodes.count (4)" in out


def test_params_schema_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(spec_text(nodes="{count: 2, max: 4}"))
    spec = load_spec(path)
    schemas = param_schemas(spec)
    assert list(schemas) == ["nodes", "min_nodes", "max_steps", "micro_batch", "resume_from"]  # lr only on request
    assert schemas["nodes"]["maximum"] == 4
    assert schemas["nodes"]["default"] == 2
    changed = with_params(spec, {"nodes": 4, "max_steps": 3, "unrelated_airflow_param": 1}, path)
    assert (changed.nodes.count, changed.training.max_steps) == (4, 3)
    with pytest.raises(SpecError, match=r"nodes\.min: 3 must be <= nodes\.count \(2\)"):
        with_params(spec, {"min_nodes": 3}, path)


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        ("{lr: x}", "training.args.lr: 'x' is not a number; write a number such as 0.01"),
        ("{n-layers: 2.5}", "training.args.n-layers: 2.5 is not an integer; write a number such as 2"),
        ("{lr: true}", "training.args.lr: True is not a number"),
        ("{data-dtype: int8}", "training.args.data-dtype: 'int8' is not one of uint16, uint32"),
        ("{n_layers: 4}", "training.args.n_layers: trainyard.workload has no --n_layers; did you mean n-layers?"),
    ],
)
def test_the_reference_workloads_arguments_are_checked_before_a_run(args: str, problem: str, tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.replace("training: {", f"training: {{args: {args}, "))
    [line] = check_files([path])
    assert line.startswith(f"{path}: {problem}")


def test_a_scripts_own_arguments_are_its_business(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(GOOD.replace("training: {", "training: {entrypoint: train.py, args: {lr: x, anything: [1, 2]}, "))
    assert check_files([path]) == []
