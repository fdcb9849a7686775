"""Local burn-in candidates on a multi-GPU host: each gets its own share of the GPUs the worker sees
(``trainyard.backends.local.probes``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def test_two_local_candidates_of_two_gpus_each_get_their_own_halves() -> None:
    from trainyard.backends.local.probes import candidate_gpus
    from trainyard.burnin.local import candidate_env

    parent = {"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    gpus = candidate_gpus(["node-0", "node-1"], 2, parent)
    assert gpus == {"node-0": "0,1", "node-1": "2,3"}
    assert candidate_env("node-1", "ab" * 32, parent, gpus=gpus["node-1"])["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_a_spare_candidate_reuses_a_share_and_too_few_gpus_is_refused() -> None:
    from trainyard.backends.local.probes import candidate_gpus
    from trainyard.errors import SpecError

    parent = {"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b,GPU-c,GPU-d"}
    # Local candidates probe one at a time, so a spare measuring node-0's share never overlaps with it.
    assert candidate_gpus(["node-0", "node-1", "node-2"], 2, parent) == {
        "node-0": "GPU-a,GPU-b",
        "node-1": "GPU-c,GPU-d",
        "node-2": "GPU-a,GPU-b",
    }
    with pytest.raises(SpecError, match="nodes.gpus_per_node: 1 node"):
        candidate_gpus(["node-0"], 8, parent)


def test_without_gpus_per_node_a_candidate_sees_what_the_worker_sees() -> None:
    from trainyard.backends.local.probes import candidate_gpus
    from trainyard.burnin.local import candidate_env

    parent = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert candidate_gpus(["node-0", "node-1"], 0, parent) == {}
    assert candidate_env("node-0", "ab" * 32, parent)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"


def test_a_local_candidates_process_is_started_with_its_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from trainyard.backends.local import probes
    from trainyard.burnin.local import candidate_env

    started: list[dict[str, str]] = []

    class Popen:
        def __init__(self, argv: list[str], **kwargs: Any):
            started.append(kwargs["env"])

    monkeypatch.setattr(probes.subprocess, "Popen", Popen)
    probes.LocalCandidate("node-1", [], tmp_path / "node-1.log", candidate_env("node-1", "ab" * 32, gpus="2,3"))
    assert started[0]["CUDA_VISIBLE_DEVICES"] == "2,3" and started[0]["TRAINYARD_NODE"] == "node-1"
