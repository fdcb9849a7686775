"""Notice (preemption) as the orchestrator reads it: the leave report on the coordination store, and a
Kubernetes pod given notice, through pod status and classify: ``preempted``, no host blamed."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from test_controller import CONNECTION, RESUME, T0, ctx, decision, end, ev, failed, node, ok, others, records, start
from test_coordstore import keyed
from test_k8s_objects import NOW, pod, terminated

from trainyard.backends.kubernetes.status import pod_node_status
from trainyard.protocol import coordstore
from trainyard.protocol.sealing import seal
from trainyard.recovery.classify import Failure, classify
from trainyard.recovery.commands import ExcludeNodes, KillNodes, Publish, Watch
from trainyard.recovery.controller import node_failures, step
from trainyard.recovery.observations import AttemptFailed
from trainyard.recovery.state import Course, TrainState


def test_a_leave_report_is_read_for_its_generation_and_wakes_the_supervisor() -> None:
    store = dist.HashStore()
    coordinator, keys, refused = keyed(store)
    assert coordinator.leaving(1) == [] and not coordinator.wait_fault(1, 0.0)
    coordstore.report_leave(store, "node-1", keys["node-1"], 1)
    assert coordinator.leaving(1) == ["node-1"] and coordinator.leaving(2) == []  # an old notice is not news
    assert coordinator.wait_fault(1, 0.0)  # the watch wakes at once, as on a fault report
    assert coordinator.faults() == {} and refused == []  # a leave is no fault


def test_leave_reports_are_read_only_once_the_fault_count_moved() -> None:
    """The supervisor asks at every poll: one round trip for the count, the reports only when it moved."""
    store = dist.HashStore()
    coordinator, keys, _ = keyed(store)
    name = coordstore.leave_key("node-1")
    store.set(name, seal(keys["node-1"], name, "1"))  # the report, before its writer adds to the count
    assert coordinator.leaving(1) == []
    store.add(coordstore.faulted_key(1), 1)
    assert coordinator.leaving(1) == ["node-1"]
    store.set(name, seal(keys["node-1"], name, "2"))  # unchanged count: the reading of it stands
    assert coordinator.leaving(1) == ["node-1"]


def test_a_leave_forged_for_another_node_is_refused() -> None:
    store = dist.HashStore()
    coordinator, keys, refused = keyed(store)
    name = coordstore.leave_key("node-2")
    store.set(name, seal(keys["node-1"], name, "1"))  # node-1 speaks for node-2
    store.add(coordstore.faulted_key(1), 1)
    assert coordinator.leaving(1) == [] and not coordinator.wait_fault(1, 0.0)
    assert refused == [name]


RUNNING = pod("Running", index=0, state={"running": {}})
# (id, the pod given notice, kind, culprits): a pod deleted with a grace period shows no reason of its own,
# only its exit by SIGTERM; the scheduler's preemption and the kubelet's graceful shutdown say so.
PODS = [
    ("deleted-exited-143", pod("Failed", index=1, state=terminated(143, "Error"), deleting=True), "preempted", []),
    (
        "preempted-by-the-scheduler",
        pod(
            "Failed",
            index=1,
            state=terminated(1, "Error"),
            deleting=True,
            conditions=[{"type": "DisruptionTarget", "status": "True", "reason": "PreemptionByScheduler"}],
        ),
        "preempted",
        [],
    ),
    (
        "node-shutdown",
        pod("Failed", index=1, reason="TerminationByKubelet", state=terminated(143, "Error")),
        "preempted",
        [],
    ),
    (
        "evicted-for-pressure",
        pod("Failed", index=1, reason="Evicted", state=terminated(137, "Error")),
        "node_lost",
        ["k8s-a"],
    ),
]


@pytest.mark.parametrize("given,kind,culprits", [c[1:] for c in PODS], ids=[c[0] for c in PODS])
def test_a_pod_given_notice_is_preempted_not_the_hosts_fault(given, kind: str, culprits: list[str]) -> None:
    assert pod_node_status(pod("Running", index=1, state={"running": {}}, deleting=True), "node-1", NOW).state == (
        "running"  # within its grace period the pod still trains
    )
    statuses = [pod_node_status(RUNNING, "node-0", NOW), pod_node_status(given, "node-1", NOW)]
    found = classify(Failure(1, "crash", node_failures(statuses)))
    assert (found.kind, found.culprits) == (kind, culprits), found.evidence


def test_the_controller_regroups_without_the_node_given_notice_and_lets_it_leave_on_its_own() -> None:
    state = TrainState.of([RESUME, start(1)])
    failure = Failure(1, "preempted", [ok("n0"), ok("n1"), ok("n2")], last_step=12, leaving=["n1"])
    commands = step(state, AttemptFailed(1, T0 + 50, failure, "n1 given notice"), ctx(elastic=True))
    assert records(commands)["failure_classified"]["culprits"] == []
    decided = records(commands)["decision"]
    assert decided["action"] == "regroup" and decided["left_out"] == ["n1"] and decided["kind"] == "preempted"
    assert "rejoining" not in records(commands)  # notice: the node is going away, it is not started again
    course = Course(["n0", "n2"], 2, "none")
    # Not killed: it leaves at the step boundary and exits 0 by itself.
    assert others(commands) == [KillNodes(1, []), Publish(1, 2, ["n0", "n2"], 2, []), Watch(1, course)]


def test_on_the_relaunch_path_notice_retries_on_the_same_nodes_and_marks_none() -> None:
    state = TrainState.of([RESUME, start(1)])
    seen = failed([node("n1", exit_code=-15), node("n0", log=CONNECTION), ok("n2")])
    commands = step(state, seen, ctx())
    decided = records(commands)["decision"]
    assert (decided["kind"], decided["action"]) == ("preempted", "retry")
    assert not any(isinstance(c, ExcludeNodes) for c in commands)
    assert records(commands)["failure_classified"]["culprits"] == []


def test_notices_to_attempts_that_trained_on_spend_no_attempt_those_that_did_not_do() -> None:
    """A spot fleet's notices are changes of members (the ledger says which attempts trained on before theirs)."""
    trained = [RESUME]
    for n in (1, 2, 3):
        trained += [start(n, ts=T0 + 100 * n), ev("resumed", T0 + 100 * n + 1, attempt=n, step=10 * (n - 1)),
                    end(n, ts=T0 + 100 * n + 50, last_step=10 * n), decision(n, "retry", "preempted", ts=T0 + 100 * n + 51)]  # fmt: skip
    seen = failed([node("n1", exit_code=-15), ok("n0"), ok("n2")], last_step=45)
    state = TrainState.of([*trained, start(4, ts=T0 + 400), ev("resumed", T0 + 401, attempt=4, step=30)])
    commands = step(state, type(seen)(4, T0 + 450, seen.failure, seen.reason, seen.checkpoints), ctx(max_attempts=3))
    assert records(commands)["decision"]["action"] == "retry"  # four notices, a budget of three: none spent one
    stuck = [RESUME]
    for n in (1, 2):
        stuck += [start(n, ts=T0 + 100 * n), end(n, ts=T0 + 100 * n + 50), decision(n, "retry", "preempted", ts=T0 + 100 * n + 51)]  # fmt: skip
    seen = failed([node("n1", exit_code=-15), ok("n0"), ok("n2")], last_step=0)
    commands = step(TrainState.of([*stuck, start(3, ts=T0 + 300)]),
                    type(seen)(3, T0 + 350, seen.failure, seen.reason, seen.checkpoints), ctx(max_attempts=3))  # fmt: skip
    assert records(commands)["decision"]["action"] == "fail"  # notices before any step: the budget runs out
