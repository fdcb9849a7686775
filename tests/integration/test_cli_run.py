"""The command's stdout closed by its reader (``trainyard check ... | head``) ends it quietly, as other CLIs end.

``trainyard run SPEC`` (one real ``airflow dags test`` of a spec in the project's environment, exiting by the DAG
run's state as Airflow records it) is asserted on runs other tests make anyway: a run that succeeded exits 0 with
its summary (test_nanogpt_style.py), a failed run exits 1 with its summary and the failed stage's reason
(test_run_state.py's exhausted recovery budget); its exit code mapping and its reading of the run's state are unit
tests (tests/unit/test_cli_conventions.py).
"""

from __future__ import annotations

import os
import subprocess

import pytest
from airflow_helpers import ROOT

pytestmark = pytest.mark.integration


def test_a_closed_stdout_ends_the_command_with_141_and_nothing_on_stderr() -> None:
    read, write = os.pipe()
    os.close(read)  # the reader (head) is gone before the first line
    try:
        done = subprocess.run(
            ["trainyard", "check", str(ROOT / "dags" / "pipelines")], stdout=write, stderr=subprocess.PIPE, timeout=120
        )
    finally:
        os.close(write)
    assert done.returncode == 141 and done.stderr == b""
