"""The two-round verdict with realistic figures: suspects, confirmation, references, GPU and link rules."""

from __future__ import annotations

from typing import Any

import pytest

from trainyard.burnin.figures import LINK, combine, flatten
from trainyard.burnin.protocol import pair_rounds
from trainyard.burnin.verdict import Recheck, decide, rules_of, suspect
from trainyard.spec import PressureTestSpec

RULES = rules_of(PressureTestSpec())
CPU = {"matmul_gflops": 120.0, "membw_gbps": 15.0, "disk_write_mbps": 400.0, "disk_read_mbps": 1500.0}
H100 = {
    **CPU,
    "bf16_tflops": 700.0,
    "bf16_fraction_of_peak": 0.71,
    "gpu_temp_c": 64.0,
    "gpu_ecc_uncorrected": 0.0,
    "gpu_throttle_mask": 0.0,
    LINK: 24.0,
}


def node(base: dict[str, float] = CPU, **change: float) -> dict[str, float]:
    """``base`` with some figures scaled (``matmul_gflops=0.8``) or, for GPU counters, set."""
    out = dict(base)
    for probe, value in change.items():
        out[probe] = value if probe.startswith("gpu_") or probe == "bf16_fraction_of_peak" else base[probe] * value
    return out


def batch(count: int, base: dict[str, float] = CPU, **odd: dict[str, float]) -> dict[str, dict[str, float]]:
    return {f"node-{i}": odd.get(f"node_{i}", dict(base)) for i in range(count)}


CASES: list[tuple[str, dict[str, Any], dict[str, Any], list[str], list[str]]] = [
    # (case, first round, second round, evicted, cleared)
    ("a healthy batch has no suspect and no second round", batch(4), {}, [], []),
    (
        "a node 20% slow in both rounds is evicted",
        batch(4, node_2=node(matmul_gflops=0.8)),
        {"node-0": CPU, "node-2": node(matmul_gflops=0.79)},
        ["node-2"],
        [],
    ),
    (
        "a node slow once (a burst of someone else's work) is cleared",
        batch(4, node_1=node(matmul_gflops=0.85)),
        {"node-0": CPU, "node-1": node(matmul_gflops=0.98)},
        [],
        ["node-1"],
    ),
    (
        "two nodes 10% apart without history: the slower is cleared when the gap closes",
        batch(2, node_1=node(matmul_gflops=0.88)),
        {"node-0": CPU, "node-1": node(matmul_gflops=0.97)},
        [],
        ["node-1"],
    ),
    (
        "two nodes, one throttled 20%: evicted against the best",
        batch(2, node_1=node(matmul_gflops=0.8, membw_gbps=0.8)),
        {"node-0": CPU, "node-1": node(matmul_gflops=0.81, membw_gbps=0.8)},
        ["node-1"],
        [],
    ),
    (
        "the machine slows 30% between rounds: the reference node measured beside the suspect clears it",
        batch(4, node_3=node(matmul_gflops=0.85)),
        {"node-0": node(matmul_gflops=0.7), "node-3": node(matmul_gflops=0.66)},
        [],
        ["node-3"],
    ),
    (
        "below the absolute floor in both rounds",
        batch(3, node_0=node(disk_write_mbps=0.05)),
        {"node-1": CPU, "node-0": node(disk_write_mbps=0.06)},
        ["node-0"],
        [],
    ),
    (
        "an H100 with uncorrected ECC errors is evicted",
        batch(4, H100, node_1=node(H100, gpu_ecc_uncorrected=2)),
        {"node-0": H100, "node-1": node(H100, gpu_ecc_uncorrected=2)},
        ["node-1"],
        [],
    ),
    (
        "an H100 at 91 C is evicted if still hot; HW thermal slowdown (0x40) too",
        batch(4, H100, node_1=node(H100, gpu_temp_c=91), node_2=node(H100, gpu_throttle_mask=0x40)),
        {"node-0": H100, "node-1": node(H100, gpu_temp_c=90), "node-2": node(H100, gpu_throttle_mask=0x40)},
        ["node-1", "node-2"],
        [],
    ),
    (
        "a GPU that cooled down between the rounds is cleared",
        batch(4, H100, node_1=node(H100, gpu_temp_c=87)),
        {"node-0": H100, "node-1": node(H100, gpu_temp_c=78)},
        [],
        ["node-1"],
    ),
    (
        "an H100 at 41% of its bf16 peak, and one 20% below the batch",
        batch(8, H100, node_5=node(H100, bf16_fraction_of_peak=0.41), node_6=node(H100, bf16_tflops=0.8)),
        {"node-0": H100, "node-5": node(H100, bf16_fraction_of_peak=0.42), "node-6": node(H100, bf16_tflops=0.8)},
        ["node-5", "node-6"],
        [],
    ),
    (
        "a slow link (half the bandwidth with every partner), confirmed in a second link test",
        batch(4, H100, node_2=node(H100, link_gbps=0.5)),
        {"node-0": {LINK: 24.0}, "node-1": {LINK: 23.5}, "node-2": {LINK: 12.2}},
        ["node-2"],
        [],
    ),
]


@pytest.mark.parametrize("case,first,second,evicted,cleared", CASES, ids=[c[0] for c in CASES])
def test_two_rounds(case: str, first: dict, second: dict, evicted: list[str], cleared: list[str]) -> None:
    verdict = decide(first, len(first), RULES, again=second)
    assert sorted(verdict.evicted) == evicted, verdict.evicted
    assert verdict.cleared == cleared, verdict.suspects
    assert all(reason.endswith("confirmed") for reason in verdict.evicted.values())
    assert sorted(verdict.healthy + verdict.spare) == sorted(n for n in first if n not in evicted)


def test_the_second_round_probes_the_suspects_with_the_reference_node() -> None:
    first = batch(4, H100, node_1=node(H100, matmul_gflops=0.7), node_3=node(H100, link_gbps=0.4))
    first["node-2"] = node(H100, matmul_gflops=1.05, membw_gbps=1.05)  # the best-measured healthy node
    kinds = dict.fromkeys(first, "p5.48xlarge/NVIDIA-H100-80GB-HBM3")
    suspicion = suspect(first, RULES, kinds)
    assert set(suspicion.failed) == {"node-1", "node-3"}
    assert suspicion.reference_node == {kinds["node-0"]: "node-2"}
    # local suspects with their reference, and the link suspect with the best two healthy links
    assert suspicion.recheck(kinds) == Recheck(["node-2", "node-1"], ["node-0", "node-2", "node-3"])


def turns(*scales: float, probe: str = "matmul_gflops") -> list[dict[str, float]]:
    """A node's confirmation round turn by turn: ``CPU`` with ``probe`` scaled in each turn."""
    return [node(**{probe: scale}) for scale in scales]


# The machine's speed in ten turns of a confirmation round on a busy shared host (drifting by a third).
DRIFT = [1.0, 0.7, 0.95, 0.68, 1.02, 0.72, 0.98, 0.66, 1.0, 1.0]


def test_the_confirmation_pairs_each_turn_of_a_suspect_with_its_reference_nodes() -> None:
    first = batch(3, node_1=node(matmul_gflops=0.8))
    ref = turns(*DRIFT)
    # healthy, but a slow spell fell in one of its turns and not in the reference node's: the medians of the
    # round say 0.85 of the reference node, turn by turn it is 0.98
    healthy = turns(*(d * 0.98 for d in DRIFT[:8]), 0.69, 0.98)
    assert combine(healthy)["matmul_gflops"] < 0.9 * combine(ref)["matmul_gflops"]
    again = {"node-0": combine(ref), "node-1": combine(healthy)}
    verdict = decide(first, 3, RULES, again=again, turns={"node-0": ref, "node-1": healthy})
    assert verdict.cleared == ["node-1"] and verdict.beside["node-1"]["matmul_gflops"] == pytest.approx(0.98, abs=0.1)
    # throttled by 20%: 0.8 of the reference node in every turn, whatever the machine's speed
    throttled = turns(*(d * 0.8 for d in DRIFT))
    again = {"node-0": combine(ref), "node-1": combine(throttled)}
    verdict = decide(first, 3, RULES, again=again, turns={"node-0": ref, "node-1": throttled})
    assert (
        "matmul_gflops 0.80 x node-0 < 0.90 (median of 10 turns side by side), confirmed" in verdict.evicted["node-1"]
    )


def test_a_confirmation_close_to_the_threshold_is_measured_once_more() -> None:
    first = batch(3, node_1=node(matmul_gflops=0.8))
    kinds = dict.fromkeys(first, "")
    suspicion = suspect(first, RULES, kinds)
    ref = turns(*DRIFT)
    close = {"node-0": ref, "node-1": turns(*(d * 0.88 for d in DRIFT))}
    assert suspicion.unsure(RULES, kinds, close) == Recheck(["node-0", "node-1"])
    # clear cases cost nothing more: 0.8 (held) or 0.99 (cleared) of the reference node in the same turns
    for scale in (0.8, 0.99):
        assert (
            suspicion.unsure(RULES, kinds, {"node-0": ref, "node-1": turns(*(d * scale for d in DRIFT))}) == Recheck()
        )
    # measured again, the verdict takes all the turns: ten more at 0.97 clear a node that was 0.88 in ten
    pooled = {"node-0": ref + ref, "node-1": close["node-1"] + turns(*(d * 0.97 for d in DRIFT))}
    again = {n: combine(t) for n, t in pooled.items()}
    assert decide(first, 3, RULES, again=again, turns=pooled).cleared == ["node-1"]


def test_the_judge_asks_for_the_third_round_only_after_the_second() -> None:
    from trainyard.burnin.judge import Judge
    from trainyard.burnin.protocol import BurnInRun

    first = batch(3, node_1=node(matmul_gflops=0.8))
    judge = Judge(RULES, 3, dict.fromkeys(first, ""), {}, True)
    probed = BurnInRun(local={n: dict(f) for n, f in first.items()})
    assert judge.recheck(probed) == Recheck(["node-0", "node-1"], [])
    probed.again_turns = {"node-0": turns(*DRIFT), "node-1": turns(*(d * 0.91 for d in DRIFT))}
    assert judge.recheck(probed) == Recheck(["node-0", "node-1"])
    probed.again_turns["node-1"] = turns(*(d * 0.75 for d in DRIFT))
    assert judge.recheck(probed) == Recheck()
    probed.again = {n: combine(t) for n, t in probed.again_turns.items()}
    assert judge.verdict(list(first), probed).evicted["node-1"].endswith("side by side), confirmed")


def test_a_whole_bad_batch_is_judged_against_the_fleet_history() -> None:
    fleet = {"": {"matmul_gflops": 120.0, "membw_gbps": 15.0}}
    slow = node(matmul_gflops=0.7)
    # a cluster (dedicated hosts): four nodes all 30% below their kind's history are all bad
    verdict = decide(batch(4, slow), 4, RULES, fleet=fleet, again=batch(4, slow))
    assert sorted(verdict.evicted) == ["node-0", "node-1", "node-2", "node-3"]
    assert "fleet history" in verdict.evicted["node-0"]
    # local slices of one busy host: the history is capped by the best of the batch, nothing is evicted
    assert decide(batch(4, slow), 4, RULES, fleet=fleet, shared=True, again=batch(4, slow)).evicted == {}


def test_two_nodes_are_judged_against_the_better_and_the_fleet_history() -> None:
    fleet = {"": {"matmul_gflops": 120.0}}
    two = dict.fromkeys(["node-0", "node-1"], "")
    # without the history the best of the two is the reference, and 0.88 of it is suspect
    assert set(suspect(batch(2, node_1=node(matmul_gflops=0.88)), RULES, two).failed) == {"node-1"}
    # a fast day (both above their history): the history must not hide a throttled node beside a healthy one
    fast = {"node-0": node(matmul_gflops=1.25), "node-1": node(matmul_gflops=1.25 * 0.8)}
    assert set(suspect(fast, RULES, two, fleet).failed) == {"node-1"}
    assert set(suspect(fast, RULES, two, fleet, shared=True).failed) == {"node-1"}
    # both slow against the history on dedicated hosts: both suspect; on one shared host, a busy host
    both = batch(2, node(matmul_gflops=0.75))
    assert set(suspect(both, RULES, two, fleet).failed) == {"node-0", "node-1"}
    assert suspect(both, RULES, two, fleet, shared=True).failed == {}
    # a lone node below its history on a dedicated host
    assert set(suspect({"node-0": node(matmul_gflops=0.7)}, RULES, {"node-0": ""}, fleet).failed) == {"node-0"}


def test_each_kind_is_judged_against_its_own() -> None:
    a100 = node(H100, bf16_tflops=250 / 700, bf16_fraction_of_peak=0.8)
    first = {**{f"h{i}": dict(H100) for i in range(3)}, **{f"a{i}": dict(a100) for i in range(3)}}
    kinds = {n: ("h100" if n.startswith("h") else "a100") for n in first}
    verdict = decide(first, 6, RULES, kinds=kinds, again={})
    assert verdict.evicted == {} and verdict.references["a100"]["bf16_tflops"].value == pytest.approx(250)


def test_without_a_second_round_a_suspect_stays_evicted_and_a_dead_node_is_dead() -> None:
    first = {**batch(3, node_2=node(matmul_gflops=0.5)), "node-3": None}
    verdict = decide(first, 4, RULES, {"node-3": "exited 1"})
    assert verdict.evicted["node-2"].startswith("straggler: matmul_gflops")
    assert verdict.evicted["node-3"] == "dead: exited 1"
    # a suspicion the second round could not measure again (a link test short of partners) is not confirmed
    assert "node-2" not in decide(first, 4, RULES, {"node-3": "exited 1"}, again={}).evicted


def test_flatten_reads_the_gpu_report_and_the_best_link() -> None:
    report = {
        **CPU,
        "gpu": {
            "devices": 8,
            "name": "NVIDIA H100 80GB HBM3",
            "bf16_tflops": 690.5,
            "bf16_fraction_of_peak": 0.698,
            "temperature_c": 71,
            "ecc_uncorrected": 0,
            "throttle_mask": 0,
        },
    }
    flat = flatten(report, {"node-1": 23.1, "node-2": 11.0, "node-3": 22.8})
    assert flat["bf16_tflops"] == 690.5 and flat["gpu_temp_c"] == 71 and flat[LINK] == 23.1
    assert "devices" not in flat and "name" not in flat
    assert LINK not in flatten(CPU, {"node-1": 5.0})  # one partner cannot say whose link is slow
    assert flatten({**CPU, "gpu": {"skipped": "no CUDA device visible"}}) == CPU


@pytest.mark.parametrize("count", [2, 3, 4, 5, 8])
def test_pair_rounds_meet_every_partner_once_in_disjoint_pairs(count: int) -> None:
    members = [f"n{i}" for i in range(count)]
    rounds = pair_rounds(members)
    met = [tuple(sorted(p)) for r in rounds for p in r]
    assert len(met) == len(set(met)) == count * (count - 1) // 2
    for r in rounds:
        busy = [n for p in r for n in p]
        assert len(busy) == len(set(busy))


def test_pairs_of_one_shared_host_take_turns() -> None:
    rounds = pair_rounds(["a", "b", "c", "d"], shared=True)
    assert len(rounds) == 6 and all(len(r) == 1 for r in rounds)


def test_confirmation_passes_interleave_the_pairs_so_drift_falls_on_each_alike() -> None:
    once = pair_rounds(["s", "a", "b"], shared=True)
    thrice = pair_rounds(["s", "a", "b"], shared=True, passes=3)
    assert thrice == once * 3  # s-a, s-b, a-b, s-a, ...: never one pair's turns back to back
    assert all(thrice[i] != thrice[i + 1] for i in range(len(thrice) - 1))


def test_pair_rounds_are_capped_on_a_large_batch() -> None:
    rounds = pair_rounds([f"n{i}" for i in range(64)], most=8)
    assert len(rounds) == 8 and all(len(r) == 32 for r in rounds)


def test_turns_combine_to_the_median_rate_and_the_worst_gpu_counter() -> None:
    def turn(matmul: float, temp: float, ecc: int, mask: int, tflops: float) -> dict:
        gpu = {"devices": 8, "name": "NVIDIA H100 80GB HBM3", "bf16_tflops": tflops, "temperature_c": temp}
        return {"matmul_gflops": matmul, "gpu": {**gpu, "ecc_uncorrected": ecc, "throttle_mask": mask}}

    # a burst of speed in one turn and a stall in another are both one turn's luck
    reports = [
        turn(120, 70, 0, 0, 690),
        turn(160, 74, 0, 0x40, 700),
        turn(60, 72, 2, 0, 695),
        turn(118, 71, 0, 0x8, 692),
    ]
    combined = combine(reports)
    assert combined["matmul_gflops"] == 119.0
    assert combined["gpu"]["temperature_c"] == 74 and combined["gpu"]["ecc_uncorrected"] == 2
    assert combined["gpu"]["throttle_mask"] == 0x48 and combined["gpu"]["bf16_tflops"] == 693.5
    assert combined["gpu"]["name"] == "NVIDIA H100 80GB HBM3"
