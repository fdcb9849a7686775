"""The message sent when a run fails or recovers (``notify`` in the spec), from the run ledger.

``build_notice`` is pure: the run's fold (``trainyard.events.fold``), the recovery figures and what
Airflow knows of the run in, a subject and a body (or nothing to send) out.
Nothing here sends mail or imports Airflow; ``trainyard.airflow.notify`` does.

Whether the run failed is Airflow's verdict *or* the ledger's: a stage that
recorded ``stage_failed`` (and was not retried to success) failed the run even
where Airflow's run state says otherwise, and a task that died without writing
to the ledger (killed, timed out, marked failed by hand) is named from Airflow's
context. "Recovery" is a run that succeeded although recovery acted in
``train``: a failure was classified and a decision taken.
"""

from __future__ import annotations

import html
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Literal

from trainyard.events.fold import RunState, fold
from trainyard.events.ledger import Ledger
from trainyard.recovery.figures import figures_from
from trainyard.report.faults import cost_line, fault_line, growth_line, resumed_by_fault
from trainyard.report.summary import STAGES, attempt_table

NoticeKind = Literal["failure", "recovery"]
MAX_MESSAGE = 800  # characters of an error message or evidence quoted in the body; the report has the rest
RUN_PAGE = "Run page: "
NO_LINK = "(no link: set [api] base_url, e.g. AIRFLOW__API__BASE_URL, to get one)"


@dataclass(frozen=True)
class RunFacts:
    """What Airflow knows of the run when its DAG-level callback fires."""

    dag_id: str
    run_id: str
    failed: bool
    """Airflow's verdict: the DAG run failed."""
    failed_task: str | None = None
    """The task Airflow blames (the last one that failed), if any."""
    reason: str | None = None
    """Airflow's reason (``task_failure``, ``all_tasks_deadlocked``, ``success``)."""
    link: str | None = None
    """The run's page in the training-runs view; None without ``[api] base_url``."""
    report: str | None = None
    """Path of the run's ``report.html``, if it was written."""


@dataclass(frozen=True)
class Notice:
    kind: NoticeKind
    subject: str
    lines: tuple[str, ...]

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    @property
    def link(self) -> str | None:
        """The run page's URL (Airflow's ``[api] base_url`` is set), else None."""
        for line in self.lines:
            if line.startswith(RUN_PAGE + "http"):
                return line.removeprefix(RUN_PAGE)
        return None

    def html(self) -> str:
        """The body as HTML (the SMTP notifier sends HTML): preformatted text, the run link clickable."""
        body = html.escape(self.text)
        if url := self.link:
            body = body.replace(html.escape(url), f'<a href="{html.escape(url)}">{html.escape(url)}</a>', 1)
        return f'<pre style="font-family: monospace">{_inert(body)}</pre>'

    def slack(self) -> str:
        """The message as Slack text: the subject in bold, the body as a code block, the run page after it
        (a link). ``&``, ``<`` and ``>`` escaped as Slack asks: a rank's ``<!channel>`` or ``<url|label>``
        is shown, never acted on."""
        text = f"*{_slack(self.subject)}*\n```\n{_slack(self.text)}\n```"
        return f"{text}\n{_slack(self.link)}" if self.link else text

    def plain(self) -> tuple[str, str]:
        """Subject and body in ASCII (every other character escaped as ``\\uXXXX``), no link markup: what any
        mail path can encode, for a body that could not go as :meth:`html` (rank text is not ours to clean)."""
        text = html.escape(_ascii(self.text))
        return _ascii(self.subject), f"<pre>{_inert(text)}</pre>"


def _slack(text: str) -> str:
    # Every backtick followed by a zero-width space: no run of them in rank text can close the code block
    # (replacing only "```" left "````" as "`\u200b```", which still closes it).
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("`", "`\u200b")


def _ascii(text: str) -> str:
    return text.encode("ascii", "backslashreplace").decode("ascii")


def _inert(markup: str) -> str:
    """``markup`` with its braces as HTML entities: it reads the same in a mail client, and no template
    engine (Jinja's ``{{``, ``{%``, ``{#``) finds anything to run in it, whoever renders it later."""
    return markup.replace("{", "&#123;").replace("}", "&#125;")


def notice_from_ledger(ledger: Ledger, facts: RunFacts, on: Collection[str]) -> Notice | None:
    """Read the run's ledger and build its notice (None: nothing to send)."""
    state = fold(ledger.events())
    return build_notice(state, figures_from(state), facts, on)


def build_notice(state: RunState, figures: dict[str, Any], facts: RunFacts, on: Collection[str]) -> Notice | None:
    """The notice ``on`` asks for, or None: a failure if the run failed, else a recovery if recovery acted."""
    stages = state.stages
    failed_stages = [name for name, s in stages.items() if not s["ok"]]
    recovered = [row for row in attempt_table(state.train) if row["faults"] or row["growths"]]
    if facts.failed or failed_stages:
        if "failure" not in on:
            return None
        return _failure(state, failed_stages, recovered, figures, facts)
    if recovered and "recovery" in on:
        return _recovery(stages, recovered, figures, facts)
    return None


def _failure(
    state: RunState,
    failed_stages: list[str],
    recovered: list[dict[str, Any]],
    figures: dict[str, Any],
    facts: RunFacts,
) -> Notice:
    lines = [f"Pipeline {facts.dag_id}: run {facts.run_id} FAILED.", *_where(facts), ""]
    if failed_stages:
        stage = failed_stages[0]  # the first to fail; later ones (a report of a broken run) follow from it
        said = state.errors.get(stage)
        error, message = (said.error, said.message) if said else ("unknown error", "")
        kind = _training_kind(recovered) if stage == "train" and error == "TrainingFailed" else None
        cls = f"{error} ({kind})" if kind else error
        subject = f"[trainyard] {facts.dag_id} failed at {stage}: {cls}"
        lines += [f"Failed stage: {stage}", f"Failure class: {cls}", f"Message: {_cut(message)}"]
        lines += [f"Also failed: {name}" for name in failed_stages[1:]]
    else:
        task = facts.failed_task or "unknown task"
        subject = f"[trainyard] {facts.dag_id} failed at {task}"
        lines += [
            f"Failed stage: {task}",
            "Failure class: not recorded (the task ended without writing to the run"
            " ledger: killed, timed out or marked failed by hand; see its task log)",
        ]
    if facts.reason and facts.reason not in ("task_failure", "success"):
        lines.append(f"Airflow's reason: {facts.reason}")
    if recovered:
        lines += ["", *_recovery_lines(recovered, figures)]
    return Notice("failure", subject, tuple([*lines, "", *_stage_lines(state.stages)]))


def _recovery(
    stages: dict[str, dict[str, Any]], recovered: list[dict[str, Any]], figures: dict[str, Any], facts: RunFacts
) -> Notice:
    kinds = ", ".join(
        dict.fromkeys(
            f"{f['failure']['kind']} -> {f['decision']['action']}"
            for r in recovered
            for f in r["faults"]
            if f["failure"] and f["decision"]
        )
    )
    lost = figures.get("lost_steps")
    steps = "steps lost unknown" if lost is None and figures.get("lost_steps_why") else f"{lost or 0} step(s) lost"
    subject = f"[trainyard] {facts.dag_id} succeeded after recovery: {kinds or 'recovery acted'}, {steps}"
    lines = [
        f"Pipeline {facts.dag_id}: run {facts.run_id} succeeded, but recovery acted in train.",
        *_where(facts),
        "",
        *_recovery_lines(recovered, figures),
        "",
        *_stage_lines(stages),
    ]
    return Notice("recovery", subject, tuple(lines))


def _where(facts: RunFacts) -> list[str]:
    lines = [f"{RUN_PAGE}{facts.link or NO_LINK}"]
    if facts.report:
        lines.append(f"Report: {facts.report}")
    return lines


def _training_kind(recovered: list[dict[str, Any]]) -> str | None:
    """The kind of the failure that ended training (the last attempt's), when one was classified."""
    last = recovered[-1] if recovered else None
    return last["failure"]["kind"] if last and last["failure"] else None  # the attempt's last failure


def _recovery_lines(recovered: list[dict[str, Any]], figures: dict[str, Any]) -> list[str]:
    """Every fault of every attempt, with its decision (and, healed in place, the generation and who joined),
    every growth of the world, and the world path."""
    lost: dict[int, list[Any]] = {}  # the figures' failures, per attempt, in the order they were classified
    for f in figures.get("failures", []):
        lost.setdefault(f["attempt"], []).append(f.get("lost_steps"))
    lines = ["What recovery did in train:"]
    for row in recovered:
        dated: list[tuple[float, list[str]]] = []
        for i, fault in enumerate(row["faults"]):
            failure, decision = fault["failure"] or {}, fault["decision"] or {}
            why = f" ({decision['reason']})" if decision.get("reason") else ""
            steps = lost.get(row["attempt"], [])
            lost_here = steps[i] if i < len(steps) else None
            said = [f"  attempt {row['attempt']}: {fault_line(fault)}{why}"
                    + (f"; {lost_here} step(s) lost" if lost_here is not None else "")]  # fmt: skip
            if failure.get("evidence"):
                said.append(f"    evidence: {_cut(str(failure['evidence']), tail=True)}")
            dated.append(((failure or decision).get("ts") or 0.0, said))
        dated += [(g["ts"] or 0.0, [f"  attempt {row['attempt']}: {growth_line(g)}"]) for g in row["growths"]]
        lines += [line for _, said in sorted(dated, key=lambda d: d[0]) for line in said]
    if figures.get("world_path"):
        lines.append(f"World path: {figures['world_path']}")
    if cost := cost_line(figures):
        lines.append(f"Fault cost in all: {cost}")
    lines += [f"{label[0].upper()}{label[1:]}: {said}" for label, said in resumed_by_fault(figures)]
    if figures.get("lost_steps") is None and figures.get("lost_steps_why"):
        lines.append(f"Steps lost in all: unknown ({figures['lost_steps_why']})")
    else:
        lines.append(f"Steps lost in all: {figures.get('lost_steps') or 0}")
    if figures.get("productive_s") is None and figures.get("productive_why"):
        lines.append(f"Productive training time: unknown ({figures['productive_why']})")
    return lines


def _stage_lines(stages: dict[str, dict[str, Any]]) -> list[str]:
    lines = ["Stages:"]
    for name in STAGES:
        if name in stages:
            s = stages[name]
            lines.append(f"  {name:<17} {'ok' if s['ok'] else 'FAILED':<7} {s['seconds']:.1f} s")
        else:
            lines.append(f"  {name:<17} not run")
    return lines


def _cut(text: str, tail: bool = False) -> str:
    """One line of at most ``MAX_MESSAGE`` characters; ``tail`` keeps the end (a traceback's last line says most)."""
    text = " ".join(text.split())
    if len(text) <= MAX_MESSAGE:
        return text
    return "..." + text[3 - MAX_MESSAGE :] if tail else text[: MAX_MESSAGE - 3] + "..."
