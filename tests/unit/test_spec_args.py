"""A script's command line as its author wrote it (issue 51, points 1-6 and 8): ``training.args`` in order with
positional items, ``args_form``, ``booleans``, templates, ``workdir``, ``resume_args`` and ``env``; what
``trainyard check`` refuses, naming the field; the order kept through the run's pinned spec."""

from __future__ import annotations

from pathlib import Path

import pytest

from trainyard.errors import SpecError
from trainyard.pipeline.command import attempt_command
from trainyard.pipeline.run import load_run, open_run
from trainyard.pipeline.train import _plan, _resume_target
from trainyard.recovery.state import Course
from trainyard.spec import load_spec
from trainyard.spec.args import command_line

SPEC = """\
runs_root: file://{root}/runs
dataset: {{source: "file:///data/tokens", name: tokens, hot: "file://{root}/hot"}}
checkpoint: {{hot: "file://{root}/ckpt"}}
nodes: {{count: 1}}
training:
  entrypoint: {entrypoint}
  max_steps: 10
  global_batch: 8
  micro_batch: 2
  checkpoint_every: 5
{training}
"""


def write(tmp_path: Path, training: str, entrypoint: str = "train.py") -> Path:
    path = tmp_path / "pipeline.yaml"
    path.write_text(SPEC.format(root=tmp_path, training=training, entrypoint=entrypoint))
    return path


def problems(tmp_path: Path, training: str) -> list[str]:
    try:
        load_spec(write(tmp_path, training))
    except SpecError as exc:
        return [p.split(": ", 1)[1] for p in exc.problems]
    return []


def argv(tmp_path: Path, training: str, resume: str = "none") -> list[str]:
    run = open_run(write(tmp_path, training), "dag", "manual__1", "2026-01-02")
    return attempt_command(run, 10, resume if resume != "none" else None).args


def same(_field: str, text: str) -> str:
    return text


# ---------------------------------------------------------------- 1, 2, 3: the command line


def test_a_list_passes_positional_items_as_is_and_mappings_in_the_chosen_form(tmp_path: Path) -> None:
    training = """\
  args: [config/train_tiny.py, {n_layer: 2, dropout: 0.0, out_dir: out}, --no-wandb]
  args_form: "--key=value"
"""
    assert argv(tmp_path, training) == [
        "config/train_tiny.py", "--n_layer=2", "--dropout=0.0", "--out_dir=out", "--no-wandb"
    ]  # fmt: skip


def test_the_default_form_is_two_words_and_a_list_is_its_items(tmp_path: Path) -> None:
    assert argv(tmp_path, "  args: {lr: 0.001, betas: [0.9, 0.95], name: x}") == [
        "--lr", "0.001", "--betas", "0.9", "0.95", "--name", "x"
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("booleans", "want"),
    [
        ("flag/--no-flag", ["--compile", "--no-bias"]),
        ("true/false", ["--compile", "true", "--bias", "false"]),
        ("True/False", ["--compile", "True", "--bias", "False"]),
        ("1/0", ["--compile", "1", "--bias", "0"]),
    ],
)
def test_a_boolean_is_written_as_the_script_parses_it_and_never_dropped(booleans: str, want: list[str]) -> None:
    assert command_line({"compile": True, "bias": False}, "--key value", booleans, same) == want  # type: ignore[arg-type]


def test_false_as_a_bare_flag_is_refused_naming_the_field_and_the_fix(tmp_path: Path) -> None:
    found = problems(tmp_path, "  args: {compile: false}")
    assert len(found) == 1 and found[0].startswith("training.args.compile: false cannot be written")
    assert "training.booleans to flag/--no-flag, true/false" in found[0]
    assert command_line({"compile": True}, "--key=value", "flag", same) == ["--compile"]


def test_the_old_key_trick_and_lists_in_one_word_are_refused_with_the_fix(tmp_path: Path) -> None:
    trick = problems(tmp_path, '  args: {"n_layer=2": true}')
    assert trick and "training.args.n_layer=2: not a flag's name" in trick[0] and "args_form" in trick[0]
    one_word = problems(tmp_path, '  args: [{betas: [0.9, 0.95]}]\n  args_form: "--key=value"')
    assert len(one_word) == 1 and one_word[0].startswith("training.args[0].betas: a list cannot be written")


def test_a_bad_item_names_its_place_in_the_list(tmp_path: Path) -> None:
    assert problems(tmp_path, "  args: [a.py, null]") == [
        "training.args[1]: null is not an item; write a string (passed as is) or a mapping (--key value)"
    ]


# ---------------------------------------------------------------- 5: templates


def test_templates_reach_the_script_rendered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("USER", "ada")
    training = """\
  args: ["{{ data_dir }}/meta.pkl", {out_dir: "{{ checkpoint_dir }}", tag: "${USER}-{{ ds_nodash }}"}]
  args_form: "--key=value"
  env: {WANDB_DIR: "{{ run_dir }}/wandb", STEPS: "{{ max_steps }}"}
"""
    run = open_run(write(tmp_path, training), "dag", "manual__1", "2026-01-02")
    command = attempt_command(run, 10, None)
    assert command.args == [
        f"{run.hot_dataset_dir}/meta.pkl", f"--out_dir={run.checkpoint_root}", "--tag=ada-20260102"
    ]  # fmt: skip
    assert command.env == {"WANDB_DIR": f"{run.dir}/wandb", "STEPS": "10"}


def test_check_refuses_unknown_names_and_unset_or_refused_variables_naming_the_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("USER", raising=False)
    training = """\
  args: [a, b, "{{ nope }}", {out_dir: "${USER}/out", key: "${AWS_SECRET_ACCESS_KEY}"}]
  resume_args: ["--ckpt={{ resume_from }}", "{{ resume_frm }}"]
  env: {FOO: "{{ resume_from }}"}
"""
    found = problems(tmp_path, training)
    assert [p.split(":")[0] for p in found] == [
        "training.args[2]", "training.args[3].out_dir", "training.args[3].key", "training.resume_args[1]",
        "training.env.FOO",
    ]  # fmt: skip
    assert "unknown template variable {{ nope }}" in found[0] and "environment variable USER is not set" in found[1]
    assert "is not an allowed variable" in found[2] and "{{ resume_from }}" in found[4]


def test_env_names_the_contract_sets_are_refused(tmp_path: Path) -> None:
    found = problems(tmp_path, '  env: {TRAINYARD_MAX_STEPS: "5", RANK: "0", "1X": a, WANDB_MODE: offline}')
    assert [p.split(":")[0] for p in found] == ["training.env.TRAINYARD_MAX_STEPS", "training.env.RANK",
                                                "training.env.1X"]  # fmt: skip


# ---------------------------------------------------------------- 4: the folder


def test_a_relative_workdir_and_entrypoint_are_the_spec_files_and_a_missing_one_is_refused(tmp_path: Path) -> None:
    (tmp_path / "repo").mkdir()
    spec = load_spec(write(tmp_path, "  workdir: repo"))
    assert (spec.training.workdir, spec.training.entrypoint) == (str(tmp_path / "repo"), str(tmp_path / "train.py"))
    assert problems(tmp_path, "  workdir: nowhere") == [
        f"training.workdir: {str(tmp_path / 'nowhere')!r} is not a folder on this machine; create it or fix the path"
    ]
    assert problems(tmp_path, '  workdir: "{{ run_dir }}/w"') == []  # checked when the attempt starts


def test_the_default_folder_is_the_scripts_or_the_runs(tmp_path: Path) -> None:
    run = open_run(write(tmp_path, ""), "dag", "manual__1", "2026-01-02")
    plan = _plan(run, 1, Course(["n0"], 2, "none"), 10)
    assert plan.workdir is None and plan.local_workdir() == tmp_path
    other = tmp_path / "module"
    other.mkdir()
    module = _plan(open_run(write(other, "", "my.module"), "d", "r", "2026-01-02"), 1, Course(["n0"], 2, "none"), 10)
    assert module.local_workdir() == module.log_dir.parent == other / "runs" / "d" / "r"


# ---------------------------------------------------------------- 6: resume args


def test_resume_args_join_only_an_attempt_that_resumes_from_a_checkpoint(tmp_path: Path) -> None:
    from trainyard.checkpoint import registry

    training = '  args: {n_layer: 2}\n  args_form: "--key=value"\n  resume_args: [--init_from=resume, "--ckpt={{ resume_from }}"]'
    run = open_run(write(tmp_path, training), "dag", "manual__1", "2026-01-02")
    fresh = _plan(run, 1, Course(["n0"], 2, "none"), 10)
    nothing_yet = _plan(run, 2, Course(["n0"], 2, "latest"), 10)
    assert fresh.args == nothing_yet.args == ["--n_layer=2"]
    ckpt = run.checkpoint_root / "step_000004"
    ckpt.mkdir(parents=True)
    registry.promote(run.checkpoint_root, ckpt, run.ledger)  # the ledger says what is latest, never LATEST
    relaunch = _plan(run, 3, Course(["n0"], 2, "latest"), 10)
    assert relaunch.args == ["--n_layer=2", "--init_from=resume", f"--ckpt={ckpt}"]
    assert _resume_target(run, Course(["n0"], 2, str(ckpt))) == str(ckpt)


def test_a_trigger_lr_reaches_the_named_argument_in_a_list(tmp_path: Path) -> None:
    training = "  args: [cfg.py, {lr: 0.1, n_layer: 2}]\nparams: [lr]"
    run = open_run(write(tmp_path, training), "dag", "manual__1", "2026-01-02", params={"lr": 0.5})
    assert run.spec.training.arg("lr") == 0.5
    assert attempt_command(run, 10, None).args == ["cfg.py", "--lr", "0.5", "--n_layer", "2"]


# ---------------------------------------------------------------- 8: the order


def test_the_order_written_survives_the_pinned_spec(tmp_path: Path) -> None:
    training = "  args: {zeta: 1, alpha: 2, mid: x}\n  env: {Z_VAR: z, A_VAR: a}"
    opened = open_run(write(tmp_path, training), "dag", "manual__1", "2026-01-02")
    pinned = load_run(opened.dir / "spec.json")
    assert attempt_command(pinned, 10, None).args == ["--zeta", "1", "--alpha", "2", "--mid", "x"]
    assert list(attempt_command(pinned, 10, None).env) == ["Z_VAR", "A_VAR"]
    assert pinned.spec == opened.spec
