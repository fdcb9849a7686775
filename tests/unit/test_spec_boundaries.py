"""Spec values that could take the system down or cross a trust boundary are refused (issue 13).

Holes 11 (finite ranges, Kubernetes label namespaces) and 12 (the launcher's service account); and the
spec's promises about itself: each pattern field states its own rule, training
args are scalars, one vocabulary per word, every problem of a file in one pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import yaml
from check_specs import text

from trainyard.airflow.params import param_schemas
from trainyard.errors import SpecError
from trainyard.recovery import classify, policy
from trainyard.spec import (
    DEFAULT_ACTIONS,
    LAUNCHER_SERVICE_ACCOUNT,
    MAX_NODES,
    PROBES,
    Action,
    FailureKind,
    PressureTestSpec,
    Probe,
    load_spec,
    spec_from_text,
)

ROOT = Path(__file__).resolve().parents[2]


def problems(source: str) -> list[str]:
    try:
        spec_from_text(source, Path("p.yaml"))
    except SpecError as exc:
        return [line.removeprefix("p.yaml: ") for line in exc.problems]
    return []


def k8s(settings: str) -> str:
    return f"{{count: 2, backend: kubernetes, kubernetes: {{image: trainer, {settings}}}}}"


def training(extra: str) -> str:
    return f"{{max_steps: 10, global_batch: 8, micro_batch: 2, checkpoint_every: 5, {extra}}}"


# ---------------------------------------------------------------- one clear line per refused value

REFUSED = [
    ("nodes-max-1e12", dict(nodes="{count: 2, max: 1000000000000}"), "nodes.max: 1000000000000 is out of range"),
    ("nodes-max-float", dict(nodes="{count: 2, max: 1.0e+12}"), "nodes.max: 1000000000000.0 is out of range"),
    ("nodes-spare-huge", dict(nodes="{count: 2, spare: 100000}"), "nodes.spare: 100000 is out of range"),
    (
        "capacity-inf",
        dict(dataset='{source: "file:///d", name: t, hot_capacity_gb: .inf}'),
        "dataset.hot_capacity_gb: inf is not allowed; write a finite number",
    ),
    (
        "capacity-nan",
        dict(dataset='{source: "file:///d", name: t, hot_capacity_gb: .nan}'),
        "dataset.hot_capacity_gb: nan is not allowed",
    ),
    ("heartbeat-inf", dict(training=training("heartbeat_timeout_s: .inf")), "training.heartbeat_timeout_s: inf"),
    ("max-loss-nan", dict(checkpoint="{expectations: {max_loss: .nan}}"), "checkpoint.expectations.max_loss: nan"),
    ("spike-inf", dict(checkpoint="{expectations: {max_spike_ratio: .inf}}"), "max_spike_ratio: inf"),
    ("floor-inf", dict(pressure_test="{min_gflops: .inf}"), "pressure_test.min_gflops: inf"),
    (
        "ratio-override-inf",
        dict(pressure_test="{ratio_overrides: {membw_gbps: .inf}}"),
        "pressure_test.ratio_overrides.membw_gbps: inf",
    ),
    (
        "ratio-override-above-one",
        dict(pressure_test="{ratio_overrides: {membw_gbps: 7}}"),
        "pressure_test.ratio_overrides.membw_gbps: 7 is out of range",
    ),
    (
        "collective-negative",
        dict(pressure_test="{collective_sizes_kb: [-1]}"),
        "pressure_test.collective_sizes_kb[0]: -1 is out of range",
    ),
    (
        "collective-1e9",
        dict(pressure_test="{collective_sizes_kb: [64, 1000000000]}"),
        "pressure_test.collective_sizes_kb[1]: 1000000000 is out of range; it should be less than or equal to 1048576",
    ),
    (
        "global-batch-huge",
        dict(training="{max_steps: 10, global_batch: 1000000000000000000, micro_batch: 2, checkpoint_every: 5}"),
        "training.global_batch: 1000000000000000000",
    ),
    ("lr-nan", dict(training=training("args: {lr: .nan}")), "training.args.lr: nan is not a finite number"),
    ("wake-nan", dict(nodes=k8s("wake_every_s: .nan")), "nodes.kubernetes.wake_every_s: nan"),
    (
        "lifecycle-days",
        dict(checkpoint='{cold: "s3://bucket/ck", connection: s3, lifecycle: {expire_days: 10000000}}'),
        "checkpoint.lifecycle.expire_days: 10000000 is out of range",
    ),
    # Each pattern field names its own rule (not one wording for all of them).
    ("bad-pipeline-name", dict(pipeline="-nightly"), "pipeline: '-nightly' is not a name: letters, digits"),
    (
        "namespace-not-dns-label",
        dict(nodes=k8s("namespace: Team_A")),
        "nodes.kubernetes.namespace: 'Team_A' is not a DNS-1123 label: at most 63 lowercase letters",
    ),
    (
        "hot-mount-relative",
        dict(nodes=k8s("hot_mount: mnt/hot")),
        "nodes.kubernetes.hot_mount: 'mnt/hot' is not an absolute path: start with '/'",
    ),
    ("hot-mount-dotdot", dict(nodes=k8s("hot_mount: /mnt/../etc")), "'/mnt/../etc' is not an absolute path"),
    (
        "cluster-domain",
        dict(nodes=k8s("cluster_domain: Cluster.Local")),
        "nodes.kubernetes.cluster_domain: 'Cluster.Local' is not a DNS subdomain",
    ),
    # training.args: scalars or lists of scalars, one line naming the argument.
    (
        "args-mapping",
        dict(training=training("args: {model: {d: 64}}")),
        "training.args.model: a mapping is not allowed as an argument's value; write a string, number or boolean",
    ),
    (
        "args-nested-list",
        dict(training=training("args: {layers: [1, [2]]}")),
        "training.args.layers: a list is not allowed as a list item",
    ),
    ("args-null", dict(training=training("args: {lr: null}")), "training.args.lr: null is not allowed"),
    # Labels trainyard writes on nodes stay out of the namespaces Kubernetes keeps for itself.
    (
        "evicted-hostname",
        dict(nodes=k8s("evicted_label: kubernetes.io/hostname")),
        "nodes.kubernetes.evicted_label: 'kubernetes.io/hostname' is in the kubernetes.io/ namespace",
    ),
    (
        "evicted-subdomain",
        dict(nodes=k8s("evicted_label: node.kubernetes.io/unschedulable")),
        "'node.kubernetes.io/unschedulable' is in the kubernetes.io/ namespace",
    ),
    (
        "evicted-k8s-io",
        dict(nodes=k8s("evicted_label: k8s.io/evicted")),
        "'k8s.io/evicted' is in the k8s.io/ namespace",
    ),
    ("evicted-k8s-io-sub", dict(nodes=k8s("evicted_label: cloud.k8s.io/evicted")), "is in the k8s.io/ namespace"),
    ("evicted-upper-prefix", dict(nodes=k8s("evicted_label: Kubernetes.IO/x")), "is not a Kubernetes label key"),
    (
        "evicted-syntax",
        dict(nodes=k8s("evicted_label: 'trainyard evicted'")),
        "nodes.kubernetes.evicted_label: 'trainyard evicted' is not a Kubernetes label key",
    ),
    ("evicted-long-name", dict(nodes=k8s(f"evicted_label: trainyard.io/{'x' * 64}")), "is not a Kubernetes label key"),
    (
        "selector-key",
        dict(nodes=k8s("node_selector: {'gpu type': a100}")),
        "nodes.kubernetes.node_selector.gpu type: 'gpu type' is not a Kubernetes label key",
    ),
    (
        "selector-value",
        dict(nodes=k8s("node_selector: {gpu: 'a100 80gb'}")),
        "nodes.kubernetes.node_selector.gpu: 'a100 80gb' is not a Kubernetes label value",
    ),
    # Hole 12: the pods never run as the launcher.
    (
        "launcher-service-account",
        dict(nodes=k8s(f"service_account: {LAUNCHER_SERVICE_ACCOUNT}")),
        "nodes.kubernetes.service_account: 'trainyard-launcher' is the trainyard launcher's own service account",
    ),
    (
        "service-account-syntax",
        dict(nodes=k8s("service_account: Trainer_SA")),
        "nodes.kubernetes.service_account: 'Trainer_SA' is not a DNS subdomain",
    ),
    # Hole 7: a dataset folder of its own.
    ("dataset-dot", dict(dataset='{source: "file:///d", name: "."}'), "dataset.name: '.' has an empty or '.' part"),
    ("dataset-dot-part", dict(dataset='{source: "file:///d", name: "tokens/./x"}'), "'tokens/./x' has an empty or '.'"),
    ("dataset-empty-part", dict(dataset='{source: "file:///d", name: "tokens//x"}'), "'tokens//x' has an empty"),
    ("dataset-dotdot-template", dict(dataset='{source: "file:///d", name: "{{ ds }}/.."}'), "escapes the hot root"),
    # Hole 9: extra resume roots are absolute, like every other root.
    (
        "resume-root-relative",
        dict(training=training("allowed_resume_roots: [ckpt/other]")),
        "training.allowed_resume_roots[0]: 'ckpt/other' must be an absolute path",
    ),
    (
        "resume-root-scheme",
        dict(training=training("allowed_resume_roots: ['s3://bucket/ck']")),
        "training.allowed_resume_roots[0]: 's3://bucket/ck' must start with file://",
    ),
    ("resume-root-dotdot", dict(training=training("allowed_resume_roots: ['/ck/../etc']")), "may not contain '..'"),
    (
        "resume-root-template",
        dict(training=training("allowed_resume_roots: ['/ck/{{ ds }}']")),
        "training.allowed_resume_roots[0]: run templates are only allowed in dataset.source and dataset.name",
    ),
]


@pytest.mark.parametrize("sections,expected", [(s, e) for _, s, e in REFUSED], ids=[c for c, _, _ in REFUSED])
def test_refused_with_one_line_naming_the_field(sections: dict[str, str], expected: str) -> None:
    found = problems(text(**sections))
    assert len(found) == 1 and expected in found[0], found


ACCEPTED = [
    ("nodes-at-the-bound", dict(nodes=f"{{count: 2, max: {MAX_NODES}}}")),
    (
        "selector-on-well-known-labels",
        dict(nodes=k8s("node_selector: {kubernetes.io/arch: amd64, node.kubernetes.io/instance-type: p5.48xlarge}")),
    ),
    ("own-label-prefix", dict(nodes=k8s("evicted_label: ml.example.com/evicted, evict_with: taint"))),
    ("pod-service-account", dict(nodes=k8s("service_account: trainyard-trainer"))),
    (
        "args-list",
        dict(training=training("entrypoint: train.py, args: {layers: [64, 64], tags: [a, b], compile: true}")),
    ),
    ("resume-roots", dict(training=training("allowed_resume_roots: ['/shared/ckpt', 'file://${TRAINYARD_HOME}/x']"))),
]


@pytest.mark.parametrize("sections", [s for _, s in ACCEPTED], ids=[c for c, _ in ACCEPTED])
def test_accepted(sections: dict[str, str]) -> None:
    assert problems(text(**sections)) == []


def test_the_trigger_form_is_bounded_whatever_the_spec(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        text(
            nodes=f"{{count: {MAX_NODES}, spare: {MAX_NODES}}}",
            training=f"{{max_steps: 10, global_batch: {MAX_NODES}, micro_batch: 1, checkpoint_every: 5}}",
        )
    )
    nodes = param_schemas(load_spec(path))["nodes"]
    assert nodes["maximum"] == MAX_NODES and len(nodes["enum"]) <= MAX_NODES and max(nodes["enum"]) == MAX_NODES


def test_the_launcher_service_account_is_the_one_deployed() -> None:
    docs = yaml.safe_load_all((ROOT / "docker" / "k8s" / "launcher-rbac.yaml").read_text())
    accounts = [d["metadata"]["name"] for d in docs if d and d.get("kind") == "ServiceAccount"]
    assert accounts == [LAUNCHER_SERVICE_ACCOUNT]


# ---------------------------------------------------------------- one vocabulary per word


def test_each_vocabulary_lives_once() -> None:
    assert set(DEFAULT_ACTIONS) == set(get_args(FailureKind)) and set(DEFAULT_ACTIONS.values()) <= set(get_args(Action))
    assert set(policy.ACTIONS) == set(get_args(Action))
    assert {kind for kind, _ in classify.RULES} == set(get_args(FailureKind))
    assert PROBES == get_args(Probe)
    assert get_args(PressureTestSpec.model_fields["ratio_overrides"].annotation)[0] is Probe


def test_every_probe_has_its_own_floor_and_an_unknown_one_is_refused() -> None:
    cfg = PressureTestSpec(
        min_gflops=1.0,
        min_membw_gbps=2.0,
        min_disk_mbps=3.0,
        min_link_gbps=4.0,
        straggler_ratio=0.8,
        ratio_overrides={"disk_read_mbps": 0.4},
    )
    assert {p: cfg.floor(p) for p in PROBES} == {
        "matmul_gflops": 1.0,
        "membw_gbps": 2.0,
        "disk_write_mbps": 3.0,
        "disk_read_mbps": 3.0,
        "bf16_tflops": 0.0,
        "link_gbps": 4.0,
    }
    assert cfg.ratio("matmul_gflops") == 0.8 and cfg.ratio("disk_read_mbps") == 0.4
    # an override of one probe keeps the other defaults (disks 0.5, links 0.7)
    assert cfg.ratio("disk_write_mbps") == 0.5 and cfg.ratio("link_gbps") == 0.7
    with pytest.raises(ValueError, match="unknown pressure-test probe 'gpu_tflops'"):
        cfg.floor("gpu_tflops")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown pressure-test probe"):
        cfg.ratio("disk_mbps")  # type: ignore[arg-type]


# ---------------------------------------------------------------- every problem in one pass


def test_a_structural_error_does_not_hide_the_cross_field_ones() -> None:
    found = problems(text(nodes="{count: 2, min: 3}", notify="{email: 5}"))
    assert found == ["notify.email: input should be a valid list (got 5)", "nodes.min: 3 must be <= nodes.count (2)"]
    found = problems(text(recovery="{actions: {meteor: retry}}", schedule="'61 2 * * *'", params="[nodes, nodes]"))
    assert len(found) == 3 and found[0].startswith("recovery.actions.meteor: 'meteor' is not allowed"), found
    assert (
        "schedule: '61 2 * * *' is not a cron expression" in found[1]
        and "params[1]: 'nodes' is listed twice" in found[2]
    )


def test_a_check_that_reads_a_broken_field_is_not_run_on_its_stand_in() -> None:
    # procs_per_node is broken; its default (1) would make 8 indivisible by 2 x 3 x 1: no line about that.
    assert problems(text(nodes="{count: 3, procs_per_node: 0}")) == [
        "nodes.procs_per_node: 0 is out of range; it should be greater than or equal to 1"
    ]


def test_a_broken_required_section_reports_what_it_can() -> None:
    found = problems(
        text(
            training="{max_steps: ten, global_batch: 8, micro_batch: 2, checkpoint_every: 5}",
            nodes="{count: 2, min: 3}",
        )
    )
    # A required field's stand-in keeps the file's other checks running (docs/pipelines.md promises it).
    assert found == [
        "training.max_steps: input should be a valid integer, unable to parse string as an integer (got 'ten')",
        "nodes.min: 3 must be <= nodes.count (2)",
    ]
