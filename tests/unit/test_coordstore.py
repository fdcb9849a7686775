"""The coordination store's generation record and the supervisor's client, on an in-process store."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from trainyard.protocol import coordstore
from trainyard.protocol.coordstore import Coordinator, Generation
from trainyard.recovery import storehost


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
    ],
)
def test_generation_refuses_a_bad_record(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        Generation.from_json(text)


def test_coordinator_reads_what_workers_report() -> None:
    store = dist.HashStore()
    coord = Coordinator(store)
    assert coord.current() is None and coord.faults() == {} and coord.ready(2) == []
    coord.publish(Generation(1, ["node-0", "node-1", "node-2"], 2))
    coordstore.report_fault(store, "node-0", 1, "RuntimeError: Connection reset by peer")
    coordstore.report_fault(store, "node-2", 1, "RuntimeError: Connection reset by peer", suspect="node-1")
    assert coord.faults() == {
        "node-0": "generation 1: RuntimeError: Connection reset by peer (suspect: unknown)",
        "node-2": "generation 1: RuntimeError: Connection reset by peer (suspect: node-1)",
    }
    assert coord.faults(generation=2) == {}
    coord.publish(Generation(2, ["node-0", "node-2"], 3, from_step=5))
    assert coord.current() == Generation(2, ["node-0", "node-2"], 3, [], 5)
    assert Generation.from_json(store.get(coordstore.gen_key(1))).number == 1  # an old generation stays readable
    coordstore.report_ready(store, 2, "node-2", 5)
    assert not coord.wait_ready(2, ["node-0", "node-2"], timeout_s=0.2)
    coordstore.report_ready(store, 2, "node-0", 5)
    assert coord.wait_ready(2, ["node-0", "node-2"], timeout_s=1.0)
    assert coord.ready(2) == ["node-2", "node-0"] and coord.ready_steps(2) == {"node-2": 5, "node-0": 5}


def test_serve_hosts_a_store_clients_reach() -> None:
    store, port = storehost.serve()
    client = dist.TCPStore("127.0.0.1", port, is_master=False)
    Coordinator(store).publish(Generation(1, ["node-0"], 1))
    assert Generation.from_json(client.get(coordstore.GEN)).members == ["node-0"]


def test_the_supervisor_wakes_on_a_fault_report_of_its_generation_only() -> None:
    store, port = storehost.serve()
    coord = Coordinator(storehost.attempt_store(store, 1))
    worker = storehost.attempt_store(dist.TCPStore("127.0.0.1", port, is_master=False), 1)
    began = time.monotonic()
    assert not coord.wait_fault(1, timeout_s=0.2)  # nothing reported: it waited the whole pause
    assert time.monotonic() - began >= 0.2
    threading.Timer(0.3, coordstore.report_fault, (worker, "node-2", 1, "RuntimeError: Connection closed")).start()
    began = time.monotonic()
    assert coord.wait_fault(1, timeout_s=10.0)
    assert time.monotonic() - began < 5.0  # woken by the report, not by the end of the pause
    assert not coord.wait_fault(2, timeout_s=0.1)  # an older generation's report does not wake a newer one


def test_spares_announce_themselves_and_are_forgotten_once_listed_and_formed_follows_the_newest() -> None:
    store = dist.HashStore()
    coord = Coordinator(store)
    coord.publish(Generation(1, ["node-0", "node-1"], 3))
    store.set(coordstore.spare_key("node-2"), "1")
    store.set(coordstore.spare_key("node-3"), "1")
    assert coord.spares_ready(["node-3", "node-2", "node-9"]) == ["node-3", "node-2"]
    coord.publish(Generation(2, ["node-0", "node-1", "node-2"], 2, joiners=["node-2"]))
    assert coord.spares_ready(["node-2", "node-3"]) == ["node-3"]  # a member is no spare
    coord.forget(["node-3"])
    assert coord.spares_ready(["node-3"]) == []
    assert not coord.formed(2)
    coordstore.report_ready(store, 2, "node-0", 9)
    coordstore.report_ready(store, 2, "node-1", 9)
    assert not coord.formed(2)  # node-2 has not formed it yet
    # Generation 3 supersedes 2 before node-2 formed it: once 3 is formed, so is "2 or later".
    coord.publish(Generation(3, ["node-0", "node-1"], 3))
    for node in ("node-0", "node-1"):
        coordstore.report_ready(store, 3, node, 9)
    assert coord.formed(2) and coord.formed(3) and not coord.formed(4)
