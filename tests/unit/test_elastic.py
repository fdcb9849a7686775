"""The worker side of in-place recovery, in one process: which errors regroup, and waiting for a generation."""

from __future__ import annotations

import argparse

import pytest
import torch
import torch.distributed as dist

from trainyard.errors import TrainingFailed
from trainyard.protocol.coordstore import Coordinator, Generation
from trainyard.runtime.elastic import Membership, broadcast_tree, is_collective_error, parse_address
from trainyard.runtime.group import params_digest
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
    coord, group = Coordinator(store), Membership(store, "node-3", regroup_timeout_s=0.3)
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
