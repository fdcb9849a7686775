"""Several ranks per node in place: the world each rank is launched with, a node's state from its ranks', the
rank arithmetic of a generation, and what only a node's local rank 0 tells the supervisor."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from trainyard.backends.local.launcher import WORLD_NAMES, node_state, rank_env
from trainyard.protocol.coordinator import Coordinator
from trainyard.protocol.coordstore import Generation, node_keys
from trainyard.protocol.sealing import new_secret
from trainyard.recovery.watch import group_beats
from trainyard.runtime.device import local_ranks
from trainyard.runtime.elastic import Membership, generation_rank


@pytest.mark.parametrize(
    "node,local,per_node,nodes,rank,world",
    [
        (0, 0, 1, 3, 0, 3),  # one rank per node: RANK is the node's index
        (2, 0, 1, 3, 2, 3),
        (0, 1, 2, 3, 1, 6),
        (1, 0, 2, 3, 2, 6),
        (2, 1, 2, 3, 5, 6),
        (1, 3, 4, 2, 7, 8),
    ],
)
def test_each_rank_gets_the_world_torchrun_would_give(
    node: int, local: int, per_node: int, nodes: int, rank: int, world: int
) -> None:
    env = rank_env(node, local, per_node, nodes, 29517)
    assert set(env) == set(WORLD_NAMES)
    assert env == {
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(per_node),
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29517",
    }


@pytest.mark.parametrize("node,local,per_node,nodes", [(0, 2, 2, 3), (0, -1, 2, 3), (-1, 0, 2, 3), (0, 0, 1, 0)])
def test_a_rank_outside_the_world_is_refused(node: int, local: int, per_node: int, nodes: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        rank_env(node, local, per_node, nodes, 29517)


@pytest.mark.parametrize(
    "codes,state,code",
    [
        ([None, None], "running", None),
        ([0, None], "running", None),  # one rank done, the other still at work
        ([0, 0], "succeeded", 0),
        ([None, -9], "failed", -9),  # any rank lost: the node is lost (its others are killed with it)
        ([1, None], "failed", 1),
        ([0, 2], "failed", 2),
        ([None], "running", None),
        ([0], "succeeded", 0),
        ([-9], "failed", -9),
    ],
)
def test_a_node_fails_when_any_of_its_ranks_fails(codes: list[int | None], state: str, code: int | None) -> None:
    assert node_state(codes) == (state, code)


@pytest.mark.parametrize(
    "members,node,local,per_node,rank",
    [
        (["n0", "n1", "n2"], "n1", 0, 1, 1),  # one rank per node: the node's index, as ever
        (["n0", "n1", "n2"], "n2", 1, 2, 5),
        (["n0", "n2"], "n2", 0, 2, 2),  # n1 lost: n2's ranks move down by a whole node
        (["n0", "n2"], "n2", 1, 2, 3),
        (["n0", "n2", "n1"], "n1", 1, 2, 5),  # n1 back as a joiner: its ranks come last
        (["n0", "n2"], "n1", 0, 2, None),  # left out
    ],
)
def test_a_rank_in_a_generation_is_its_nodes_index_times_its_ranks_plus_its_local_rank(
    members: list[str], node: str, local: int, per_node: int, rank: int | None
) -> None:
    assert generation_rank(Generation(2, members, 2), node, local, per_node) == rank


@pytest.mark.parametrize(
    "env,expected",
    [({}, (0, 1)), ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, (1, 2)), ({"LOCAL_RANK": "0"}, (0, 1))],
)
def test_local_ranks(env: dict[str, str], expected: tuple[int, int]) -> None:
    assert local_ranks(env) == expected


@pytest.mark.parametrize(
    "env", [{"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, {"LOCAL_RANK": "x"}, {"LOCAL_WORLD_SIZE": "0"}]
)
def test_malformed_local_ranks_are_refused(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        local_ranks(env)


def test_a_member_node_brings_all_its_ranks_and_only_its_local_rank_0_speaks_for_it() -> None:
    store = dist.HashStore()
    keys = node_keys(new_secret(), ["n0", "n1", "n2"])
    coord = Coordinator(store, keys)
    ranks = [Membership(store, "n2", keys["n2"], regroup_timeout_s=0.3, local_rank=r, per_node=2) for r in (0, 1)]
    coord.publish(Generation(1, ["n0", "n1"], 2))
    # A spare of two ranks: its local rank 1 waits without a word, its local rank 0 announces the node.
    for member in reversed(ranks):
        with pytest.raises(Exception, match="no generation after 0"):
            member.next_generation()
        assert coord.spare_ready("n2") is (member.local_rank == 0)
    coord.publish(Generation(2, ["n0", "n2"], 2, joiners=["n2"]))
    for member in ranks:
        gen = member.next_generation()
        assert gen is not None and member.rank_in(gen) == 2 + member.local_rank and member.world(gen) == 4
        member.generation = gen  # as ``form`` leaves it, without a group
    ranks[1].ready(7)
    assert coord.ready(2) == []  # local rank 1 forming says nothing: rank 0 forms only once all have
    ranks[0].ready(7)
    assert coord.ready(2) == ["n2"] and coord.ready_steps(2) == {"n2": 7}
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        Membership(store, "n2", keys["n2"], local_rank=2, per_node=2)


def test_after_a_regroup_each_members_ranks_are_read_from_its_folder() -> None:
    """Three nodes of two ranks; node-1 lost: ranks 2-3 are node-2's now, ranks 4-5 its beats from before."""
    beats = {f"rank-{k}": {"node": f"node-{k // 2}", "time": 1.0} for k in range(6)}
    assert group_beats(beats, ["node-0", "node-2"], per_node=2) == {
        "rank-0": beats["rank-0"],
        "rank-1": beats["rank-1"],
    }
    beats["rank-2"] = beats["rank-3"] = {"node": "node-2", "time": 2.0}  # node-2's ranks beat under their new numbers
    assert set(group_beats(beats, ["node-0", "node-2"], per_node=2)) == {"rank-0", "rank-1", "rank-2", "rank-3"}
    assert group_beats(beats, ["node-0", "node-2"]) == {"rank-0": beats["rank-0"]}  # one rank per node: as before
