"""The pressure test on real local candidate processes: stragglers, crashes and hangs."""

from __future__ import annotations

import re
import time
from pathlib import Path

import psutil
import pytest

from trainyard.errors import NodeUnhealthy
from trainyard.pipeline.run import open_run
from trainyard.pipeline.stages import burn_in

pytestmark = [pytest.mark.integration, pytest.mark.alone]  # measures this machine: see pyproject

SPEC = """\
dataset: {{source: "file:///unused", name: tokens}}
runs_root: file://{root}/runs
nodes: {{count: {count}, min: {min}, spare: {spare}}}
pressure_test:
  duration_s: {duration}
  matmul_size: 128
  membw_mb: 16
  disk_mb: 32
  # This VM's shared disk swings 2-3x between back-to-back probes; these tests are about
  # compute stragglers and dead nodes, so the disk probes only need to stay within 10x.
  ratio_overrides: {{disk_write_mbps: 0.1, disk_read_mbps: 0.1}}
  straggler_ratio: {ratio}
  collective_sizes_kb: [64, 1024]
  drills: {drills}
training: {{max_steps: 1, global_batch: 6, micro_batch: 1, checkpoint_every: 1}}
"""


def run_for(
    tmp_path: Path, count: int, spare: int, drills: str, duration: float = 6, minimum: int = 1, ratio: float = 0.9
):
    spec = tmp_path / "p.yaml"
    spec.write_text(
        SPEC.format(root=tmp_path, count=count, min=minimum, spare=spare, duration=duration, drills=drills, ratio=ratio)
    )
    return open_run(spec, "p", f"run-{time.monotonic_ns()}", "2026-11-28")


def no_probe_left() -> bool:
    return not [
        p for p in psutil.process_iter(["cmdline"]) if "trainyard.burnin.node" in " ".join(p.info["cmdline"] or [])
    ]


# These tests judge the verdict's logic on this machine's real probes, so each drill's deficit lies far from the bar
# and the bar far from a healthy node's noise: on two shared cores one turn's ratio swings by a tenth or more, and at
# the default ratio (0.9) with a half-speed drill a healthy node was once evicted beside the drilled one (CI, right
# after the first phase). How close a call the verdict makes at the default ratio is bench/burnin.py's to measure
# (detected_fraction, false_evictions), not a test's.
TEST_RATIO = 0.6


def test_a_throttled_node_is_evicted_and_the_others_train(tmp_path: Path) -> None:
    run = run_for(
        tmp_path, count=2, spare=1, drills="[{node: node-1, fault: throttle, factor: 0.75}]", ratio=TEST_RATIO
    )
    result = burn_in(run)
    assert sorted(result.healthy) == ["node-0", "node-2"]
    # Three probes share two cores here, so the throttled node's sleeps hand the others CPU:
    # which of its throttled probes falls furthest below the median varies from run to run.
    assert re.match(r"straggler: (matmul_gflops|membw_gbps) ", result.evicted["node-1"])
    verdicts = {e["node"]: e for e in run.ledger.events("burn_in", "node_verdict")}
    assert verdicts["node-1"]["verdict"] == "evicted" and verdicts["node-0"]["verdict"] == "train"
    assert set(verdicts["node-0"]["collective"]) == {"64KB", "1024KB"}
    assert no_probe_left()


@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_a_crashed_or_hung_node_is_dead_within_the_timeout(tmp_path: Path, fault: str) -> None:
    run = run_for(
        tmp_path, count=2, spare=1, drills=f"[{{node: node-0, fault: {fault}}}]", duration=5, ratio=TEST_RATIO
    )
    result = burn_in(run)
    assert sorted(result.healthy) == ["node-1", "node-2"], result.evicted
    reason = result.evicted["node-0"]
    if fault == "crash":
        assert reason == "dead: exited 1: drill: node crashed on purpose (node-0)"
    else:  # a hung node is dead once its turn's grace is over, never after the candidates' whole timeout (a minute)
        waited = float(re.fullmatch(r"dead: no report within ([0-9.]+) s", reason)[1])  # type: ignore[index]
        assert waited < 30, reason
    assert no_probe_left()


def test_a_node_slow_only_once_is_a_suspect_the_confirmation_round_clears(tmp_path: Path) -> None:
    run = run_for(tmp_path, count=3, spare=0, drills="[{node: node-1, fault: blip, factor: 0.75}]", ratio=TEST_RATIO)
    result = burn_in(run)
    assert result.evicted == {} and result.cleared == ["node-1"], result
    assert sorted(result.healthy) == ["node-0", "node-1", "node-2"]
    verdicts = {e["node"]: e for e in run.ledger.events("burn_in", "node_verdict")}
    assert verdicts["node-1"]["suspect"].startswith("straggler: ") and verdicts["node-1"]["again"]
    assert verdicts["node-1"]["verdict"] == "train"
    assert no_probe_left()


def test_a_slow_link_is_found_by_position(tmp_path: Path) -> None:
    # Three quarters of the link lost: on two shared cores a throttled rank's sleeps hand the CPU to the others,
    # so half a link (factor 0.5) measured 0.76 of the reference, beside an unthrottled node at 0.88: a
    # coin toss against the bar, which failed this test in about one run in five (CI included).
    run = run_for(
        tmp_path, count=2, spare=2, drills="[{node: node-2, fault: slow_link, factor: 0.75}]", ratio=TEST_RATIO
    )
    result = burn_in(run)
    assert list(result.evicted) == ["node-2"], result
    assert "link_gbps" in result.evicted["node-2"] and result.evicted["node-2"].endswith("confirmed")
    links = {e["node"]: e["links"] for e in run.ledger.events("burn_in", "node_verdict")}
    assert set(links["node-0"]) == {"node-1", "node-2", "node-3"}  # every partner, once


def test_an_evicted_node_sits_out_its_cool_down_then_is_retested_and_readmitted(tmp_path: Path) -> None:
    from trainyard.backends.local.backend import local_kind
    from trainyard.burnin.fleet import Fleet

    first = run_for(tmp_path, count=2, spare=0, drills="[]", duration=3)
    fleet = Fleet(first.hot_root / ".fleet")
    hour = 3600.0
    fleet.record("node-1", local_kind(), at=time.time() - hour, run_id="old", figures={}, verdict="evicted", reason="x")
    result = burn_in(first)
    assert result.healthy == ["node-0"] and result.readmitted == []
    [sitting] = first.ledger.events("burn_in", "sitting_out")
    assert list(sitting["nodes"]) == ["node-1"]
    # a day later (the default cool-down is 24 h) it is tested again, passes and is back
    fleet.record(
        "node-1", local_kind(), at=time.time() - 25 * hour, run_id="old", figures={}, verdict="evicted", reason="x"
    )
    later = run_for(tmp_path, count=2, spare=0, drills="[]", duration=3)
    result = burn_in(later)
    assert result.readmitted == ["node-1"] and sorted(result.healthy) == ["node-0", "node-1"]
    assert fleet.read("node-1").evicted_at is None  # type: ignore[union-attr]
    assert fleet.read("node-0").runs[-1]["verdict"] == "train"  # type: ignore[union-attr]


def test_too_few_healthy_nodes_fails_fast_with_the_table(tmp_path: Path) -> None:
    run = run_for(tmp_path, count=2, spare=0, minimum=2, duration=3, drills="[{node: node-1, fault: crash}]")
    with pytest.raises(NodeUnhealthy, match=r"only 1 healthy node\(s\), nodes.min is 2:\n") as err:
        burn_in(run)
    assert "node-1" in str(err.value) and "evicted: dead" in str(err.value) and "reference" in str(err.value)
    [failed] = run.ledger.events("burn_in", "stage_failed")
    assert failed["error"] == "NodeUnhealthy"


# ---------------------------------------------------------------- the store is unauthenticated: values are signed


def stranger(port: int):
    """Anyone who reaches the store's port: a TCPStore client with no key."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))


def test_a_report_forged_by_a_stranger_fails_the_stage_and_marks_no_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainyard.burnin import protocol
    from trainyard.burnin.sealing import StoreTampered

    real = protocol.host_store

    def tampered_store(host: str = "127.0.0.1"):
        store = real(host)
        # Before any candidate has started: node-0 "is ready", and says it is the fastest node there is.
        stranger(store.port).set("ready/node-0", "1")
        return store

    monkeypatch.setattr(protocol, "host_store", tampered_store)
    run = run_for(tmp_path, count=2, spare=0, duration=3, drills="[]")
    with pytest.raises(StoreTampered, match="'ready/node-0' is not signed"):
        burn_in(run)
    assert list(run.ledger.events("burn_in", "node_verdict")) == []  # nothing decided on forged data
    assert no_probe_left()


def test_a_candidate_refuses_an_instruction_it_cannot_verify(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainyard.burnin import node
    from trainyard.burnin.protocol import host_store
    from trainyard.burnin.sealing import KEY_ENV, unseal

    store = host_store()
    stranger(store.port).set("do/node-0/0", '{"do": "probe"}')  # not the orchestrator's: unsigned
    monkeypatch.setenv(KEY_ENV, "cd" * 32)
    with pytest.raises(SystemExit) as exited:
        node.main(
            [
                "--node",
                "node-0",
                "--store",
                f"127.0.0.1:{store.port}",
                "--collective-s",
                "1",
                "--scratch",
                str(tmp_path),
                "--timeout",
                "5",
            ]
        )
    assert exited.value.code == node.TAMPERED_EXIT
    assert "'do/node-0/0' is not signed" in unseal("cd" * 32, "tampered/node-0", store.get("tampered/node-0"))
    assert not store.check(["done/node-0/0"])  # it ran no probe on a forged instruction


def test_a_candidate_without_its_key_does_not_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from trainyard.burnin import node
    from trainyard.burnin.sealing import KEY_ENV

    monkeypatch.delenv(KEY_ENV, raising=False)
    with pytest.raises(SystemExit, match="TRAINYARD_BURNIN_KEY must hold"):
        node.main(
            [
                "--node",
                "node-0",
                "--store",
                "127.0.0.1:1",
                "--collective-s",
                "1",
                "--scratch",
                str(tmp_path),
            ]
        )
