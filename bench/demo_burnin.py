"""The demo's pressure test, as ``make demo`` runs it, many times in a row: does it ever evict a healthy node?

    python bench/demo_burnin.py [--runs 10] [--home DIR] [--smoke]

Each run is the ``burn_in`` stage of ``dags/pipelines/nightly_pretrain.yaml``
on its own Airflow-style run (one a night), all sharing one
``TRAINYARD_HOME`` and so one hot tier and fleet history, as nights do. No
drill: every candidate is healthy, so any eviction is a false one. Prints one
JSON line last: ``evictions`` (goal 0), ``suspects_cleared`` (how often the
confirmation round saved a healthy node) and the stage's seconds. ``--smoke``: one night.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import date, timedelta
from pathlib import Path

from bounds import add_smoke

SPEC = Path(__file__).resolve().parent.parent / "dags" / "pipelines" / "nightly_pretrain.yaml"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--home", help="TRAINYARD_HOME to use (default: a new temporary folder)")
    add_smoke(parser)
    args = parser.parse_args()
    if args.smoke:
        args.runs = 1
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TRAINYARD_HOME"] = args.home or tmp  # the spec's ${TRAINYARD_HOME}, read when a run opens
        from trainyard.pipeline.run import open_run
        from trainyard.pipeline.stages import burn_in

        evicted, cleared, seconds = 0, 0, []
        for i in range(args.runs):
            night = (date(2026, 11, 1) + timedelta(days=i)).isoformat()
            run = open_run(SPEC, "nightly_pretrain", f"scheduled__{night}", night)
            began = time.monotonic()
            result = burn_in(run)
            seconds.append(time.monotonic() - began)
            evicted += len(result.evicted)
            cleared += len(result.cleared)
            print(
                f"night {i + 1:2d}: train on {', '.join(result.healthy)}"
                f"{'; EVICTED ' + json.dumps(result.evicted) if result.evicted else ''}"
                f"{'; suspects cleared: ' + ', '.join(result.cleared) if result.cleared else ''}"
                f" [{seconds[-1]:.1f} s]"
            )
    print(
        json.dumps(
            {
                "bench": "demo_burnin",
                "runs": args.runs,
                "evictions": evicted,
                "suspects_cleared": cleared,
                "stage_s_median": round(statistics.median(seconds), 2),
                "stage_s_max": round(max(seconds), 2),
            }
        )
    )


if __name__ == "__main__":
    main()
