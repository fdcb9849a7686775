"""The lineage lease: one run trains on a pipeline's checkpoints; a dead holder's claim never sticks."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from trainyard.checkpoint import lease
from trainyard.checkpoint.lease import HOLDER, UNREADABLE, Claim, hold, read_claim, release, takeover_reason
from trainyard.cli import main
from trainyard.errors import LineageBusy
from trainyard.events.ledger import Ledger


class Clock:
    def __init__(self, t: float = 1_000_000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "ckpt" / "nightly"


def ledger(tmp_path: Path, run_id: str) -> Ledger:
    return Ledger.in_dir(tmp_path / "runs" / run_id)


def claim(run_id: str = "run-1", expires: float = 100.0) -> Claim:
    return Claim(dag_id="nightly", run_id=run_id, token="t", since=0.0, renewed=0.0, expires=expires)


@pytest.mark.parametrize(
    "held,run_id,now,state,reason",
    [
        (None, "b", 0.0, None, "free"),
        (UNREADABLE, "b", 0.0, None, "unreadable claim"),
        (claim("a"), "a", 0.0, None, "same run"),
        (claim("a"), "b", 100.0, None, "expired"),
        (claim("a"), "b", 100.0, "running", "expired"),
        (claim("a"), "b", 50.0, "failed", "holder run failed"),
        (claim("a"), "b", 50.0, "success", "holder run success"),
        (claim("a"), "b", 50.0, "absent", "holder run absent"),
        (claim("a"), "b", 50.0, "running", None),
        (claim("a"), "b", 50.0, "queued", None),
        (claim("a"), "b", 50.0, None, None),  # Airflow could not say: the lease decides
    ],
)
def test_who_may_take_the_lineage(
    held: Claim | None, run_id: str, now: float, state: str | None, reason: str | None
) -> None:
    assert takeover_reason(held, run_id, now, state) == reason


def test_a_rerun_of_a_finished_run_keeps_a_second_run_out(root: Path, tmp_path: Path) -> None:
    first = ledger(tmp_path, "run-1")
    hold(root, "nightly", "run-1", first)
    first.append("report", "stage_end", seconds=0.1)  # run-1 finished once ...
    release(root, "run-1")
    hold(root, "nightly", "run-1", first)  # ... and is cleared (or backfilled with --reprocess-behavior completed)
    with pytest.raises(
        LineageBusy,
        match=r"run run-1 of nightly since .* holds these checkpoints and is still running"
        r".*trainyard lineage release",
    ):
        hold(root, "nightly", "run-2", ledger(tmp_path, "run-2"))
    assert read_claim(root).run_id == "run-1"


@pytest.mark.parametrize("state", ["failed", "success", "absent"])
def test_a_holder_airflow_says_is_over_is_taken_over_at_once(root: Path, tmp_path: Path, state: str) -> None:
    # Marked failed in the UI: its report never ran, so its claim was never released.
    hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"))
    asked = []

    def run_state(dag_id: str, run_id: str) -> str:
        asked.append((dag_id, run_id))
        return state

    second = ledger(tmp_path, "run-2")
    hold(root, "nightly", "run-2", second, run_state=run_state)
    assert asked == [("nightly", "run-1")]
    assert read_claim(root).run_id == "run-2"
    [event] = second.events("train", "lineage_held")
    assert event["reason"] == f"holder run {state}" and event["previous"]["run_id"] == "run-1"


def test_a_holder_airflow_says_is_running_keeps_the_lineage(root: Path, tmp_path: Path) -> None:
    hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"))
    with pytest.raises(LineageBusy, match=r"\(Airflow: running\)"):
        hold(root, "nightly", "run-2", ledger(tmp_path, "run-2"), run_state=lambda d, r: "running")


def test_an_expired_lease_is_taken_over(root: Path, tmp_path: Path) -> None:
    clock = Clock()
    hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"), ttl_s=300, clock=clock)
    clock.t += 299
    with pytest.raises(LineageBusy):
        hold(root, "nightly", "run-2", ledger(tmp_path, "run-2"), ttl_s=300, clock=clock)
    clock.t += 1
    hold(root, "nightly", "run-2", ledger(tmp_path, "run-2"), ttl_s=300, clock=clock, run_state=lambda d, r: "running")
    assert read_claim(root).run_id == "run-2"


def test_a_live_renewed_lease_is_not_taken_over(root: Path, tmp_path: Path) -> None:
    clock = Clock()
    held = hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"), ttl_s=300, clock=clock)
    for _ in range(10):  # the supervisor's polls: keep() renews once a quarter of the lease has passed
        clock.t += 60
        held.keep()
    assert read_claim(root).expires >= clock.t + 240
    with pytest.raises(LineageBusy):
        hold(root, "nightly", "run-2", ledger(tmp_path, "run-2"), ttl_s=300, clock=clock)
    assert read_claim(root).token == held.claim.token


def test_a_lease_taken_over_cannot_be_renewed_or_released_by_its_old_holder(root: Path, tmp_path: Path) -> None:
    clock = Clock()
    old = hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"), ttl_s=300, clock=clock)
    clock.t += 301  # a stalled worker: its lease lapsed
    new = hold(root, "nightly", "run-2", ledger(tmp_path, "run-2"), ttl_s=300, clock=clock)
    with pytest.raises(LineageBusy, match=r"run run-1 lost its claim .* run run-2 of nightly .* holds them now"):
        old.renew()
    old.release()
    release(root, "run-1")
    assert read_claim(root) == new.claim


def test_a_retried_task_of_the_holder_takes_its_own_claim_and_ends_the_old_process(root: Path, tmp_path: Path) -> None:
    run = ledger(tmp_path, "run-1")
    zombie = hold(root, "nightly", "run-1", run)
    retry = hold(root, "nightly", "run-1", run)
    assert retry.claim.token != zombie.claim.token
    with pytest.raises(LineageBusy):
        zombie.renew()
    retry.renew()


def test_the_report_releases_only_its_own_run(root: Path, tmp_path: Path) -> None:
    hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"))
    release(root, "run-2")
    assert read_claim(root).run_id == "run-1"
    release(root, "run-1")
    assert read_claim(root) is None
    assert sorted(p.name for p in root.iterdir()) == [lease.LOCK]  # no draft claim left behind


def test_a_planted_link_is_not_followed_and_does_not_block(root: Path, tmp_path: Path) -> None:
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"run_id": "admin", "since": 9e12, "expires": 9e12}))
    root.mkdir(parents=True)
    (root / HOLDER).symlink_to(secret)
    assert read_claim(root) is UNREADABLE
    hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"))
    assert not (root / HOLDER).is_symlink() and json.loads(secret.read_text())["run_id"] == "admin"


@pytest.mark.parametrize("plant", ["nested", "fifo", "huge"])
def test_a_planted_claim_of_any_bytes_is_unreadable_and_does_not_block(root: Path, plant: str) -> None:
    """Nested past the parser (once a RecursionError), a FIFO (once an open that waited for a writer), a sparse
    file of a gigabyte (once read whole): each is a damaged claim, never a crash or a hang of the task."""
    root.mkdir(parents=True)
    path = root / HOLDER
    if plant == "nested":
        path.write_text("[" * 3000)
    elif plant == "fifo":
        os.mkfifo(path)
    else:
        path.write_text('{"run_id": "x"')
        os.truncate(path, 1 << 30)
    answer: list[object] = []
    reader = threading.Thread(target=lambda: answer.append(read_claim(root)), daemon=True)
    reader.start()
    reader.join(10)
    assert answer == [UNREADABLE]


def test_a_planted_lock_link_is_refused_by_name(root: Path, tmp_path: Path) -> None:
    root.mkdir(parents=True)
    (root / lease.LOCK).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(LineageBusy, match=r"\.HOLDER\.lock: cannot open the lineage's lock file .* remove it"):
        hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"))
    assert not (tmp_path / "elsewhere").exists()


def test_concurrent_takeovers_of_an_expired_claim_leave_one_holder(root: Path, tmp_path: Path) -> None:
    clock = Clock()
    hold(root, "nightly", "dead", ledger(tmp_path, "dead"), ttl_s=10, clock=clock)
    clock.t += 11
    start, won, lost = threading.Barrier(8), [], []

    def contend(i: int) -> None:
        start.wait()
        try:
            won.append(hold(root, "nightly", f"run-{i}", ledger(tmp_path, f"run-{i}"), ttl_s=10, clock=clock))
        except LineageBusy:
            lost.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 7
    assert read_claim(root).token == won[0].claim.token


def test_cli_release_refuses_a_live_lease_unless_forced(
    root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"))
    assert main(["lineage", "release", str(root)]) == 1
    assert "held by run run-1 of nightly since" in capsys.readouterr().err
    assert read_claim(root).run_id == "run-1"
    assert main(["lineage", "release", str(root), "--force"]) == 0
    assert "released; it was held by run run-1 of nightly" in capsys.readouterr().out
    assert read_claim(root) is None
    assert main(["lineage", "release", str(root)]) == 0
    assert "no run holds this lineage" in capsys.readouterr().out


def test_cli_release_frees_an_expired_lease_found_from_the_spec_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "nightly.yaml"
    spec.write_text(f"""\
dataset: {{source: "file://{tmp_path}/cold", name: tokens, hot: "file://{tmp_path}/hot"}}
runs_root: "file://{tmp_path}/runs"
nodes: {{count: 1}}
training: {{max_steps: 10, global_batch: 4, micro_batch: 2, checkpoint_every: 5}}
checkpoint: {{hot: "file://{tmp_path}/ckpt"}}
""")
    root = tmp_path / "ckpt" / "nightly"
    hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"), ttl_s=60, clock=Clock(1000.0))  # long expired
    assert main(["lineage", "release", str(spec)]) == 0
    assert f"{root}: released; it was held by run run-1 of nightly" in capsys.readouterr().out
    assert read_claim(root) is None


def test_a_long_publish_keeps_the_lease_alive_file_by_file(root: Path, tmp_path: Path) -> None:
    """The keeper a publish calls per uploaded file renews the run's claim once a quarter of it has passed."""
    clock = Clock()
    hold(root, "nightly", "run-1", ledger(tmp_path, "run-1"), ttl_s=100, clock=clock)
    keep = lease.keeper(root, "run-1", ttl_s=100, clock=clock)
    for _ in range(12):  # an upload of twelve files, 20 s each: 240 s, over twice the lease
        clock.t += 20
        keep()
    assert read_claim(root).expires >= clock.t + 60
    with pytest.raises(LineageBusy):
        hold(root, "nightly", "run-2", ledger(tmp_path, "run-2"), clock=clock)
