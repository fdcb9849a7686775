"""The failure / recovery notice built from a run's ledger events: a table of runs and what must be sent."""

from __future__ import annotations

import html
from typing import Any

import pytest

from trainyard.events.fold import fold
from trainyard.report.notice import MAX_MESSAGE, NO_LINK, Notice, RunFacts, build_notice

LINK = "http://airflow.example.com/trainyard/runs/nightly/manual__2026-11-28T00%3A00%3A00%2B00%3A00"
BOTH = ("failure", "recovery")


def ev(stage: str, event: str, **fields: Any) -> dict[str, Any]:
    return {"ts": fields.pop("ts", 100.0), "stage": stage, "event": event, **fields}


def ok(stage: str, seconds: float = 1.0) -> list[dict[str, Any]]:
    return [ev(stage, "stage_start"), ev(stage, "stage_end", seconds=seconds, result={})]


def failed(stage: str, error: str, message: str) -> list[dict[str, Any]]:
    return [ev(stage, "stage_start"), ev(stage, "stage_failed", error=error, message=message, seconds=0.5)]


def attempt(
    n: int,
    kind: str | None = None,
    action: str | None = None,
    culprits: tuple[str, ...] = (),
    reason: str = "",
    evidence: str = "",
) -> list[dict[str, Any]]:
    out = [
        ev(
            "train",
            "attempt_start",
            attempt=n,
            nodes=["node-0", "node-1"],
            world_size=2,
            micro_batch=2,
            resume_from="latest",
        )
    ]
    if kind:
        out += [
            ev("train", "attempt_end", attempt=n, state="failed", trigger="crash", reason=reason),
            ev(
                "train",
                "failure_classified",
                attempt=n,
                kind=kind,
                evidence=evidence,
                culprits=list(culprits),
                detected_at=100.0,
            ),
        ]
    if action:
        out.append(
            ev("train", "decision", attempt=n, kind=kind, action=action, reason=reason, nodes=["node-0", "node-1"])
        )
    if not kind:
        out.append(ev("train", "attempt_end", attempt=n, state="succeeded", seconds=3.0, last_step=20))
    return out


def figures(*lost: tuple[int, int]) -> dict[str, Any]:
    return {"failures": [{"attempt": a, "lost_steps": s} for a, s in lost], "lost_steps": sum(s for _, s in lost)}


def facts(
    failed: bool = False, task: str | None = None, link: str | None = LINK, reason: str | None = None
) -> RunFacts:
    return RunFacts(
        dag_id="nightly",
        run_id="manual__2026-11-28T00:00:00+00:00",
        failed=failed,
        failed_task=task,
        reason=reason,
        link=link,
        report="/runs/nightly/manual/report.html",
    )


BAD_DATA = [
    *ok("stage_dataset"),
    *failed("check_dataset", "DataError", "shard_0000.tok: truncated header"),
    *ok("report"),
]
RECOVERED = [
    *ok("stage_dataset"),
    *ok("check_dataset"),
    *ok("burn_in"),
    ev("train", "stage_start"),
    *attempt(1, "node_lost", "scale_down", ("node-1",), "exclude node-1, resume on 1 node"),
    *attempt(2),
    ev("train", "stage_end", seconds=9.0, result={}),
    *ok("check_checkpoint"),
    *ok("publish"),
    *ok("report"),
]
GAVE_UP = [
    *ok("stage_dataset"),
    *ok("check_dataset"),
    *ok("burn_in"),
    ev("train", "stage_start"),
    *attempt(1, "node_lost", "scale_down", ("node-1",), "exclude node-1"),
    *attempt(2, "user_error", "fail", reason="user code raised", evidence="Traceback ...\nRuntimeError: boom"),
    ev("train", "stage_failed", error="TrainingFailed", message="attempt 2 failed: user_error", seconds=9.0),
    *ok("report"),
]
CLEAN = [
    e
    for s in ("stage_dataset", "check_dataset", "burn_in", "train", "check_checkpoint", "publish", "report")
    for e in ok(s)
]
RETRIED = [*failed("stage_dataset", "TransientError", "connection reset"), *CLEAN]

# name: (events, figures, facts, on, kind or None, subject fragments, body fragments, body must not hold)
CASES: dict[
    str,
    tuple[list[dict[str, Any]], dict[str, Any], RunFacts, tuple[str, ...], str | None, list[str], list[str], list[str]],
] = {
    "a failed stage, Airflow agrees": (
        BAD_DATA,
        figures(),
        facts(failed=True, task="check_dataset"),
        BOTH,
        "failure",
        ["nightly failed at check_dataset: DataError"],
        [
            "run manual__2026-11-28T00:00:00+00:00 FAILED",
            f"Run page: {LINK}",
            "Failed stage: check_dataset",
            "Failure class: DataError",
            "Message: shard_0000.tok: truncated header",
            "Report: /runs/nightly/manual/report.html",
            "check_dataset     FAILED",
            "burn_in           not run",
        ],
        ["What recovery did"],
    ),
    "a failed stage, Airflow calls the run a success (report was its only leaf)": (
        BAD_DATA,
        figures(),
        facts(failed=False),
        BOTH,
        "failure",
        ["failed at check_dataset: DataError"],
        ["Failed stage: check_dataset", "Failure class: DataError"],
        [],
    ),
    "a failure, but only recovery notices asked for": (
        BAD_DATA,
        figures(),
        facts(failed=True, task="check_dataset"),
        ("recovery",),
        None,
        [],
        [],
        [],
    ),
    "training gave up after recovering once": (
        GAVE_UP,
        figures((1, 3)),
        facts(failed=True, task="train"),
        ("failure",),
        "failure",
        ["failed at train: TrainingFailed (user_error)"],
        [
            "Failed stage: train",
            "Failure class: TrainingFailed (user_error)",
            "What recovery did in train:",
            "attempt 1: node_lost on node-1 -> scale_down (exclude node-1); 3 step(s) lost",
            "attempt 2: user_error -> fail (user code raised)",
            "evidence: Traceback ... RuntimeError: boom",
            "Steps lost in all: 3",
        ],
        [],
    ),
    "a task killed without a word in the ledger": (
        CLEAN[:6],
        figures(),
        facts(failed=True, task="train", reason="task_failure"),
        BOTH,
        "failure",
        ["nightly failed at train"],
        ["Failed stage: train", "Failure class: not recorded"],
        ["Airflow's reason"],
    ),
    "a deadlocked run": (
        CLEAN[:2],
        figures(),
        facts(failed=True, task="check_dataset", reason="all_tasks_deadlocked"),
        BOTH,
        "failure",
        ["failed at check_dataset"],
        ["Airflow's reason: all_tasks_deadlocked"],
        [],
    ),
    "recovery acted and the run succeeded": (
        RECOVERED,
        figures((1, 2)),
        facts(),
        BOTH,
        "recovery",
        ["nightly succeeded after recovery: node_lost -> scale_down, 2 step(s) lost"],
        [
            "succeeded, but recovery acted in train",
            f"Run page: {LINK}",
            "attempt 1: node_lost on node-1 -> scale_down (exclude node-1, resume on 1 node); 2 step(s) lost",
            "Steps lost in all: 2",
            "train             ok",
        ],
        ["FAILED", "attempt 2"],
    ),
    "recovery acted, but only failure notices asked for": (
        RECOVERED,
        figures((1, 2)),
        facts(),
        ("failure",),
        None,
        [],
        [],
        [],
    ),
    "recovery acted, no base_url": (
        RECOVERED,
        figures((1, 2)),
        facts(link=None),
        ("recovery",),
        "recovery",
        [],
        [f"Run page: {NO_LINK}"],
        [],
    ),
    "a clean run": (CLEAN, figures(), facts(), BOTH, None, [], [], []),
    "a stage retried to success is no failure": (RETRIED, figures(), facts(), BOTH, None, [], [], []),
}


@pytest.mark.parametrize("name", CASES)
def test_notice(name: str) -> None:
    events, figs, run, on, kind, subject, body, absent = CASES[name]
    notice = build_notice(fold(events), figs, run, on)
    if kind is None:
        assert notice is None
        return
    assert notice is not None and notice.kind == kind
    assert notice.subject.startswith("[trainyard] ")
    for text in subject:
        assert text in notice.subject
    for text in body:
        assert text in notice.text, f"{text!r} not in:\n{notice.text}"
    for text in absent:
        assert text not in notice.text


def test_long_messages_are_cut_and_evidence_keeps_its_end() -> None:
    events = [*failed("check_dataset", "DataError", "x" * 5000)]
    line = next(
        ln for ln in build_notice(fold(events), figures(), facts(failed=True), BOTH).lines if ln.startswith("Message:")
    )
    assert len(line) == len("Message: ") + MAX_MESSAGE and line.endswith("...")
    tb = "Traceback (most recent call last):\n" + "  frame\n" * 500 + "RuntimeError: the real cause"
    gave_up = [
        *attempt(1, "user_error", "fail", evidence=tb),
        ev("train", "stage_failed", error="TrainingFailed", message="gave up", seconds=1.0),
    ]
    text = build_notice(fold(gave_up), figures(), facts(failed=True), BOTH).text
    assert "RuntimeError: the real cause" in text and "\n  frame" not in text


def test_html_escapes_the_text_and_links_the_run_page() -> None:
    notice = Notice("failure", "s", ("Message: <script>alert(1)</script> & {{ ds }}", f"Run page: {LINK}"))
    page = notice.html()
    assert "<script>" not in page and "&lt;script&gt;" in page
    assert "{{" not in page and "{{ ds }}" in html.unescape(page)  # text to the reader, nothing to a template
    assert f'<a href="{LINK}">{LINK}</a>' in page


def test_the_body_is_inert_to_any_template_engine_that_renders_it_later() -> None:
    """Rank text quoted in the body (issue 29): whoever renders it as a Jinja template gets it back unchanged."""
    import jinja2

    rank = "{{ 7*7 }} {{ conn.smtp_default.password }} {% endfor %} {# note #} \udcff"
    notice = build_notice(fold(failed("train", "TrainingFailed", rank)), {}, facts(), ["failure"])
    assert notice is not None
    said = "{{ 7*7 }} {{ conn.smtp_default.password }} {% endfor %} {# note #}"
    body = notice.html()
    assert jinja2.Environment().from_string(body).render(conn="secret") == body and said in html.unescape(body)
    subject, plain = notice.plain()  # the fallback when the HTML body cannot be encoded
    assert jinja2.Environment().from_string(plain).render(conn="secret") == plain and said in html.unescape(plain)
    assert "\\udcff" in html.unescape(plain) and (subject + plain).isascii()
