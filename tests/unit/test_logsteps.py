"""A script's own log lines read as steps (issue 51, point 9): each common form, a pattern of the spec's own,
junk, and the incremental, capped reader that turns them into ledger ``step`` events (``source: "log"``)."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from trainyard.errors import SpecError
from trainyard.recovery import logwatch
from trainyard.recovery.logsteps import Scan, Seen, parse
from trainyard.recovery.logwatch import LogSteps, LogTail
from trainyard.spec.load import spec_from_text


@pytest.mark.parametrize(
    ("line", "seen"),
    [
        ("iter 120: loss 2.3456, time 12.31ms, mfu 1.23%", Seen(120, 2.3456)),  # nanoGPT, every step
        ("step 120: train loss 2.3400, val loss 2.4000", Seen(120, 2.34)),  # nanoGPT's eval: the train loss
        ("[default0]:iter 7: loss 3.1, time 40ms", Seen(7, 3.1)),  # torchrun's rank prefix
        ("[rank1]:step 9 | lr 3e-4 | loss: 1.5e+00", Seen(9, 1.5)),
        ("Step 120/200", Seen(120, None)),
        ("global step=44 loss=0.25", Seen(44, 0.25)),
        (" 60%|██████    | 120/200 [00:30<00:20,  4.00it/s]", Seen(120, None)),  # Hugging Face's bar: global step
        ("{'loss': 2.31, 'grad_norm': 1.02, 'learning_rate': 5e-05, 'epoch': 0.5}", Seen(None, 2.31)),
        # Lightning's bar counts the batches of its epoch: epoch 1 of 200 batches, batch 90 -> 290 batches in all.
        ("Epoch 1:  45%|████▌     | 90/200 [00:10<00:12,  8.50it/s, loss=2.31, v_num=0]", Seen(290, 2.31)),
        ("{'train_runtime': 12.0, 'train_loss': 2.1, 'epoch': 1.0}", None),  # a summary, no step
        ("{'eval_loss': 2.5, 'epoch': 1.0}", None),
        ("loading 12 shards from data/", None),
        ("rank 0: starting at step 31 on 2 ranks", None),  # a resume's word mid-sentence, not a trained step
        ("", None),
        ("\x00\xff\ufffd" * 5000, None),
        ("step " + "9" * 5000, Seen(int("9" * 18), None)),  # a number past any run: capped, no traceback
    ],
)  # fmt: skip
def test_the_default_forms(line: str, seen: Seen | None) -> None:
    assert parse(line) == seen


def test_a_nan_loss_stays_non_finite() -> None:
    seen = parse("iter 31: loss nan, time 10ms")
    assert seen is not None and seen.step == 31 and seen.loss is not None and math.isnan(seen.loss)


def test_the_spec_s_own_pattern_replaces_the_default_forms() -> None:
    pattern = re.compile(r"it (?P<step>\d+) .* loss=(?P<loss>[0-9.]+)")
    assert parse("it 12 | took 3s | loss=0.75", pattern) == Seen(12, 0.75)
    assert parse("iter 12: loss 0.75", pattern) is None  # the default forms are not tried beside it
    assert parse("it 12 | loss=", re.compile(r"it (?P<step>\d+)")) == Seen(12, None)


def test_steps_only_grow_within_one_log_and_a_dict_s_loss_goes_to_the_last_step() -> None:
    scan = Scan()
    assert scan.feed(["{'loss': 9.0, 'epoch': 0.1}"]) is None  # no step yet: not guessed
    last = scan.feed(
        [" 10%|█ | 20/200 [00:01<00:09]", "{'loss': 2.5, 'epoch': 0.1}", "Eval: 50%| | 5/10 [00:01<00:01]"]
    )
    assert last is not None and (last.step, last.loss) == (20, 2.5)  # the evaluation bar's 5 is not a step


@pytest.mark.parametrize(
    ("pattern", "says"),
    [
        ("it (\\d+", "training.log_pattern: not a regular expression"),
        ("it (?P<iteration>\\d+)", "training.log_pattern: has no named group 'step'"),
    ],
)
def test_trainyard_check_refuses_a_pattern_it_cannot_use(pattern: str, says: str) -> None:
    text = (
        "dataset: {source: 'file:///tmp/c', name: d}\nnodes: {count: 1}\n"
        f"training: {{max_steps: 10, global_batch: 2, micro_batch: 1, checkpoint_every: 5, log_pattern: '{pattern}'}}\n"
    )
    with pytest.raises(SpecError, match=re.escape(says)):
        spec_from_text(text, Path("p.yaml"))


def test_the_tail_reads_only_what_was_added_and_caps_a_burst(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log = tmp_path / "node-0.log"
    log.write_bytes(b"iter 1: loss 3.0\nite")
    tail = LogTail(log)
    assert tail.read() == ["iter 1: loss 3.0"]
    with log.open("ab") as f:
        f.write(b"r 2: loss 2.9\r\n")
    assert tail.read() == ["iter 2: loss 2.9"]  # the line cut at the last read is whole now
    assert tail.read() == []
    monkeypatch.setattr(logwatch, "TAIL_BYTES", 64)
    with log.open("ab") as f:
        f.write(b"x" * 10_000 + b"\n" + b"iter 3: loss 2.8\n")
    assert tail.read() == ["iter 3: loss 2.8"]  # a burst past the cap: only its last lines, the cut one dropped
    link = tmp_path / "link.log"
    link.symlink_to(log)
    assert LogTail(link).read() == []  # training code's file: a link is not followed


def test_log_steps_become_step_events_in_the_runtime_s_shape(tmp_path: Path) -> None:
    logs = {"node-0": tmp_path / "node-0.log", "node-1": tmp_path / "node-1.log"}
    written: list[dict] = []
    steps = LogSteps(logs, None, attempt=2, world_size=2, record=written.append)
    assert steps.look(100.0) is None and written == []  # no log yet
    logs["node-0"].write_text("starting\niter 1: loss 3.0\n")
    logs["node-1"].write_text("")
    steps.look(101.0)
    logs["node-0"].write_text("starting\niter 1: loss 3.0\niter 2: loss 2.9\niter 11: loss 2.5\n")
    steps.look(103.0)
    steps.look(104.0)  # no new step: no event
    assert written == [  # the attempt resumed after step 0: its first event covers what it had trained by then
        {"step": 1, "loss": 3.0, "source": "log", "attempt": 2, "world_size": 2, "node": "node-0"},
        {"step": 11, "loss": 2.5, "source": "log", "attempt": 2, "world_size": 2, "node": "node-0",
         "first_step": 2, "steps": 10, "step_ms": 200.0},
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("start", "lines", "first_step"),
    [
        (0, range(0, 6), 0),  # nanoGPT counts from 0: its step 0 is trained too, whenever the first look comes
        (0, range(1, 6), 1),  # a script counting from 1 trains 5 steps, not 6
        (20, range(20, 26), 20),  # resumed from its save at 20, it trains step 20 again
        (20, range(23, 26), 21),  # the log's first lines were not seen: the steps after the resume point count
    ],
)
def test_the_first_event_covers_every_step_the_attempt_trained_before_the_first_look(
    tmp_path: Path, start: int, lines: range, first_step: int
) -> None:
    """Whether the first look comes at step 0 or step 5 must not change the steps trained (CI saw 60 for 61)."""
    log = tmp_path / "node-0.log"
    written: list[dict] = []
    steps = LogSteps({"node-0": log}, None, attempt=1, world_size=1, record=written.append, start_step=start)
    log.write_text("".join(f"iter {i}: loss 3.0\n" for i in lines))
    steps.look(10.0)
    [event] = written
    assert (event["first_step"], event["step"]) == (first_step, lines[-1])
    assert event["steps"] == lines[-1] - first_step + 1  # the steps it covers, both ends counted


def test_the_logs_silence_is_timed_from_the_last_new_step_until_the_attempt_s_last_step(tmp_path: Path) -> None:
    """``training.log_silence_s``: timed only once a step line was seen, reset by each new step, and not at all
    once the log showed the attempt's last step (the final save and the teardown print none)."""
    log = tmp_path / "node-0.log"
    steps = LogSteps({"node-0": log}, None, attempt=1, world_size=1, record=lambda _: None, silence_s=5.0)
    steps.target = 50
    assert steps.silence(100.0) is None  # no log, no step yet: the start-up is not timed
    log.write_text("loading\n")
    assert steps.silence(200.0) is None
    log.write_text("loading\niter 3: loss 3.0\n")
    assert steps.silence(201.0) == logwatch.LogSilence(0.0, 5.0, "iter 3: loss 3.0")
    quiet = steps.silence(207.5)
    assert quiet is not None and quiet.quiet_s == 6.5 and "no new step for 6 s" in quiet.reason()
    log.write_text("loading\niter 3: loss 3.0\niter 4: loss 2.9\n")
    assert steps.silence(208.0) == logwatch.LogSilence(0.0, 5.0, "iter 4: loss 2.9")  # moved: timed again
    log.write_text("loading\niter 3: loss 3.0\niter 4: loss 2.9\niter 50: loss 1.0\n")
    assert steps.silence(209.0) is None and steps.silence(900.0) is None  # the last step: the run is ending
    off = LogSteps({"node-0": log}, None, attempt=1, world_size=1, record=lambda _: None)
    assert off.silence(1000.0) is None  # log_silence_s null: never timed
