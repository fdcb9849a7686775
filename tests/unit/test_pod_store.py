"""The orchestrator's side of an in-place Kubernetes attempt's store: the attempt's secret outlives each
process of the deferred task (a file only the orchestrator reads), and is never drawn again for an attempt."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from trainyard.atomic import UnsafePath
from trainyard.backends.base import LaunchPlan
from trainyard.backends.kubernetes.store import PodStore
from trainyard.protocol.coordstore import node_keys

NODES = ["gpu-a", "gpu-b", "gpu-c"]


class Endpoints:
    def store_endpoint(self, plan: LaunchPlan) -> str:
        return f"store-a{plan.attempt}.ml.svc.cluster.local:29500"

    def serve_store(self, plan: LaunchPlan) -> str:  # pragma: no cover - not reached: no coordinator here
        raise AssertionError("no store is served by these tests")


def store(folder: Path) -> PodStore:
    def plan(attempt: int) -> LaunchPlan:  # what the store reads of a plan: its attempt
        return LaunchPlan("r", attempt, [], 1, "x.py", [], None, folder)  # type: ignore[arg-type]

    return PodStore(Endpoints(), folder / "store", NODES, plan)


def test_each_wake_reads_back_the_attempts_secret_which_only_the_orchestrator_can_read(tmp_path: Path) -> None:
    first = store(tmp_path).keys(1)
    again = store(tmp_path).keys(1)  # the next wake: a new process
    assert first == again and set(first) == set(NODES)
    assert store(tmp_path).keys(2) != first  # a fresh secret per attempt
    secret = tmp_path / "store" / "attempt-1.secret"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "store").stat().st_mode) == 0o700
    assert node_keys(secret.read_bytes(), NODES) == first
    assert store(tmp_path).address_for(3) == "store-a3.ml.svc.cluster.local:29500"


def test_a_secret_file_tampered_with_is_refused_not_drawn_again(tmp_path: Path) -> None:
    store(tmp_path).keys(1)
    secret = tmp_path / "store" / "attempt-1.secret"
    secret.write_bytes(b"short")
    with pytest.raises(ValueError, match="its attempt cannot go on"):
        store(tmp_path).keys(1)
    secret.unlink()
    os.symlink(tmp_path / "elsewhere", secret)
    (tmp_path / "elsewhere").write_bytes(b"x" * 32)
    with pytest.raises(UnsafePath):
        store(tmp_path).keys(1)
