"""A checkpoint's hashes checked by a Job of pods, each a slice of its files, on the fake cluster.

The fake kubelet runs each verification pod's command (``python -m trainyard.checkpoint.slices``) as a
local process, which reads the checkpoint where the claim is mounted (this machine's file system).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_k8s import FakeKube, Kubelet

from trainyard.backends.kubernetes.verify import VerificationFailed, build_verify_job, run_verify_job
from trainyard.checkpoint.format import MANIFEST, verify, write_manifest
from trainyard.checkpoint.slices import check_slice
from trainyard.spec import KubernetesSpec

pytestmark = pytest.mark.integration
NS = "ml"


@pytest.fixture
def fake() -> Iterator[FakeKube]:
    server = FakeKube().start()
    for name in ("gpu-a", "gpu-b", "gpu-c"):
        server.add_node(name, {"pool": "train"})
    yield server
    server.stop()


def checkpoint(root: Path, files: int = 7) -> Path:
    ckpt = root / "checkpoints" / "p" / "step_000010"
    ckpt.mkdir(parents=True)
    for i in range(files):
        (ckpt / f"__{i}_0.distcp").write_bytes(hashlib.sha256(str(i).encode()).digest() * (1000 + i))
    write_manifest(ckpt, step=10, world_size=files, global_batch=4, micro_batch=1, metrics={"loss": 1.0}, run_id="r")
    return ckpt


def spec_for(root: Path) -> KubernetesSpec:
    return KubernetesSpec(
        image="trainer:1", namespace=NS, node_selector={"pool": "train"}, hot_pvc="hot", hot_mount=str(root)
    )


def test_every_slice_is_checked_once_and_a_flipped_byte_in_any_is_caught(fake: FakeKube, tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path)
    spec = spec_for(tmp_path)
    with Kubelet(fake, NS, tmp_path / "kubelet"):
        assert run_verify_job(fake.client(), spec, ckpt, 3, timeout_s=120, poll_s=0.1) == []
        victim = ckpt / "__5_0.distcp"
        data = bytearray(victim.read_bytes())
        data[len(data) // 2] ^= 0x01
        victim.write_bytes(bytes(data))
        problems = run_verify_job(fake.client(), spec, ckpt, 3, timeout_s=120, poll_s=0.1)
    assert problems == ["__5_0.distcp: sha256 mismatch (contents changed after the save)"]
    assert problems == [p for p in verify(ckpt) if "distcp" in p]  # what the worker itself finds
    assert fake.items("apis/batch/v1", "jobs", NS) == [] and fake.items("api/v1", "pods", NS) == []
    # Each pod checked its own files: the three slices cover the seven files once.
    assert sorted(n for i in range(3) for n in [check_slice(ckpt, i, 3)["files"]]) == [2, 2, 3]


def test_a_pod_that_fails_fails_the_task_not_the_checkpoint(fake: FakeKube, tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path, files=2)
    (ckpt / MANIFEST).write_text("{not json")  # read by each pod: its traceback is the evidence
    with Kubelet(fake, NS, tmp_path / "kubelet"), pytest.raises(VerificationFailed, match="failed") as err:
        run_verify_job(fake.client(), spec_for(tmp_path), ckpt, 2, timeout_s=120, poll_s=0.1)
    assert "manifest" in str(err.value)
    assert fake.items("apis/batch/v1", "jobs", NS) == []  # deleted all the same


def test_the_job_mounts_only_the_checkpoint_read_only_and_needs_the_claim(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints" / "p" / "step_000010"
    job = build_verify_job("ty-verify-x", ckpt, 4, spec_for(tmp_path), 60.0)
    pod = job.spec.template.spec
    (mount,) = [m for m in pod.containers[0].volume_mounts if m.name == "hot"]
    assert (mount.mount_path, mount.sub_path, mount.read_only) == (str(ckpt), "checkpoints/p/step_000010", True)
    assert (job.spec.completions, job.spec.parallelism, job.spec.completion_mode) == (4, 4, "Indexed")
    assert pod.containers[0].args == [str(ckpt), "$(JOB_COMPLETION_INDEX)", "4"]
    assert pod.automount_service_account_token is False and pod.security_context.run_as_non_root
    with pytest.raises(ValueError, match="hot_pvc"):
        build_verify_job("x", ckpt, 2, KubernetesSpec(image="trainer:1", namespace=NS), 60.0)


def test_the_gate_hashes_through_the_job_only_where_the_spec_asks(fake: FakeKube, tmp_path: Path) -> None:
    from types import SimpleNamespace

    from trainyard.pipeline.gate import _in_cluster

    ckpt = checkpoint(tmp_path, files=3)
    asked = spec_for(tmp_path).model_copy(update={"verify_pods": 2, "verify_timeout_s": 120.0})

    def run_with(backend: str, kubernetes: KubernetesSpec | None) -> object:
        return SimpleNamespace(spec=SimpleNamespace(nodes=SimpleNamespace(backend=backend, kubernetes=kubernetes)))

    connect = lambda spec: fake.client()  # noqa: E731
    assert _in_cluster(run_with("local", None), ckpt, connect) is None  # type: ignore[arg-type]
    assert _in_cluster(run_with("kubernetes", spec_for(tmp_path)), ckpt, connect) is None  # type: ignore[arg-type]
    hashed = _in_cluster(run_with("kubernetes", asked), ckpt, connect)  # type: ignore[arg-type]
    with Kubelet(fake, NS, tmp_path / "kubelet"):
        assert verify(ckpt, hashed) == []
    assert sum(1 for c in fake.calls if (c.verb, c.resource) == ("create", "jobs")) == 1
