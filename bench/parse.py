"""DAG-folder parse time with 1 and with 50 specs, side by side in one process.

    python bench/parse.py [--smoke]

``base_ms`` is the parse of a folder holding one spec; ``ms_per_spec`` is
what each further spec adds ((t50 - t1) / 49). Goal: ms_per_spec <= 20.
Prints one JSON line last. ``--smoke``: 1 and 2 specs, one parse each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("AIRFLOW_HOME", tempfile.mkdtemp(prefix="bench-airflow-"))
os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")

from airflow.dag_processing.dagbag import DagBag  # noqa: E402  (after AIRFLOW_HOME is set)
from bounds import add_smoke, emit  # noqa: E402


def make_folder(root: Path, specs: int) -> Path:
    folder = root / f"dags_{specs}"
    (folder / "pipelines").mkdir(parents=True)
    shutil.copy(ROOT / "dags" / "pipelines.py", folder / "pipelines.py")
    template = (ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml").read_text()
    for i in range(specs):
        (folder / "pipelines" / f"pipeline_{i:03d}.yaml").write_text(template)
    return folder


def parse_ms(folder: Path, expect: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        bag = DagBag(dag_folder=str(folder))
        best = min(best, (time.perf_counter() - start) * 1000)
        assert not bag.import_errors and len(bag.dags) == expect, (bag.import_errors, len(bag.dags))
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    add_smoke(parser)
    args = parser.parse_args()
    many, repeats = (2, 1) if args.smoke else (50, 5)
    with tempfile.TemporaryDirectory() as tmp:
        one, full_folder = make_folder(Path(tmp), 1), make_folder(Path(tmp), many)
        parse_ms(one, 1, repeats=1)  # warm-up: first import of Airflow and trainyard modules
        base = parse_ms(one, 1, repeats)
        full = parse_ms(full_folder, many, repeats)
    per_spec = (full - base) / (many - 1)
    print(f"1 spec: {base:.1f} ms; {many} specs: {full:.1f} ms; {per_spec:.2f} ms per additional spec (goal <= 20)")
    emit(
        {
            "bench": "parse",
            "ms_per_spec": round(per_spec, 2),
            "base_ms": round(base, 1),
            f"ms_{many}_specs": round(full, 1),
        }
    )


if __name__ == "__main__":
    main()
