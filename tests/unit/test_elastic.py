"""The worker side of in-place recovery, in one process: which errors regroup, waiting for a generation, and the
elastic group as a loop calls it (torchrun's world, and in place: a world that grows, a fault, a node left out)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from trainyard.errors import TrainingFailed
from trainyard.protocol import coordstore
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import Generation, node_keys
from trainyard.protocol.env import TrainEnv
from trainyard.protocol.sealing import new_secret, seal
from trainyard.runtime.broadcast import broadcast_tree
from trainyard.runtime.elastic import Membership, is_collective_error, parse_address
from trainyard.runtime.group import InPlaceGroup, elastic_group, params_digest
from trainyard.workload import loop
from trainyard.workload.model import GPT, GPTConfig

# What torch 2.13's gloo raised in the step-0 experiment, when a peer was SIGKILLed mid all-reduce.
RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:25515: "
    "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in the application."
)


def test_a_lost_peer_regroups_and_a_bug_does_not() -> None:
    assert is_collective_error(RuntimeError(RESET))
    assert is_collective_error(RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms"))
    assert is_collective_error(dist.DistBackendError("anything the backend says"))
    assert not is_collective_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x16 and 8x16)"))
    assert not is_collective_error(ValueError("Connection reset by peer"))  # not what gloo raises


def test_parse_address() -> None:
    assert parse_address("127.0.0.1:29500") == ("127.0.0.1", 29500)
    with pytest.raises(ValueError, match="TRAINYARD_STORE='127.0.0.1' is not host:port"):
        parse_address("127.0.0.1")


def test_next_generation_lists_this_node_or_lets_it_go() -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1", "node-3"])
    coord, group = Coordinator(store, keys), Membership(store, "node-3", keys["node-3"], regroup_timeout_s=0.3)
    coord.publish(Generation(1, ["node-0", "node-1"], 2))
    # Never a member yet (a spare): a generation without it is not its end; it waits on, here until the timeout.
    with pytest.raises(TrainingFailed, match="node-3: no generation after 0 within") as caught:
        group.next_generation()
    assert (
        caught.value.kind == "transient"
        and "no generation after" in str(caught.value)
        and coord.spare_ready("node-3")
        and not coord.spare_ready("node-1")
    )
    coord.publish(Generation(2, ["node-0", "node-3"], 2, joiners=["node-3"]))
    gen = group.next_generation()
    assert gen is not None and gen.number == 2 and gen.rank_of("node-3") == 1
    group.generation, group.formed = gen, 1  # as ``form`` leaves it
    coord.publish(Generation(3, ["node-0"], 4))
    assert group.next_generation() is None  # a member left out exits


def test_a_forged_generation_is_ignored_and_the_node_waits_for_the_supervisors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1"])
    coord, member = Coordinator(store, keys), Membership(store, "node-0", keys["node-0"], regroup_timeout_s=0.3)
    coord.publish(Generation(1, ["node-0", "node-1"], 2))
    member.generation, member.formed = member.next_generation(), 1  # as ``form`` leaves it
    without_me = Generation(2, ["node-1"], 2).to_json()  # a generation that would make node-0 exit
    name = coordstore.current_key("node-0")
    malformed = seal(keys["node-0"], name, '{"number": "x"}')  # sealed right, but not a generation
    for forged in (without_me, seal(keys["node-1"], name, without_me), malformed, "\xff" * 64):
        store.set(name, forged)
        assert member.newer() == 0  # rank 0's per-step look: nothing newer, training goes on
        with pytest.raises(TrainingFailed, match="node-0: no generation after 1 within"):
            member.next_generation(timeout_s=0.3)  # no exit, no traceback: it waits on for an authentic one
    assert caplog.text.count("node-0: refused gen/now/node-0") == 3  # logged once per refusal, not per poll
    store.set(coordstore.gen_key(3, "node-0"), Generation(3, ["node-1"], 2).to_json())
    assert member.grown_to(3) is None  # rank 0's word names 3: a forged copy of it is no reason to leave either
    coord.publish(Generation(2, ["node-1"], 2))  # the supervisor's own word: node-0 is left out and goes
    grown = member.grown_to(2)
    assert member.newer() == 2 and grown is not None and grown.members == ["node-1"]
    assert member.next_generation() is None


def test_the_word_moves_a_node_only_to_a_newer_generation_sealed_for_it(caplog: pytest.LogCaptureFixture) -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1"])
    coord, member = Coordinator(store, keys), Membership(store, "node-1", keys["node-1"])
    coord.publish(Generation(1, ["node-0"], 2))  # sealed for node-1 too (so that it can tell it is not listed)
    coord.publish(Generation(2, ["node-0", "node-1"], 2))
    member.generation, member.formed = member.next_generation(), 1
    with caplog.at_level(logging.WARNING):
        assert member.grown_to(1) is None and member.grown_to(2) is None  # old, or the current one: no move
        assert member.grown_to(3) is None  # never published: no wait, no exit, training goes on
    assert caplog.text.count("which is not one sealed for it after 2; ignored") == 3  # once per number named
    coord.publish(Generation(3, ["node-0"], 2))
    grown = member.grown_to(3)
    assert grown is not None and grown.members == ["node-0"]  # the supervisor's own word: left out


def _forging(monkeypatch: pytest.MonkeyPatch, at: list[int], word: float) -> None:
    """Another member's rank adding ``word`` into the step's grow word (the last but one slot) at the steps ``at``."""
    honest, steps = dist.all_reduce, iter(range(1, 100))

    def all_reduce(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        done = honest(tensor, *args, **kwargs)
        if next(steps) in at:
            tensor[-2] += word
        return done

    monkeypatch.setattr(dist, "all_reduce", all_reduce)


@pytest.mark.parametrize("word", [1.0, 7.0, float("inf"), float("nan"), -2.0])
def test_a_rank_naming_an_old_or_forged_generation_does_not_make_a_healthy_node_leave(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, word: float
) -> None:
    """Generation 1 did not list node-1 and is sealed for it: a member naming it once made node-1 exit as left
    out; naming one never published made it wait the regroup timeout and fail; an infinity raised out of its step."""
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1"])
    coord = Coordinator(store, keys)
    ctx = TrainEnv(tmp_path, tmp_path / "ckpt", 4, node="node-1", store="127.0.0.1:1")
    module = torch.nn.Linear(2, 1)
    member = Membership(store, "node-1", keys["node-1"], regroup_timeout_s=0.5)
    group = InPlaceGroup(ctx, {"model": module}, lambda: DDP(module), member)
    coord.publish(Generation(1, ["node-0"], 1))
    coord.publish(Generation(2, ["node-1"], 1))  # node-0 lost; node-1 trains alone in a world of one
    _forging(monkeypatch, [2, 3], word)
    try:
        assert group.form() and group.number == 2
        with group.guard():
            for step in group.steps():
                assert group.all_reduce(torch.full((), 2.0)).item() == 2.0
                group.commit(step)
        assert not group.form() and not group.left_out and group.step == 4  # trained to its end, in generation 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_genuine_newer_generation_without_the_node_still_lets_it_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1"])
    coord = Coordinator(store, keys)
    ctx = TrainEnv(tmp_path, tmp_path / "ckpt", 6, node="node-1", store="127.0.0.1:1")
    module = torch.nn.Linear(2, 1)
    group = InPlaceGroup(ctx, {"model": module}, lambda: DDP(module), Membership(store, "node-1", keys["node-1"]))
    coord.publish(Generation(1, ["node-0"], 1))
    coord.publish(Generation(2, ["node-1"], 1))
    try:
        assert group.form() and group.number == 2
        with group.guard():
            for step in group.steps():
                if step == 3:  # the supervisor's generation 3 leaves node-1 out: rank 0's word names it
                    coord.publish(Generation(3, ["node-0"], 1))
                group.all_reduce(torch.zeros(()))
                group.commit(step)
        assert not group.form() and group.left_out and group.step == 3
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_node_holding_another_nodes_key_cannot_speak_for_it() -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1"])
    coord = Coordinator(store, keys)
    coord.publish(Generation(1, ["node-1"], 2))  # node-0 waits as a spare
    impostor = Membership(store, "node-0", keys["node-1"], regroup_timeout_s=0.3)  # claims node-0, holds node-1's key
    with pytest.raises(TrainingFailed, match="no generation after 0"):
        impostor.next_generation()  # what the supervisor sealed for node-0 does not open with node-1's key
    impostor.generation = Generation(1, ["node-0"], 2)
    impostor.ready(4)
    impostor.on_fault(RuntimeError(RESET))
    assert coord.faults() == {} and coord.ready(1) == [] and not coord.spare_ready("node-0")
    assert set(coord.refused) == {"fault/node-0", "ready/1/node-0"}
    with pytest.raises(ValueError, match="TRAINYARD_STORE_KEY must hold node-0's key"):
        Membership(store, "node-0", "")


def test_a_step_whose_last_collective_fails_changes_nothing(
    one_process_group: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit point: the loss all-reduce (the step's last collective) comes before the optimizer step."""
    torch.manual_seed(0)
    model = loop.wrap(GPT(GPTConfig(vocab_size=64, seq_len=8, d_model=16, n_layers=1, n_heads=2)), loop.device.CPU)
    optimizer = loop.build_optimizer(model, argparse.Namespace(lr=1e-2, weight_decay=0.1))
    before = params_digest(model)

    def lost_peer(tensor: torch.Tensor, *args: object, **kwargs: object) -> None:
        raise RuntimeError(RESET)

    monkeypatch.setattr(dist, "all_reduce", lost_peer)
    batch = torch.randint(0, 64, (2, 9))
    with pytest.raises(RuntimeError, match="Connection reset by peer"):
        loop.train_step(model, optimizer, [(batch[:, :-1], batch[:, 1:])], 1e-2, 1.0)
    assert params_digest(model) == before and not optimizer.state  # nothing applied: the step is redone


def test_a_state_tree_travels_whole_with_its_tensors_apart(one_process_group: None) -> None:
    """Nested dicts and lists, tensors of several dtypes and shapes (a 0-d step, an empty one), plain values."""
    tree = {
        "model": {"w": torch.randn(3, 4), "b": torch.arange(5, dtype=torch.int64)},
        "optim": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": torch.randn(2, 2)}},
                  "param_groups": [{"lr": 0.01, "params": [0]}], "empty": torch.zeros(0)},
    }  # fmt: skip
    got = broadcast_tree(tree, 0)
    assert got["optim"]["param_groups"] == [{"lr": 0.01, "params": [0]}]
    for a, b in ((got["model"]["w"], tree["model"]["w"]), (got["model"]["b"], tree["model"]["b"]),
                 (got["optim"]["state"][0]["step"], tree["optim"]["state"][0]["step"]),
                 (got["optim"]["empty"], tree["optim"]["empty"])):  # fmt: skip
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_without_a_store_the_group_is_torchruns_world_and_heals_nothing(
    one_process_group: None, tmp_path: Path
) -> None:
    module = torch.nn.Linear(2, 1)
    group = elastic_group(TrainEnv(tmp_path, tmp_path / "ckpt", 3), {"model": module}, wrap=lambda: DDP(module))
    assert not group.in_place and group.form() and (group.number, group.rank, group.world_size, group.step) == (
        1, 0, 1, 0)  # fmt: skip
    assert isinstance(group.model, DDP) and list(group.steps()) == [1, 2, 3]
    total = torch.ones(())
    assert group.all_reduce(total) is total and total.item() == 1.0
    with pytest.raises(RuntimeError, match="Connection reset by peer"), group.guard():
        raise RuntimeError(RESET)  # a lost peer ends the process: the supervisor relaunches
    group.commit(3)
    assert not group.form() and not group.left_out and group.step == 3


def test_in_place_the_group_grows_at_a_step_boundary_regroups_after_a_fault_and_lets_a_node_go(
    tmp_path: Path,
) -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1"])
    coord = Coordinator(store, keys)
    ctx = TrainEnv(tmp_path, tmp_path / "ckpt", 6, node="node-0", store="127.0.0.1:1")
    module = torch.nn.Linear(2, 1)
    group = InPlaceGroup(ctx, {"model": module}, lambda: DDP(module), Membership(store, "node-0", keys["node-0"]))
    coord.publish(Generation(1, ["node-0"], 1))
    try:
        assert group.in_place and group.form() and (group.number, group.rank, group.step) == (1, 0, 0)
        with group.guard():
            for step in group.steps():
                if step == 2:  # the world grows: the step's all-reduce carries rank 0's word
                    coord.publish(Generation(2, ["node-0"], 1))
                assert group.all_reduce(torch.full((), 2.0)).item() == 2.0  # the loss, as it was
                group.commit(step)
        assert group.step == 2  # left after the step where the word came
        assert group.form() and (group.number, group.step) == (2, 2) and isinstance(group.model, DDP)
        with group.guard():
            for step in group.steps():  # no all_reduce here: the group agrees on its word alone
                if step == 4:
                    raise RuntimeError(RESET)
                group.commit(step)
        assert group.model is None and group.step == 3 and "node-0" in coord.faults(2)
        coord.publish(Generation(3, ["node-0"], 1))
        assert group.form() and (group.number, group.step) == (3, 3)
        with group.guard():
            for step in group.steps():
                group.commit(step)
                raise RuntimeError(RESET)  # after its commit point: step 4 stays done
        coord.publish(Generation(4, ["node-1"], 1))
        assert not group.form() and group.left_out and group.step == 4  # left out: it stops, unfinished
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_in_place_a_step_that_fails_again_after_regrouping_ends_the_process(tmp_path: Path) -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["node-0", "node-1"])
    coord = Coordinator(store, keys)
    ctx = TrainEnv(tmp_path, tmp_path / "ckpt", 6, node="node-0", store="127.0.0.1:1")
    module = torch.nn.Linear(2, 1)
    group = InPlaceGroup(ctx, {"model": module}, lambda: DDP(module), Membership(store, "node-0", keys["node-0"]))
    try:
        for number in (1, 2):
            coord.publish(Generation(number, ["node-0"], 1))
            assert group.form() and group.step == 0
            with group.guard():
                raise RuntimeError(RESET)
    except TrainingFailed as exc:
        assert number == 2 and "step 1 failed again after regrouping" in str(exc) and exc.kind == "transient"
    else:
        pytest.fail("the second failure of step 1 regrouped again")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
