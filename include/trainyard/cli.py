"""The ``trainyard`` command: check specs, write demo data, upload to and list S3, summarize, run and drill
pipelines, verify checkpoints, free a lineage. Its conventions (exit codes, ``-o json``) live in ``trainyard.clikit``."""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainyard import __version__
from trainyard.clikit import Exit, add_output, emit, existing, local_path, path_arg, run_command
from trainyard.clis3 import add_s3_options, s3_errors, s3_tier
from trainyard.errors import TrainyardError, UsageError
from trainyard.events.ledger import Ledger, safe_name
from trainyard.report.summary import format_summary, summarize
from trainyard.spec import review
from trainyard.spec.templating import HOME_VARIABLE


def cmd_check(args: argparse.Namespace) -> int:
    """Every error and warning of every file (a folder: its *.yaml files, checked together); exit 1 on any error."""
    from trainyard.spec.present import exit_code, render

    reports = review(args.files)
    print(render(reports, args.output))
    return exit_code(reports)


def cmd_schema(args: argparse.Namespace) -> int:
    """The spec's JSON Schema (``docs/spec.schema.json``), or its field reference (``docs/spec.md``)."""
    from trainyard.spec.schema import markdown_reference, schema_text

    sys.stdout.write(markdown_reference() if args.markdown else schema_text())
    return Exit.OK


def cmd_demo_data(args: argparse.Namespace) -> int:
    """Write the demo corpora into the cold tier: the nightly partition and the fine-tune set."""
    from trainyard.protocol.shards import write_synthetic_corpus

    cold = local_path(args.cold, "--cold")
    nightly_seed = zlib.crc32(args.date.encode())  # each night's partition holds new tokens
    written = []
    for folder, seed in ((cold / "tokens" / args.date, nightly_seed), (cold / "finetune", 1)):
        paths = write_synthetic_corpus(folder, shards=args.shards, seed=seed)
        written.append({"folder": str(folder), "shards": len(paths)})
    emit(args, {"written": written}, lambda: "\n".join(f"wrote {w['shards']} shards to {w['folder']}" for w in written))
    return Exit.OK


@s3_errors
def cmd_upload(args: argparse.Namespace) -> int:
    """Upload a file or folder to s3://bucket/prefix: parallel, verified, resumable."""
    from trainyard.storage.upload import progress_for, upload

    existing(args.src)
    tier = s3_tier(args)
    # With -o json stdout holds the one JSON document: progress goes to stderr.
    progress = progress_for(sys.stderr if args.output == "json" else sys.stdout)
    result = upload(args.src, tier, jobs=args.jobs, progress=progress)
    emit(args, {"dest": args.dest, **asdict(result)}, lambda: result.summary(args.dest))
    return Exit.OK


@s3_errors
def cmd_ls(args: argparse.Namespace) -> int:
    """One line per object under s3://bucket/prefix: size, whether it carries a sha256, key."""
    from trainyard.storage.upload import listing

    objects = listing(s3_tier(args), jobs=args.jobs)
    emit(
        args,
        [{"key": o.name, "size": o.size, "sha256": o.sha256} for o in objects],
        lambda: "\n".join(f"{o.size:>14}  {'sha256' if o.sha256 else '-':<6}  {o.name}" for o in objects),
    )
    return Exit.OK


def find_run(args: argparse.Namespace) -> Path:
    """The run folder given, else the latest run of ``--dag-id`` under ``--runs-root``; a ``UsageError`` if none."""
    if args.run_dir:
        run_dir = existing(args.run_dir, "run folder")
        if not (run_dir / "events.jsonl").is_file():
            raise UsageError(f"{run_dir}: not a run folder (it holds no events.jsonl); give one, or --dag-id")
        return run_dir
    runs = local_path(args.runs_root, "--runs-root") / safe_name(args.dag_id)
    candidates = sorted(
        (p for p in runs.glob("*") if (p / "events.jsonl").is_file()),
        key=lambda p: (p / "events.jsonl").stat().st_mtime,
    )
    if not candidates:
        unset = (
            f" ({HOME_VARIABLE} is not set: set it to your Airflow's)"
            if HOME_VARIABLE in args.runs_root and not os.environ.get(HOME_VARIABLE)
            else ""
        )
        raise UsageError(f"no runs of {args.dag_id} under {runs}{unset}")
    return candidates[-1]


def run_summary(run_dir: Path) -> dict[str, Any]:
    """A run's summary from its ledger, with where its folder and report are (what ``summary.json`` holds)."""
    summary = summarize(Ledger.in_dir(run_dir))
    report = run_dir / "report.html"
    return {"run_dir": str(run_dir), **summary, "report": str(report) if report.exists() else None}


def show_summary(args: argparse.Namespace, summary: dict[str, Any]) -> int:
    """Print a run's summary; exit 1 when a stage of the run failed."""
    emit(args, summary, lambda: f"run folder:         {summary['run_dir']}\n{format_summary(summary)}")
    failed = [name for name, s in summary["stages"].items() if not s["ok"]]
    return Exit.FAILED if failed else Exit.OK


def cmd_summary(args: argparse.Namespace) -> int:
    """Print a run's summary from its ledger."""
    return show_summary(args, run_summary(find_run(args)))


def cmd_run(args: argparse.Namespace) -> int:
    """Run a pipeline once through ``airflow dags test`` in the project's environment; exit by the run's state."""
    from trainyard.pipeline.dagtest import run_pipeline

    done = run_pipeline(existing(args.spec, "spec file"), args.date)
    print(f"airflow dags test {done.dag_id} {done.ds}: run {done.state}; its log: {done.log}", file=sys.stderr)
    if done.run_dir is None:
        emit(args, {"state": done.state, "run_dir": None}, lambda: f"run {done.state}; it left no run folder")
        return Exit.OK if done.state == "success" else Exit.FAILED
    code = show_summary(args, run_summary(done.run_dir))
    return Exit.OK if done.state == "success" else max(code, Exit.FAILED)


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    """Every check on one checkpoint; one reason per line, exit 1 when invalid."""
    from trainyard.checkpoint.validate import validate
    from trainyard.quality.metrics import MAX_LOSS_FIELD
    from trainyard.spec import MetricExpectations, load_spec

    existing(args.path, "checkpoint folder")
    expect = load_spec(existing(args.spec, "spec file")).checkpoint.expectations if args.spec else None
    if args.max_loss is not None:
        expect = (expect or MetricExpectations()).model_copy(update={"max_loss": args.max_loss})
    history = None
    if args.ledger:
        from trainyard.events.fold import TrainRun
        from trainyard.protocol.steps import loss_points

        ledger = Ledger(existing(args.ledger, "ledger file"))
        history = loss_points(TrainRun.of(ledger.events("train", "step")).steps)
    blame = "--max-loss" if args.max_loss is not None else MAX_LOSS_FIELD
    result = validate(args.path, expect, history, max_loss_from=blame)
    lines = [f"{args.path}: {problem}" for problem in result.problems]
    if result.valid:
        lines.append(f"{args.path}: valid (step {result.step}, {result.seconds:.2f} s)")
    emit(args, result.as_dict(), lambda: "\n".join(lines))
    return Exit.OK if result.valid else Exit.FAILED


def cmd_drill(args: argparse.Namespace) -> int:
    """Act out one fault in a real run of the spec and check the supervisor's answer."""
    from trainyard.pipeline.drill import run_drill
    from trainyard.spec import Drill

    drill = Drill(fault=args.fault, step=args.step, node=args.node, factor=args.factor)
    report = run_drill(existing(args.spec, "spec file"), drill, args.date)
    action, end = report.expected.action, report.expected.end
    # world_sizes is the timed series behind world_path; a None figure or reason is one the run has none of
    figures = {k: v for k, v in report.figures.items() if k not in ("failures", "world_sizes") and v is not None}
    data = {
        "fault": report.fault,
        "step": args.step,
        "node": args.node,
        "actions": report.actions,
        "end": report.end,
        "expected": {"action": action, "end": end, "because": report.expected.reason},
        "ok": report.ok,
        "refused": report.refused,
        "figures": figures,
        "run_dir": str(report.run_dir),
    }
    text = [
        f"drill {report.fault} at step {args.step}{' on ' + args.node if args.node else ''}: "
        f"actions {report.actions or ['none']}, run {report.end}",
        *(f"not acted out: {why}" for why in report.refused),
        f"expected: {action or 'no recovery needed'}, run {end} -> {'OK' if report.ok else 'UNEXPECTED'}",
        f"because: {report.expected.reason}",  # the policy's reason: the path (in place or relaunch) and why
        "recovery figures: " + ", ".join(f"{k} {v}" for k, v in figures.items()),
        f"run folder: {report.run_dir}",
    ]
    emit(args, data, lambda: "\n".join(text))
    return Exit.OK if report.ok else Exit.FAILED


def lineage_root(target: Path) -> Path:
    """A pipeline's checkpoint root: ``target`` itself if it is a folder, else from the spec file ``target``."""
    from trainyard.pipeline.run import Run
    from trainyard.spec import load_spec
    from trainyard.spec.templating import TEMPLATE

    if existing(target, "spec file or checkpoint folder").is_dir():
        return target
    spec = load_spec(target)
    if TEMPLATE.search(spec.checkpoint.hot):
        raise UsageError(
            f"{target}: checkpoint.hot ({spec.checkpoint.hot}) differs per run; pass the checkpoint folder itself"
        )
    return Run(spec=spec, spec_path=target, dag_id=spec.dag_id(target), run_id="", ds="").checkpoint_root


def cmd_lineage_release(args: argparse.Namespace) -> int:
    """Free a pipeline's checkpoint lineage: an expired claim at once, a live one only with ``--force``."""
    import time

    from trainyard.checkpoint import lease

    root = lineage_root(args.target)
    claim, now = lease.read_claim(root), time.time()
    out: dict[str, Any] = {"root": str(root), "released": False, "held_by": None}
    if claim is None:
        emit(args, out, lambda: f"{root}: no run holds this lineage")
        return Exit.OK
    held = "a damaged claim" if claim is lease.UNREADABLE else claim.describe(now)
    out["held_by"] = held
    if claim.expires > now and not args.force:
        _refused(args, out)
        raise TrainyardError(
            f"{root}: held by {held}; its lease is live (the run is renewing it). If that run is dead,"
            " mark it failed in Airflow or pass --force"
        )
    if not lease.force_release(root, claim):
        _refused(args, out)
        raise TrainyardError(f"{root}: the claim changed while we looked; run the command again")
    out["released"] = True
    emit(args, out, lambda: f"{root}: released; it was held by {held}")
    return Exit.OK


def _refused(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """A refused release: its JSON for a script (``released`` false); people read the reason on stderr."""
    if args.output == "json":
        emit(args, out, str)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainyard", description="Declarative distributed-training pipelines on Airflow.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}", help="print the version")
    sub = p.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate pipeline spec files (a folder: its *.yaml files, checked together)")
    check.add_argument("files", nargs="+", type=Path, help="spec files (*.yaml) or folders of them")
    add_output(check)  # json: one list, a row per file ({file, ok, errors, warnings})
    check.set_defaults(func=cmd_check)
    schema = sub.add_parser(
        "schema", help="print the spec's JSON Schema (for editors), or with --markdown its reference"
    )
    schema.add_argument("--markdown", action="store_true", help="the field reference (docs/spec.md) instead")
    schema.set_defaults(func=cmd_schema)
    demo = sub.add_parser("demo-data", help="write the synthetic demo corpora into the cold tier")
    demo.add_argument("--date", required=True, help="the nightly partition to write (YYYY-MM-DD)")
    demo.add_argument(
        "--cold", default="${TRAINYARD_HOME}/cold", help="the cold tier: a folder or file:// URI (default %(default)s)"
    )
    demo.add_argument("--shards", type=int, default=4, help="shards per corpus (default %(default)s)")
    demo.set_defaults(func=cmd_demo_data)
    run = sub.add_parser("run", help="run a pipeline once with airflow dags test (exit 0 the run succeeded, 1 not)")
    run.add_argument("spec", type=path_arg, help="the pipeline's spec file")
    run.add_argument("--date", help="the run's logical date, YYYY-MM-DD (default: today, UTC)")
    run.set_defaults(func=cmd_run)
    ckpt = sub.add_parser("ckpt", help="checkpoint tools").add_subparsers(dest="ckpt_command", required=True)
    verify = ckpt.add_parser("verify", help="validate a checkpoint folder (exit 0 valid, 1 not)")
    verify.add_argument("path", type=path_arg, help="the checkpoint folder (e.g. .../step_000060)")
    verify.add_argument("--spec", type=path_arg, help="take checkpoint.expectations from this pipeline spec")
    verify.add_argument("--max-loss", type=float, help="the checkpoint's loss must not exceed this")
    verify.add_argument("--ledger", type=path_arg, help="a run's events.jsonl, for the loss-history checks")
    verify.set_defaults(func=cmd_ckpt_verify)
    drill = sub.add_parser("drill", help="act out a fault in a real run and check the recovery")
    drill.add_argument("spec", type=path_arg, help="the pipeline's spec file (its checkpoints are not touched)")
    drill.add_argument(
        "--fault",
        required=True,
        choices=["kill", "hang", "slow", "corrupt_checkpoint", "nan", "oom", "exception", "preempt"],
        help="the fault to act out",
    )
    drill.add_argument("--step", type=int, required=True, help="the training step at which it happens")
    drill.add_argument("--node", help="the node that acts it out (default: every node / node-0)")
    drill.add_argument("--factor", type=float, default=1.0, help="slow: extra time per step, x the step time")
    drill.add_argument("--date", help="the logical date ({{ ds }}) of the drilled run (default: today)")
    drill.set_defaults(func=cmd_drill)
    up = sub.add_parser(
        "upload", help="upload a file or folder to s3://bucket/prefix (parallel, sha256-verified, resumable)"
    )
    up.add_argument("src", type=path_arg, help="a file (uploaded under its name) or a folder (its files, recursively)")
    up.add_argument("dest", help="s3://bucket/prefix")
    up.set_defaults(func=cmd_upload)
    ls = sub.add_parser("ls", help="list the objects under s3://bucket/prefix (size, sha256 or -, key)")
    ls.add_argument("dest", help="s3://bucket or s3://bucket/prefix")
    ls.set_defaults(func=cmd_ls)
    summary = sub.add_parser("summary", help="print the summary of a run (exit 0 it succeeded, 1 a stage failed)")
    summary.add_argument("run_dir", nargs="?", type=path_arg, help="a run folder (default: the latest run of --dag-id)")
    summary.add_argument("--dag-id", help="the pipeline whose latest run to summarize")
    summary.add_argument(
        "--runs-root",
        default="${TRAINYARD_HOME}/runs",
        help="where runs keep their folders: a folder or file:// URI, as the spec's runs_root (default %(default)s)",
    )
    summary.add_argument("--latest", action="store_true", help="the most recent run of --dag-id (the default)")
    summary.set_defaults(func=cmd_summary)
    lineage = sub.add_parser("lineage", help="a pipeline's checkpoint lineage").add_subparsers(
        dest="lineage_command", required=True
    )
    release = lineage.add_parser("release", help="free the lineage a dead run still holds (prints who held it)")
    release.add_argument("target", type=path_arg, help="the pipeline's spec file, or its checkpoint folder")
    release.add_argument("--force", action="store_true", help="free it even though its holder renewed it recently")
    release.set_defaults(func=cmd_lineage_release)
    for s3_command in (up, ls):
        add_s3_options(s3_command)
    for reporting in (demo, run, verify, drill, up, ls, summary, release):
        add_output(reporting)
    return p


def project_home() -> None:
    """Without ``TRAINYARD_HOME``, a checkout's ``.trainyard`` (where ``make demo`` keeps its tiers and runs: the
    Makefile sets the variable for Airflow) is the home of a command run in that checkout, not ``~/.trainyard``."""
    if not os.environ.get(HOME_VARIABLE) and (local := Path.cwd() / ".trainyard").is_dir():
        os.environ[HOME_VARIABLE] = str(local)


def main(argv: list[str] | None = None) -> int:
    """The exit code (README, "Exit codes"): 0 ok, 1 what was checked failed, 2 usage, 3 infrastructure."""
    args = parser().parse_args(argv)
    project_home()
    if args.command == "summary" and not (args.run_dir or args.dag_id):
        parser().error("summary needs a run folder or --dag-id")
    command = " ".join(
        filter(None, (args.command, getattr(args, "ckpt_command", None), getattr(args, "lineage_command", None)))
    )
    return run_command(command, lambda: int(args.func(args)))


if __name__ == "__main__":
    sys.exit(main())
