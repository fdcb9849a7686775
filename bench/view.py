"""The run page of a 1,000,000-step run, served by the training-runs view, beside its baselines.

    python bench/view.py

The ledger is written by the runtime's own writer (``tests/unit/long_run.py``:
``runtime.heartbeat`` every step, with a fake clock of 0.1 s steps, a checkpoint
every 1,000 steps, one fault). Then the view's route renders the page, as a
browser's visit does:

- ``page_s``: the first visit (the ledger parsed once, then summarised and rendered);
- ``revisit_s``: a later visit after one more event (only the new line is parsed);
- ``parse_s``: the baseline, ``json.loads`` of every line of the ledger once;
- ``small_page_s``: the page of a 3,000-step run of the same shape.

Goal: ``page_s`` < 1 s and ``ledger_mb`` < 20. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from bounds import add_smoke, emit  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from long_run import STEPS, write_long_run  # noqa: E402

from trainyard.airflow import views  # noqa: E402
from trainyard.events.ledger import LEDGER_FILE, Ledger  # noqa: E402


def timed(fn) -> tuple[float, object]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def visit(client: TestClient, run_id: str) -> float:
    seconds, response = timed(lambda: client.get(f"/runs/nightly/{quote(run_id, safe='')}"))
    assert response.status_code == 200 and "Loss" in response.text, response.text[:300]  # type: ignore[attr-defined]
    return seconds


SMOKE_STEPS = 5000
"""``--smoke``: the long run's steps (its every path, in a second)."""


def main() -> None:
    parser = argparse.ArgumentParser()
    add_smoke(parser)
    steps = SMOKE_STEPS if parser.parse_args().smoke else STEPS
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["TRAINYARD_HOME"] = str(root)
        write_s, big = timed(lambda: write_long_run(root / "runs", steps=steps, run_id="long"))
        write_long_run(root / "runs", steps=3000, run_id="small")
        ledger = big / LEDGER_FILE  # type: ignore[operator]

        async def anyone() -> views.MayRead:
            async def may_read(dag_id: str) -> bool:
                return True

            return may_read

        views.app.dependency_overrides[views.access] = anyone
        client = TestClient(views.app)
        visit(client, "small")  # warm-up: imports, the app's first request
        small = visit(client, "small")
        parse_s, events = timed(lambda: [json.loads(line) for line in ledger.open("rb")])
        page = visit(client, "long")
        Ledger(ledger).append("train", "checkpoint_tiered", path="/ck/step_1000000", uri="file:///cold", bytes=1)
        revisit = visit(client, "long")
        index_s, index = timed(lambda: client.get("/api/runs"))
        assert index.status_code == 200 and len(index.json()) == 2  # type: ignore[attr-defined]
        mb = ledger.stat().st_size / 2**20
    result = {
        "bench": "view",
        "page_s": round(page, 3),
        "ledger_mb": round(mb, 2),
        "revisit_s": round(revisit, 3),
        "parse_s": round(parse_s, 3),
        "ratio_vs_parse": round(page / parse_s, 2),
        "small_page_s": round(small, 3),
        "index_s": round(index_s, 3),
        "steps": steps,
        "events": len(events),
        "write_s": round(write_s, 1),  # type: ignore[arg-type]
    }
    print(
        f"{steps} steps: {result['events']} events; page {page:.3f} s (revisit {revisit:.3f} s),"
        f" json parse of the ledger {parse_s:.3f} s, small run page {small:.3f} s"
    )
    emit(result)


if __name__ == "__main__":
    main()
