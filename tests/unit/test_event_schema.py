"""The event schema: every kind the code writes is declared, and writes that break it fail where they are made."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trainyard.events import schema
from trainyard.events.ledger import EventWriter, Ledger

ROOT = Path(__file__).resolve().parents[2]
CONSTRUCTORS = {kind.__name__: name for name, kind in schema.KINDS.items()}  # AttemptStart(...) -> attempt_start


def written() -> dict[str, set[str]]:
    """Every event kind the source writes (a literal kind given to ``append``, ``Record`` or the runtime's
    ``ledger_event``, or a typed constructor of the schema), with the field names its call spells out."""
    found: dict[str, set[str]] = {}
    for path in [*(ROOT / "include" / "trainyard").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            if name in CONSTRUCTORS:  # a typed constructor: its keywords are the fields
                found.setdefault(CONSTRUCTORS[name], set()).update(k.arg for k in node.keywords if k.arg)
                continue
            at = {"append": 1, "Record": 0, "ledger_event": 1, "event": 0}.get(str(name))  # event: bench/peers
            if at is None or len(node.args) <= at:
                continue
            kind = node.args[at]
            if not (isinstance(kind, ast.Constant) and isinstance(kind.value, str)):
                continue
            if (name == "append" and len(node.args) != 2) or (name == "event" and kind.value not in schema.KINDS):
                continue  # list.append takes one argument; the ledger's takes stage and kind
            fields = {k.arg for k in node.keywords if k.arg}
            if name == "Record" and len(node.args) > 1 and isinstance(node.args[1], ast.Dict):
                fields |= {k.value for k in node.args[1].keys if isinstance(k, ast.Constant)}
            found.setdefault(kind.value, set()).update(fields)
    return found


def test_every_event_kind_the_code_writes_is_declared_with_its_fields() -> None:
    kinds = written()
    assert {"attempt_start", "failure_classified", "decision", "step", "regrouped", "stage_end"} <= set(kinds)
    for kind, fields in kinds.items():
        assert kind in schema.KINDS, f"{kind} is written but not declared in trainyard.events.schema"
        declared = schema._hints(schema.KINDS[kind])
        assert schema.KINDS[kind].open or fields <= set(declared), (kind, fields - set(declared))


def test_the_worker_kinds_are_the_train_events_a_training_process_writes() -> None:
    assert schema.WORKER_EVENTS == {"step", "finished", "checkpoint_saved", "checkpoint_skipped", "resumed",
                                    "regrouped", "drills_acted", "drill_fired", "batch_followed"}  # fmt: skip


@pytest.mark.parametrize(
    "stage,event,fields,why",
    [
        ("train", "attempt_begun", {"attempt": 1}, "not a declared event kind"),
        ("train", "attempt_start", {"attempt": "1"}, "attempt_start.attempt must be"),
        ("train", "attempt_start", {"nodes": ["n0", 1]}, "attempt_start.nodes must be"),
        ("train", "decision", {"generation": True}, "decision.generation must be"),
        ("train", "attempt_start", {"atempt": 1}, "has no field 'atempt'"),
        ("publish", "attempt_start", {"attempt": 1}, "not an event of stage 'publish'"),
    ],
)
def test_a_write_the_schema_does_not_allow_raises(
    tmp_path: Path, stage: str, event: str, fields: dict, why: str
) -> None:
    ledger = Ledger.in_dir(tmp_path)
    with pytest.raises(schema.EventSchemaError, match=why):
        ledger.append(stage, event, **fields)
    with pytest.raises(schema.EventSchemaError, match=why):
        EventWriter.in_dir(ledger.events_dir, "rank-0").append(stage, event, **fields)
    assert not ledger.path.exists()  # nothing written


def test_open_kinds_carry_a_dict_whole_and_typed_constructors_build_conforming_fields(tmp_path: Path) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "step", step=3, loss=1.5, tokens_per_s=9.0)  # metrics: any names
    start = schema.AttemptStart(attempt=1, nodes=["n0"], world_size=1, micro_batch=2, resume_from="none")
    ledger.append("train", start.event, **start.fields())
    assert [e["event"] for e in ledger.events()] == ["step", "attempt_start"]
    assert schema.problems("train", "decision", schema.DecisionMade(attempt=1, joiners=["s0"]).fields()) == []


def test_a_malformed_worker_record_is_a_skipped_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger.in_dir(tmp_path)
    ledger.append("train", "stage_start")
    ledger.events_dir.mkdir()
    (ledger.events_dir / "rank-0.jsonl").write_text(
        '{"ts": 2e9, "stage": "train", "event": "step", "step": "seven"}\n'
        '{"ts": 2e9, "stage": "train", "event": "step", "step": 7}\n'
    )
    assert [e.get("step") for e in ledger.events()] == [None, 7]
    assert "step.step must be" in caplog.text
