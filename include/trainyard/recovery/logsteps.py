"""A training script's own log lines read as steps: which line says which step and loss (pure, no I/O).

For a script that makes no trainyard calls the log is the only word on its progress (issue 51: the
report said ``steps_trained: 0`` while the script printed ``iter 120: loss 2.34``). ``parse`` takes
one line; ``Scan`` folds the lines of one node's log in order. How the lines are read (incrementally,
capped) is ``recovery.logwatch``'s.

The default forms, tried in order on a line without its torchrun rank prefix (``[default0]:``) and
without a glog header:

- nanoGPT's ``iter 120: loss 2.3456, time 12.3ms, mfu 1.2%`` and ``step 120: train loss 2.34, val loss
  2.40`` (the train loss is taken);
- Lightning's progress bar ``Epoch 1:  45%|...| 90/200 [00:10<00:12, ..., loss=2.31, v_num=0]``: its
  ``90/200`` counts the batches of the current epoch, not the optimizer step, so the step taken is
  ``epoch x 200 + 90``, the batches trained since the start. That is the optimizer step only with
  ``accumulate_grad_batches=1`` (with k, it is k times it): a script that accumulates gives its own
  ``training.log_pattern`` (or uses ``trainyard.runtime.lightning``, whose steps are exact);
- Hugging Face Trainer's progress bar ``| 120/200 [00:30<00:20, 4.00it/s]``: the global step (the
  Trainer's bar counts optimizer steps up to ``max_steps``). Its logged dicts (``{'loss': 2.31,
  'grad_norm': ..., 'epoch': 0.5}``) name no step: their loss is taken for the last step the bar
  showed (the Trainer logs them at that step); before any bar, it is dropped rather than guessed;
- generic ``step 120 ... loss 2.3`` / ``Step 120/200`` / ``step=120`` (with a loss anywhere after it,
  ``loss 2.3``, ``loss: 2.3``, ``loss=2.3``): at the start of a line, or anywhere with a loss after it (a
  mid-sentence ``starting at step 31`` is a script's word on where it resumes, not a trained step).

A step lower than one already seen in the same log is not taken: within one process steps only grow,
and the lower numbers of a log are an evaluation bar's or a dataloader's, not training's. A loss of
``nan``/``inf`` stays non-finite (evidence of a divergence, never 0). A line longer than ``LINE_CHARS``
is matched on its first ``LINE_CHARS`` characters only, so a user's pattern costs a bounded time.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

LINE_CHARS = 1000
"""The characters of one line a pattern sees (a progress bar rewritten with ``\\r`` is split first)."""
NUMBER = r"[-+]?(?:\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|nan|NaN|inf|Inf|INF)"

_RANK_PREFIX = re.compile(r"^\[[A-Za-z_]*\d+\]:\s?")
_GLOG = re.compile(r"^\[?[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +(?:\d+ )?\S+:\d+\] ")
_LOSS_AFTER = re.compile(rf"\bloss\b\s*[:=]?\s*(?P<loss>{NUMBER})", re.IGNORECASE)

_NANOGPT_ITER = re.compile(rf"^iter (?P<step>\d+): loss (?P<loss>{NUMBER})")
_NANOGPT_EVAL = re.compile(rf"^step (?P<step>\d+): train loss (?P<loss>{NUMBER})")
_LIGHTNING = re.compile(r"^Epoch (?P<epoch>\d+):.*?\|\s*(?P<batch>\d+)/(?P<total>\d+) \[")
_HF_BAR = re.compile(r"\|\s*(?P<step>\d+)/(?P<total>\d+) \[")
_HF_DICT = re.compile(rf"^\{{.*'loss': (?P<loss>{NUMBER})[,}}]")
_GENERIC = re.compile(r"\bstep\b\s*[:=]?\s*(?P<step>\d+)\b", re.IGNORECASE)
_LEADING = re.compile(r"^\W*(?:global[ _])?step\b", re.IGNORECASE)


@dataclass(frozen=True)
class Seen:
    """What one line says: a step (None: a loss of the step seen last, Hugging Face's logged dict) and its
    loss (None: not said)."""

    step: int | None
    loss: float | None


def clean(line: str) -> str:
    """The line as the script printed it: no torchrun rank prefix, no glog header, capped."""
    line = line.strip()[: LINE_CHARS + 64]
    line = _RANK_PREFIX.sub("", line, count=1)
    return _GLOG.sub("", line, count=1)[:LINE_CHARS]


def _number(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return float(text)  # "nan" and "inf" parse as themselves: a divergence stays one
    except ValueError:
        return None


def _int(text: str) -> int | None:
    value = int(text[:18])  # a step of 18 digits is past any run: the cap keeps int() cheap on junk
    return value if value >= 0 else None


def parse(line: str, pattern: re.Pattern[str] | None = None) -> Seen | None:
    """What ``line`` says of training (None: nothing). ``pattern``: the spec's ``training.log_pattern``
    (named groups ``step``, ``loss`` optional), tried instead of the default forms."""
    text = clean(line)
    if not text:
        return None
    if pattern is not None:
        return _custom(pattern, text)
    for form in (_NANOGPT_ITER, _NANOGPT_EVAL):
        if m := form.match(text):
            return _seen(m.group("step"), m.group("loss"))
    if m := _LIGHTNING.match(text):
        epoch, batch, total = int(m.group("epoch")[:9]), int(m.group("batch")[:12]), int(m.group("total")[:12])
        return Seen(epoch * total + batch, _loss_in(text[m.end() :]))
    if m := _HF_BAR.search(text):
        return _seen(m.group("step"), None)
    if m := _HF_DICT.match(text):
        return Seen(None, _number(m.group("loss")))
    if m := _GENERIC.search(text):
        # A step named mid-sentence ("starting at step 31") is a step only beside a loss: it may be a resume's word.
        loss = _loss_in(text[m.end() :])
        return _seen(m.group("step"), None, loss) if loss is not None or _LEADING.match(text) else None
    return None


def _seen(step: str, loss: str | None, value: float | None = None) -> Seen | None:
    number = _int(step)
    return None if number is None else Seen(number, _number(loss) if loss is not None else value)


def _loss_in(text: str) -> float | None:
    m = _LOSS_AFTER.search(text)
    return _number(m.group("loss")) if m else None


def _custom(pattern: re.Pattern[str], text: str) -> Seen | None:
    m = pattern.search(text)
    if m is None or m.group("step") is None:
        return None
    try:
        step = _int(m.group("step"))
    except ValueError:  # the user's group matched something that is not a number
        return None
    loss = m.groupdict().get("loss")
    return None if step is None else Seen(step, _number(loss))


@dataclass(frozen=True)
class LogStep:
    """The furthest step a log showed, its loss, and the line that said it (for evidence)."""

    step: int
    loss: float | None
    line: str


class Scan:
    """The lines of one node's log, folded in order: the furthest step and its loss (steps only grow), and the
    first step it showed (a script counting from 0 trains step 0 too)."""

    def __init__(self, pattern: re.Pattern[str] | None = None) -> None:
        self.pattern = pattern
        self.last: LogStep | None = None
        self.first: int | None = None

    def feed(self, lines: list[str]) -> LogStep | None:
        """Take ``lines`` (in order); the furthest step now (None: none yet)."""
        for line in lines:
            seen = parse(line, self.pattern)
            if seen is None:
                continue
            if seen.step is None:  # a loss for the step seen last (Hugging Face's dict)
                if self.last is not None and seen.loss is not None:
                    self.last = LogStep(self.last.step, seen.loss, self.last.line)
            elif self.last is None or seen.step >= self.last.step:
                self.first = seen.step if self.first is None else self.first
                self.last = LogStep(seen.step, seen.loss, clean(line))
        return self.last
