"""A public-style training script as its author wrote it, unmodified, under a real ``airflow dags test`` run on 2
local nodes (issue 51): nanoGPT's shape (``tests/integration/scripts/nanogpt_style``) — a configurator it execs
from the folder it runs in, a config file path and ``--key=value`` overrides, its data and ``meta.pkl`` read
from ``data/<dataset>``, one ``ckpt.pt`` it overwrites with ``iter_num``, resume only with ``--init_from=resume``,
a line per iteration on stdout, and no trainyard import.

The spec alone makes it run: args in order with a positional item and ``--key=value``/``True/False`` rendering,
templates naming trainyard's folders, the script's folder as the working folder (the default), its resume flag
on a relaunch, its ``ckpt.pt`` adopted at each save (the step from ``iter_num``), ``meta.pkl`` staged beside the
token arrays, and the figures read from its log. node-1 is killed mid-run: the relaunch resumes from the script's
own file at the step it saved last, and the summary and the report give steps trained, lost steps and the resume
delay as numbers.

It runs through ``trainyard run SPEC --date D -o json`` (one real ``airflow dags test`` in the project's environment,
the DAGs folder made by the command): a run that succeeded exits 0 and prints its summary as JSON. A failed run's
exit 1 is in test_run_state.py.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from airflow_helpers import ROOT, airflow_env, run_folder, run_state, task_states

from trainyard.events.ledger import Ledger

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "scripts" / "nanogpt_style"
BASE = yaml.safe_load((ROOT / "dags" / "pipelines" / "nightly_pretrain.yaml").read_text())
DAG_ID = "nanogpt_style"
DATE = "2026-12-06"
STEPS, EVERY, KILL = 60, 20, 30  # the script saves at each eval (every EVERY iterations); node-1 dies at KILL


def spec(cold: Path) -> str:
    spec = copy.deepcopy(BASE)
    spec.pop("schedule")
    spec["pressure_test"] = {"enabled": False}
    spec["dataset"] = {
        "source": f"file://{cold}",
        "name": "tiny_char",
        "format": "numpy",
        "dtype": "uint16",
        "files": [{"name": "meta.pkl"}],
        "expectations": {"min_shards": 2, "min_tokens_per_shard": 1000, "max_vocab": 256},
    }
    spec["training"] = {
        "entrypoint": str(SCRIPT / "train.py"),
        # As its README runs it: a config file, then overrides; the data folder and out_dir are trainyard's.
        "args": [
            "config/train_tiny.py",
            {
                "compile": False,
                "dataset": "{{ data_dir }}",
                "out_dir": "{{ checkpoint_dir }}",
                "max_iters": "{{ max_steps }}",
                "lr_decay_iters": "{{ max_steps }}",
                "eval_interval": EVERY,
                # Big enough that a save stays put for a few of the watcher's looks (~0.1 s an iteration).
                "n_embd": 128,
                "n_layer": 4,
                "block_size": 64,
                "batch_size": 16,
            },
        ],
        "args_form": "--key=value",
        "booleans": "True/False",
        "resume_args": ["--init_from=resume"],
        "max_steps": STEPS,
        "checkpoint_every": EVERY,
        "global_batch": 8,
        "micro_batch": 2,
        "heartbeat_timeout_s": 60,
        "progress_every_s": 0,
    }
    spec["checkpoint"]["expectations"] = {"max_loss": 10.0}
    spec["recovery"]["backoff_s"] = 0.5
    spec["drills"] = [{"fault": "kill", "step": KILL, "node": "node-1"}]
    return yaml.safe_dump(spec, sort_keys=False)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("nanogpt")
    cold = home / "cold" / "tiny_char"
    subprocess.run([sys.executable, str(SCRIPT / "prepare.py"), str(cold)], check=True, timeout=60)
    (home / "specs").mkdir()
    (home / "specs" / f"{DAG_ID}.yaml").write_text(spec(cold))
    return home


def test_a_nanogpt_style_script_runs_unmodified_and_resumes_from_its_own_ckpt(home: Path) -> None:
    spec_file = home / "specs" / f"{DAG_ID}.yaml"
    env = airflow_env(home)
    del env["AIRFLOW__CORE__DAGS_FOLDER"]  # trainyard run makes the DAGs folder of the spec itself
    check = subprocess.run(["trainyard", "check", str(spec_file)], env=env, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    done = subprocess.run(
        ["trainyard", "run", f"file://{spec_file}", "--date", DATE, "-o", "json"],
        env=env, cwd=home, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    log = Path(env["TRAINYARD_HOME"]) / "dags-test" / f"{DAG_ID}_{DATE}.log"  # what airflow dags test printed
    out = log.read_text(errors="replace") if log.exists() else f"(no {log})"
    states = {t: s for t, (s, _) in task_states(env, DAG_ID, DATE).items()}
    run = run_folder(env, DAG_ID, DATE)
    assert run_state(env, DAG_ID, DATE) == "success", (states, done.stderr[-2000:], out[-4000:])
    # It exits by the DAG run's state as Airflow records it (``dags test`` itself exits 0 either way), naming its
    # log, and prints the run's summary as JSON.
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"airflow dags test {DAG_ID} {DATE}: run success; its log: {log}" in done.stderr
    assert "Traceback" not in done.stderr
    printed = json.loads(done.stdout)
    assert printed["run_dir"] == str(run) and run.parent == Path(env["TRAINYARD_HOME"]) / "runs" / DAG_ID
    assert printed["state"] == "succeeded" and all(s["ok"] for s in printed["stages"].values()), printed["stages"]
    assert printed["report"] == str(run / "report.html")
    ledger = Ledger.in_dir(run)

    # Its vocabulary was staged beside the token arrays, so it built the small model, not GPT-2's 50304.
    first_log = (run / "attempt-1" / "node-0.log").read_text()
    assert "found vocab_size = " in first_log and "defaulting to vocab_size of GPT-2" not in first_log
    # The first attempt started fresh (no resume flag); the relaunch told it to resume.
    assert "Resuming training" not in first_log
    second_log = (run / "attempt-2" / "node-0.log").read_text()
    assert "Resuming training from" in second_log, second_log[-2000:]

    # Once its log shows a step, its progress line is the log's (before, it starts up: no step known).
    lines = [line.split("progress: ", 1)[1] for line in out.splitlines() if "progress: attempt 1," in line]
    first = next(i for i, line in enumerate(lines) if f"/{STEPS} (from the log)" in line)
    assert not [line for line in lines[first:] if "no heartbeats" in line], lines[first:]

    [fired] = ledger.events("train", "drill_fired")
    assert fired["fault"] == "kill" and fired["node"] == "node-1"
    # It resumed from its own ckpt.pt, adopted at each save at the step its iter_num says (a copy per save: the
    # next overwrite does not change it), put back where it reads it, at the last save before the kill.
    adopted = list(ledger.events("train", "checkpoint_adopted"))
    assert all(e["framework"] == "torch" and e["source"] == "ckpt.pt" for e in adopted), adopted
    saved = [e["step"] for e in adopted]
    assert saved == list(range(EVERY, STEPS + 1, EVERY)), saved
    first, second = ledger.events("train", "attempt_start")
    resumed_at = max(s for s in saved if s <= fired["step"])
    assert first["resume_from"] == "none" and second["resume_step"] == resumed_at, (first, second)
    assert _iters(second_log)[0].startswith(f"{resumed_at}:"), second_log[-2000:]

    # The gate passed on its file.
    [checked] = ledger.events("check_checkpoint", "checkpoint_checked")
    assert checked.get("valid") is not False, checked
    [gate] = ledger.events("check_checkpoint", "stage_end")
    assert gate["result"]["step"] == STEPS, gate

    # Figures from its log, as numbers: every step trained, the steps lost to the kill, the resume delay.
    summary = json.loads((run / "summary.json").read_text())
    # nanoGPT trains iterations 0 to max_iters: one more than max_iters.
    assert summary["steps_trained"] == STEPS + 1, summary
    figures = summary["recovery"]
    # Lost: from the save it resumed at to the furthest step attempt 1's log showed, which is at least the drill's
    # step (the ranks may train a step or two more between the look that fired it and the kill landing).
    reached = max(e["step"] for e in ledger.events("train", "step") if e.get("attempt") == 1)
    assert fired["step"] - resumed_at <= figures["lost_steps"] <= reached - resumed_at, (figures, fired, reached)
    assert isinstance(figures["resume_delay_s"], float) and figures["resume_delay_s"] > 0, figures
    assert 0 < figures["ettr"] < 1, figures
    assert printed["steps_trained"] == STEPS + 1 and printed["recovery"]["lost_steps"] == figures["lost_steps"]
    text = subprocess.run(["trainyard", "summary", str(run)], env=env, capture_output=True, text=True, timeout=120)
    assert f"steps trained:    {STEPS + 1}" in text.stdout, text.stdout
    assert f"lost steps {figures['lost_steps']}" in text.stdout, text.stdout
    html = (run / "report.html").read_text()
    assert f"{STEPS + 1} steps trained" in html, html[:3000]


def _iters(log: str) -> list[str]:
    """The numbers after 'iter ' in the script's own lines."""
    return [line.split("iter ", 1)[1] for line in log.splitlines() if line.startswith("iter ")]
