"""The pressure test's protocol with many candidates: how a turn is shared, what each node is sent, how often a
wait asks the backend. Light candidates (``light_nodes``: threads speaking the node's own protocol over a real
store, their probes sleeps) stand in for the processes and pods.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from light_nodes import LIGHT, RAN, ThreadCandidate

from trainyard.burnin import node, protocol
from trainyard.burnin.args import node_args
from trainyard.burnin.protocol import TURNS, Schedule, host_store, run_protocol
from trainyard.burnin.sealing import node_key, run_secret
from trainyard.spec import PressureTestSpec

pytestmark = pytest.mark.integration
CFG = PressureTestSpec(duration_s=2.0, timeout_s=10, collective_sizes_kb=[64])


@pytest.fixture(autouse=True)
def light(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, probe in LIGHT.items():
        monkeypatch.setattr(node, name, probe)
    RAN.clear()


def probe(count: int, shared: bool, tmp_path: Path) -> tuple[protocol.BurnInRun, dict[str, ThreadCandidate]]:
    store = host_store()
    secret = run_secret()
    names = [f"node-{i}" for i in range(count)]
    keys = {n: node_key(secret, n) for n in names}
    plan = Schedule.of(CFG, count, shared)
    nodes = {
        n: ThreadCandidate(node_args(n, f"127.0.0.1:{store.port}", plan, CFG, str(tmp_path), 30.0), keys[n])
        for n in names
    }
    return run_protocol(store, nodes, CFG, 10.0, keys, shared=shared), nodes


def turns(name: str) -> list[tuple[float, float, float]]:
    return sorted((r.start, r.end, r.seconds) for r in RAN if r.node == name and r.what == "probe")


def test_on_a_cluster_every_node_probes_at_once_for_the_whole_turn(tmp_path: Path) -> None:
    result, _ = probe(8, shared=False, tmp_path=tmp_path)
    assert sorted(result.local) == [f"node-{i}" for i in range(8)] and not result.dead
    by_node = {f"node-{i}": turns(f"node-{i}") for i in range(8)}
    assert {len(t) for t in by_node.values()} == {TURNS}
    for turn in range(TURNS):
        starts = [t[turn][0] for t in by_node.values()]
        ends = [t[turn][1] for t in by_node.values()]
        assert max(starts) < min(ends), f"turn {turn}: not every node probed at once"
        # each node gets the whole turn (0.6 x duration / TURNS), not an 8th of it
        assert [t[turn][2] for t in by_node.values()] == pytest.approx([0.6 * CFG.duration_s / TURNS] * 8)


def test_on_a_shared_host_the_nodes_take_turns(tmp_path: Path) -> None:
    result, _ = probe(3, shared=True, tmp_path=tmp_path)
    assert sorted(result.local) == ["node-0", "node-1", "node-2"]
    every = sorted((r.start, r.end, r.seconds) for r in RAN if r.what == "probe")
    assert len(every) == 3 * TURNS
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(every)), "two nodes probed at once on one host"
    assert [s for _, _, s in every] == pytest.approx([0.6 * CFG.duration_s / 3 / TURNS] * len(every))


def test_each_node_is_sent_only_its_own_pairs_in_every_round(tmp_path: Path) -> None:
    result, _ = probe(6, shared=False, tmp_path=tmp_path)
    sent = {r.node: r.detail for r in RAN if r.what == "pairs"}
    assert sorted(sent) == [f"node-{i}" for i in range(6)]
    schedule = protocol.pair_rounds([f"node-{i}" for i in range(6)], passes=protocol.PAIR_TURNS)
    for name, rounds in sent.items():
        assert len(rounds) == len(schedule)  # every round, to keep in step with the others
        assert rounds == [[p for p in r if name in p] for r in schedule]
    assert all(len(peers) == 5 for peers in result.links.values())  # six nodes: each met the other five


def test_a_wait_asks_whether_its_candidate_lives_at_most_twice_a_second(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Silent:
        asked = 0

        def alive(self) -> bool:
            self.asked += 1
            return True

    class Clock:  # the wait's own pauses move it: how often it asks is its rule's, not this machine's load
        now = 0.0

        def monotonic(self) -> float:
            return self.now

        def sleep(self, seconds: float) -> None:
            self.now += seconds

    silent, clock = Silent(), Clock()
    store = host_store()
    monkeypatch.setattr(protocol, "time", clock)
    assert not protocol._wait(store, "never", silent, 1.2)  # type: ignore[arg-type]
    assert clock.now >= 1.2  # it waited out its deadline
    assert silent.asked == int(1.2 / protocol.ALIVE_EVERY_S)  # asked at 0.5 s and 1.0 s: at most twice a second
