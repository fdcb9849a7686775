"""The failure kinds' one table: every kind answers every trait, and the modules that act on a trait obey it."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import get_args

import pytest

from trainyard import kinds
from trainyard.kinds import TABLE, FailureKind, Kind
from trainyard.protocol import records
from trainyard.protocol.records import FailureRecord
from trainyard.recovery import controller, policy
from trainyard.recovery.classify import Classified, Failure, NodeFailure, classify
from trainyard.recovery.policy import InPlace, Regroup, Situation, decide
from trainyard.spec import DEFAULT_ACTIONS, RecoverySpec


def test_every_kind_of_the_vocabulary_has_one_record_and_no_trait_has_a_default() -> None:
    assert tuple(TABLE) == get_args(FailureKind)
    # A default would let a new kind leave a trait out and be silently never healed, blamed or rejoined.
    assert all(f.default is MISSING and f.default_factory is MISSING for f in fields(Kind))
    with pytest.raises(TypeError):
        Kind("retry", in_place=True, rejoins=True, why="no blames")  # type: ignore[call-arg]


def test_the_tables_the_others_read_are_the_traits() -> None:
    assert DEFAULT_ACTIONS == {name: kind.action for name, kind in TABLE.items()}
    assert records.KINDS == get_args(FailureKind)
    assert policy.IN_PLACE_KINDS == {name for name, kind in TABLE.items() if kind.in_place}
    assert controller.REJOIN_KINDS == {name for name, kind in TABLE.items() if kind.rejoins}
    assert set(DEFAULT_ACTIONS.values()) <= set(kinds.ACTIONS)


def world() -> Situation:
    return Situation(nodes=[f"node-{i}" for i in range(4)], spares=[], min_nodes=1, procs_per_node=1, global_batch=12,
                     micro_batch=3, valid_steps=[20], resumed_from=None, in_place=InPlace(True), batch_followed=True)  # fmt: skip


@pytest.mark.parametrize("kind", get_args(FailureKind))
def test_a_kind_regroups_in_place_exactly_when_its_trait_says(kind: FailureKind) -> None:
    seen = (Classified(kind, "notice", [], 40, ["node-1"]) if kind == "preempted"
            else Classified(kind, "evidence", ["node-1"], 40))  # fmt: skip
    decision = decide([], seen, world(), RecoverySpec(max_attempts=10, backoff_s=5.0, in_place=True))
    assert isinstance(decision, Regroup) == TABLE[kind].in_place, decision


@pytest.mark.parametrize("kind", ["node_lost", "oom", "diverged", "user_error", "data_error"])
def test_a_ranks_record_blames_its_node_exactly_when_the_kind_blames(kind: FailureKind) -> None:
    record = FailureRecord(kind, 1, "node-1", "host-1", "RuntimeError", "it broke", 0.0)
    failure = Failure(1, "crash", [NodeFailure("node-1", "failed", 1), NodeFailure("node-0", "failed", 1)],
                      records=[record])  # fmt: skip
    found = classify(failure)
    assert found.kind == kind
    assert found.culprits == (["node-1"] if TABLE[kind].blames else [])
