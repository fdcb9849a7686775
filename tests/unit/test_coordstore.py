"""The coordination store: the generation record, the supervisor's client, and what someone who reaches the
store's port (any rank, any local user) can no longer do to the supervisor's decisions."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

from trainyard.backends.base import LaunchPlan
from trainyard.backends.local.launcher import node_env
from trainyard.protocol import coordinator, coordstore
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import Generation, node_keys
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.sealing import new_secret, seal
from trainyard.recovery import storehost

NODES = ["node-0", "node-1", "node-2", "node-3"]


def keyed(store: dist.Store, nodes: list[str] = NODES) -> tuple[Coordinator, dict[str, str], list[str]]:
    """A coordinator holding a fresh attempt's keys, and the keys it refused values of (``on_refused``)."""
    keys = node_keys(new_secret(), nodes)
    refused: list[str] = []
    return Coordinator(store, keys, on_refused=lambda key, why: refused.append(key)), keys, refused


def test_generation_json_round_trip_and_ranks() -> None:
    gen = Generation(number=2, members=["node-0", "node-2", "node-3"], micro_batch=2, joiners=["node-3"], from_step=7)
    back = Generation.from_json(gen.to_json())
    assert back == gen and back.world == 3 and back.rank_of("node-2") == 1 and back.rank_of("node-1") is None
    assert Generation.from_json('{"number": 1, "members": ["a"], "micro_batch": 4}') == Generation(
        1, ["a"], 4, [], None
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", "generation record is not JSON"),
        ("[1]", "must be a JSON object, not list"),
        ('{"number": 1, "members": ["a"]}', "lacks the field 'micro_batch'"),
        ('{"number": 1, "members": ["a", "a"], "micro_batch": 1}', "must be distinct node names"),
        ('{"number": 1, "members": ["a"], "micro_batch": 1, "joiners": ["b"]}', "joiners ['b'] are not members"),
        ('{"number": 0, "members": ["a"], "micro_batch": 1}', "Generation.number=0 must be >= 1"),
        # What raised TypeError (or passed) before: each is a ValueError that names the field now.
        ('{"number": [1], "members": ["a"], "micro_batch": 1}', "number and micro_batch must be integers"),
        ('{"number": "2", "members": ["a"], "micro_batch": 1}', "number and micro_batch must be integers"),
        ('{"number": 1, "members": 5, "micro_batch": 1}', "members and joiners must be lists of node names"),
        ('{"number": 1, "members": [1], "micro_batch": 1}', "members and joiners must be lists of node names"),
        ('{"number": 1, "members": ["a"], "micro_batch": 1, "from_step": "x"}', "from_step must be an integer"),
        ("[" * 100_000, "generation record is not JSON"),
        (b"\xff\xfe", "generation record is not JSON"),
    ],
)
def test_generation_refuses_a_bad_record_with_a_value_error(text: str | bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Generation.from_json(text)


def test_coordinator_reads_what_workers_report() -> None:
    store = dist.HashStore()
    coord, keys, refused = keyed(store)
    assert coord.current() is None and coord.faults() == {} and coord.ready(2) == []
    coord.publish(Generation(1, ["node-0", "node-1", "node-2"], 2))
    coordstore.report_fault(store, "node-0", keys["node-0"], 1, "RuntimeError: Connection reset by peer")
    coordstore.report_fault(store, "node-2", keys["node-2"], 1, "RuntimeError: Connection reset", suspect="node-1")
    assert coord.faults() == {
        "node-0": "generation 1: RuntimeError: Connection reset by peer (suspect: unknown)",
        "node-2": "generation 1: RuntimeError: Connection reset (suspect: node-1)",
    }
    assert coord.faults(generation=2) == {}
    coord.publish(Generation(2, ["node-0", "node-2"], 3, from_step=5))
    assert coord.current() == Generation(2, ["node-0", "node-2"], 3, [], 5)
    old = coordstore.gen_key(1, "node-3")  # an old generation stays readable, by each node with its own key
    assert coordstore.open_generation(keys["node-3"], old, store.get(old)).number == 1
    coordstore.report_ready(store, 2, "node-2", keys["node-2"], 5)
    assert not coord.wait_ready(2, ["node-0", "node-2"], timeout_s=0.2)
    coordstore.report_ready(store, 2, "node-0", keys["node-0"], 5)
    assert coord.wait_ready(2, ["node-0", "node-2"], timeout_s=1.0)
    assert coord.ready(2) == ["node-0", "node-2"] and coord.ready_steps(2) == {"node-0": 5, "node-2": 5}
    assert refused == []


def test_serve_hosts_a_store_clients_reach() -> None:
    store, port = storehost.serve()
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    coord, keys, _ = keyed(store)
    coord.publish(Generation(1, ["node-0"], 1))
    name = coordstore.current_key("node-0")
    assert coordstore.open_generation(keys["node-0"], name, client.get(name)).members == ["node-0"]


def _outside_address() -> str | None:
    """An IPv4 address of this host other than loopback (a network a stranger could come from)."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not address.address.startswith("127."):
                return str(address.address)
    return None


def test_the_store_listens_on_loopback_only() -> None:
    outside = _outside_address()
    if outside is None:
        pytest.skip("this host has no non-loopback IPv4 address to connect from")
    store, port = storehost.serve()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((outside, port), timeout=5).close()  # torch's own master took every interface
    client = dist.TCPStore("127.0.0.1", port, is_master=False)  # the local nodes reach it
    client.set("hello", "1")
    assert store.get("hello") == b"1"


def test_the_pressure_tests_store_listens_on_loopback_only_too() -> None:
    """The burn-in store of a local run: the same ``backends.store.serve`` (issue 29 said so; now it is)."""
    from trainyard.burnin.protocol import host_store

    outside = _outside_address()
    if outside is None:
        pytest.skip("this host has no non-loopback IPv4 address to connect from")
    store = host_store()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection((outside, store.port), timeout=5).close()
    dist.TCPStore("127.0.0.1", store.port, is_master=False).set("hello", "1")
    assert store.get("hello") == b"1"


class PausingClock:
    """The coordinator's clock, moved only by its own pauses; at ``report_at`` a worker reports its fault (as if
    during the pause), so what a wait sees is decided by the pauses it took, not by how busy this machine is."""

    def __init__(self, report_at: float, report: Callable[[], None]) -> None:
        self.now, self.report_at, self.report = 0.0, report_at, report

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        crossed = self.now < self.report_at <= self.now + seconds
        self.now += seconds
        if crossed:
            self.report()


def test_the_supervisor_wakes_on_a_fault_report_of_its_generation_only(monkeypatch: pytest.MonkeyPatch) -> None:
    store, port = storehost.serve()
    coord, keys, _ = keyed(storehost.attempt_store(store, 1))
    worker = storehost.attempt_store(dist.TCPStore("127.0.0.1", port, is_master=False), 1)
    clock = PausingClock(
        0.3, lambda: coordstore.report_fault(worker, "node-2", keys["node-2"], 1, "RuntimeError: Connection closed")
    )
    monkeypatch.setattr(coordinator, "time", clock)
    assert not coord.wait_fault(1, timeout_s=0.2)  # nothing reported: it waited the whole pause
    assert clock.now == pytest.approx(0.2)
    assert coord.wait_fault(1, timeout_s=10.0)
    # woken at its first look after the report (0.3 s), not at the end of the pause
    assert clock.now <= 0.3 + coordinator.FAULT_CHECK_S + 1e-9
    assert coord.wait_fault(1, timeout_s=0.0)  # and it stays reported
    assert not coord.wait_fault(2, timeout_s=0.1)  # an older generation's report does not wake a newer one


def test_a_notice_given_while_the_next_generation_is_published_is_read_in_that_generation() -> None:
    """The race of a notice with growth: node-1 reports that it leaves generation 1 just as the supervisor
    publishes generation 2, which still lists it (a spare joins). node-1 will never form 2; the supervisor,
    watching 2 by then, must read it as leaving 2 (and wake on it), not wait for it to form 2."""
    store = dist.HashStore()
    coord, keys, _ = keyed(store)
    coord.publish(Generation(1, ["node-0", "node-1"], 3))
    assert not coord.wait_fault(1, timeout_s=0.0) and coord.leaving(1) == []
    coord.publish(Generation(2, ["node-0", "node-1", "node-2"], 2, joiners=["node-2"]))
    assert not coord.wait_fault(2, timeout_s=0.0)  # looked once before the report: the report must wake it
    coordstore.report_leave(store, "node-1", keys["node-1"], 1)
    assert coord.wait_fault(2, timeout_s=1.0)
    assert coord.leaving(2) == ["node-1"]
    # The regroup without it: generation 3 does not list node-1, whose old report now means nothing.
    coord.publish(Generation(3, ["node-0", "node-2"], 3))
    assert coord.leaving(3) == [] and not coord.wait_fault(3, timeout_s=0.0)
    # Started again, it rejoins in 4 (having left 1): that report is no notice to leave 4, nor is one of 2
    # by a node that was not in 3.
    coord.publish(Generation(4, ["node-0", "node-1", "node-2"], 2, joiners=["node-1"]))
    coordstore.report_leave(store, "node-3", keys["node-3"], 3)
    assert coord.leaving(4) == []


def test_spares_announce_themselves_and_are_forgotten_once_listed_and_formed_follows_the_newest() -> None:
    store = dist.HashStore()
    coord, keys, _ = keyed(store)
    coord.publish(Generation(1, ["node-0", "node-1"], 3))
    coordstore.announce_spare(store, "node-2", keys["node-2"], 1)
    coordstore.announce_spare(store, "node-3", keys["node-3"], 1)
    assert coord.spares_ready(["node-3", "node-2", "node-9"]) == ["node-3", "node-2"]
    coord.publish(Generation(2, ["node-0", "node-1", "node-2"], 2, joiners=["node-2"]))
    assert coord.spares_ready(["node-2", "node-3"]) == ["node-3"]  # a member is no spare
    coord.forget(["node-3"])
    assert coord.spares_ready(["node-3"]) == []
    assert not coord.formed(2)
    coordstore.report_ready(store, 2, "node-0", keys["node-0"], 9)
    coordstore.report_ready(store, 2, "node-1", keys["node-1"], 9)
    assert not coord.formed(2)  # node-2 has not formed it yet
    # Generation 3 supersedes 2 before node-2 formed it: once 3 is formed, so is "2 or later".
    coord.publish(Generation(3, ["node-0", "node-1"], 3))
    for node in ("node-0", "node-1"):
        coordstore.report_ready(store, 3, node, keys[node], 9)
    assert coord.formed(2) and coord.formed(3) and not coord.formed(4)


def landed(store: dist.Store) -> None:
    """Return once the server has applied every ``set`` sent through ``store``'s connection: a TCPStore ``set``
    gets no reply, so a read on another connection may overtake it; a round trip on this one may not."""
    coordstore.peek(store, "landed")


def test_values_forged_with_the_raw_store_api_are_refused_recorded_and_decide_nothing() -> None:
    store, port = storehost.serve()
    coord, keys, refused = keyed(storehost.attempt_store(store, 1))
    coord.publish(Generation(1, ["node-0", "node-1"], 2))
    coord.publish(Generation(2, ["node-0", "node-1"], 2))
    forger = storehost.attempt_store(dist.TCPStore("127.0.0.1", port, is_master=False), 1)  # no key at all
    stranger = "ab" * 32  # a key of the forger's own making
    forger.set(coordstore.fault_key("node-1"), json.dumps({"generation": 2, "suspect": "node-0", "error": "x"}))
    forger.set(coordstore.fault_key("node-0"), seal(stranger, coordstore.fault_key("node-0"), '{"generation": 2}'))
    forger.add(coordstore.faulted_key(2), 1)
    forger.set(coordstore.ready_key(2, "node-0"), "7")
    forger.set(coordstore.ready_key(2, "node-1"), seal(stranger, coordstore.ready_key(2, "node-1"), "7"))
    forger.set(coordstore.spare_key("node-2"), "2")
    # A value node-3 really sealed, moved under another key: the key's name is sealed with it.
    coordstore.announce_spare(forger, "node-3", keys["node-3"], 2)
    forger.set(coordstore.spare_key("node-2"), forger.get(coordstore.spare_key("node-3")))
    landed(forger)
    assert coord.faults() == {} and not coord.wait_fault(2, timeout_s=0.2)  # the forged count woke nothing
    assert coord.ready(2) == [] and not coord.formed(2) and coord.ready_steps(2) == {}
    assert coord.spares_ready(["node-2", "node-3"]) == ["node-3"]
    assert set(refused) == {"fault/node-0", "fault/node-1", "ready/2/node-0", "ready/2/node-1", "spare/node-2"}
    assert "forged" in coord.refused["fault/node-1"] and len(refused) == len(set(refused))  # once per key
    coordstore.report_ready(forger, 2, "node-0", keys["node-0"], 7)  # the nodes themselves still get through
    coordstore.report_ready(forger, 2, "node-1", keys["node-1"], 7)
    landed(forger)
    assert coord.formed(2) and coord.ready_steps(2) == {"node-0": 7, "node-1": 7}


def test_a_malformed_value_is_refused_never_raised() -> None:
    store = dist.HashStore()
    coord, keys, refused = keyed(store)
    gen = Generation(1, ["node-0", "node-1"], 2)
    coord.publish(gen)
    for name in ("gen", "gen/1", coordstore.current_key("node-0"), coordstore.gen_key(1, "node-0")):
        store.set(name, '{"number": "x", "members": 5}')  # what made formed() raise and end the train task
    # A node's own key seals any bytes it likes: what it sealed is checked as well.
    for node, text in (("node-0", "[" * 100_000), ("node-1", '{"generation": "1", "suspect": 1}')):
        store.set(coordstore.fault_key(node), seal(keys[node], coordstore.fault_key(node), text))
    store.set(coordstore.ready_key(1, "node-0"), seal(keys["node-0"], coordstore.ready_key(1, "node-0"), "true"))
    coordstore.report_ready(store, 1, "node-1", keys["node-1"], 3)
    assert coord.current() == gen and not coord.formed(1) and coord.ready(1) == ["node-1"]
    assert coord.faults() == {} and not coord.wait_fault(1, timeout_s=0.0)
    assert set(refused) == {"fault/node-0", "fault/node-1", "ready/1/node-0"}
    assert all(why.startswith("malformed") for why in coord.refused.values())


@pytest.mark.timeout(1)  # the unbounded walk of before took hours; this returns in about 0.2 s
def test_counters_anyone_can_add_to_bound_no_walk_of_the_supervisor() -> None:
    store = dist.HashStore()
    coord, keys, _ = keyed(store)
    coord.publish(Generation(1, ["node-0", "node-1"], 2))
    for counter in ("ready/1", "faults", coordstore.faulted_key(1)):  # the old lists' counters, and the wake-up
        store.add(counter, 10**9)
    assert coord.ready(1) == [] and not coord.formed(1) and coord.faults() == {}
    assert not coord.wait_fault(1, timeout_s=0.1) and not coord.wait_ready(1, ["node-0"], timeout_s=0.1)
    coordstore.report_ready(store, 1, "node-0", keys["node-0"], 0)
    coordstore.report_ready(store, 1, "node-1", keys["node-1"], 0)
    assert coord.formed(1)  # a poisoned counter pushes no honest report out of sight either


def test_a_read_never_waits_on_a_key_someone_deleted() -> None:
    """Each read is one non-blocking round trip: a check then a get waited out the store's timeout (and
    raised out of the supervisor) when a key was deleted between the two."""
    store, _ = storehost.serve()
    assert coordstore.peek(store, "spare/node-1") is None and not store.check(["spare/node-1"])  # nothing created
    store.set("spare/node-1", "x")
    assert coordstore.peek(store, "spare/node-1") == b"x" and coordstore.peek(store, "spare/node-1") == b"x"
    coord, keys, _ = keyed(store)
    coordstore.announce_spare(store, "node-1", keys["node-1"], 1)
    assert coord.spare_ready("node-1")
    coord.forget(["node-1", "node-2"])  # node-2 announced nothing: no wait, no error
    assert not coord.spare_ready("node-1")


def test_a_node_cannot_speak_for_another() -> None:
    store = dist.HashStore()
    coord, keys, refused = keyed(store)
    coord.publish(Generation(1, ["node-0", "node-1"], 2))
    mine = keys["node-1"]  # all a rank of node-1 holds
    coordstore.report_fault(store, "node-0", mine, 1, "RuntimeError: blamed on node-0's behalf")
    coordstore.report_ready(store, 1, "node-0", mine, 3)
    coordstore.announce_spare(store, "node-2", mine, 1)
    assert coord.faults() == {} and coord.ready(1) == [] and not coord.spare_ready("node-2")
    assert set(refused) == {"fault/node-0", "ready/1/node-0", "spare/node-2"}
    with pytest.raises(ValueError, match="lists \\['node-9'\\], which hold no key"):
        coord.publish(Generation(2, ["node-0", "node-9"], 2))  # a node outside the plan gets no word either


def test_each_node_gets_its_own_key_in_its_environment_only(tmp_path: Path) -> None:
    host = storehost.StoreHost.serve(["node-0", "node-1"])
    keys = host.keys(1)
    assert host.keys(1) == keys and host.keys(2)["node-0"] != keys["node-0"]  # a fresh secret per attempt
    assert host.coordinator(1) is host.coordinator(1) and host.address.startswith("127.0.0.1:")
    env = TrainEnv(tmp_path, tmp_path, 3, store=host.address)
    plan = LaunchPlan("r", 1, ["node-0", "node-1"], 1, "trainyard.workload", [], env, tmp_path, store_keys=keys)
    child = node_env(plan, "node-1", {})
    assert child["TRAINYARD_STORE_KEY"] == keys["node-1"] and keys["node-0"] not in child.values()
    assert "TRAINYARD_STORE_KEY" not in plan.env and keys["node-1"] not in repr(plan) + repr(plan.for_node("node-1"))
    assert TrainEnv.from_env(child).store_key == keys["node-1"]
    with pytest.raises(ValueError, match="TRAINYARD_STORE is set but TRAINYARD_STORE_KEY is not"):
        TrainEnv.from_env({**child, "TRAINYARD_STORE_KEY": ""})
    with pytest.raises(ValueError, match="TRAINYARD_STORE_KEY must be this node's key, 64 hex digits") as bad:
        TrainEnv.from_env({**child, "TRAINYARD_STORE_KEY": "zz" + keys["node-1"][2:]})
    assert keys["node-1"][2:] not in str(bad.value)  # an error never quotes the secret
