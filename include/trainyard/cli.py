"""The ``trainyard`` command: check specs, write demo data, upload to and list S3, summarize runs, free a lineage."""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainyard.errors import TrainyardError
from trainyard.events.ledger import Ledger, safe_name
from trainyard.report.summary import format_summary, summarize
from trainyard.spec import review
from trainyard.spec.templating import HOME_VARIABLE, render

if TYPE_CHECKING:
    from trainyard.storage.s3 import S3Tier


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
    return 0


def cmd_demo_data(args: argparse.Namespace) -> int:
    """Write the demo corpora into the cold tier: the nightly partition and the fine-tune set."""
    from trainyard.protocol.shards import write_synthetic_corpus

    cold = Path(render(args.cold, {}))
    nightly_seed = zlib.crc32(args.date.encode())  # each night's partition holds new tokens
    for folder, seed in ((cold / "tokens" / args.date, nightly_seed), (cold / "finetune", 1)):
        paths = write_synthetic_corpus(folder, shards=args.shards, seed=seed)
        print(f"wrote {len(paths)} shards to {folder}")
    return 0


# What ``upload`` and ``ls`` turn into one line and exit code 2 (a bad argument, no bucket, no credentials, no
# network): the user fixes something and runs again; a traceback would only hide the one line that says what.
USAGE_ERROR = 2


def _s3_tier(uri: str, endpoint_url: str | None) -> S3Tier:
    from trainyard.storage.s3 import S3Tier
    from trainyard.storage.s3auth import S3Settings
    from trainyard.storage.upload import split_s3_uri

    split_s3_uri(uri)
    settings = S3Settings.from_env(endpoint_url)
    settings.credentials.retrieve()  # now, so that missing credentials are one line before any transfer
    tier = S3Tier(uri, settings)
    if not tier.client.bucket_exists(tier.bucket):
        raise TrainyardError(f"{uri}: bucket {tier.bucket!r} does not exist at {settings.endpoint}; create it first")
    return tier


def _s3_errors(fn: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Errors of an S3 command as one line on stderr and exit code 2; never a traceback, never a secret."""
    import functools

    @functools.wraps(fn)
    def wrapped(args: argparse.Namespace) -> int:
        import urllib3
        from minio.error import MinioException

        from trainyard.storage.s3auth import redact

        try:
            return fn(args)
        except TrainyardError as exc:
            message = str(exc)
        except (MinioException, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
            message = f"{args.dest}: {type(exc).__name__}: {redact(exc)}"
        print(f"trainyard {args.command}: {message}", file=sys.stderr)
        return USAGE_ERROR

    return wrapped


@_s3_errors
def cmd_upload(args: argparse.Namespace) -> int:
    """Upload a file or folder to s3://bucket/prefix: parallel, verified, resumable."""
    from trainyard.storage.upload import progress_for, upload

    if not args.src.exists():
        raise TrainyardError(f"{args.src}: no such file or folder")
    tier = _s3_tier(args.dest, args.endpoint_url)
    result = upload(args.src, tier, jobs=args.jobs, progress=progress_for(sys.stdout))
    print(result.summary(args.dest))
    return 0


@_s3_errors
def cmd_ls(args: argparse.Namespace) -> int:
    """One line per object under s3://bucket/prefix: size, whether it carries a sha256, key."""
    from trainyard.storage.upload import listing

    tier = _s3_tier(args.dest, args.endpoint_url)
    for o in listing(tier, jobs=args.jobs):
        print(f"{o.size:>14}  {'sha256' if o.sha256 else '-':<6}  {o.name}")
    return 0


def cmd_summary(args: argparse.Namespace) -> int:
    """Print a run's summary from its ledger."""
    if args.run_dir:
        run_dir = Path(args.run_dir)
    else:
        runs = Path(render(args.runs_root, {})) / safe_name(args.dag_id)
        candidates = sorted(
            (p for p in runs.glob("*") if (p / "events.jsonl").exists()),
            key=lambda p: (p / "events.jsonl").stat().st_mtime,
        )
        if not candidates:
            unset = "" if os.environ.get(HOME_VARIABLE) else f" ({HOME_VARIABLE} is not set: set it to your Airflow's)"
            print(f"no runs of {args.dag_id} under {runs}{unset}", file=sys.stderr)
            return 1
        run_dir = candidates[-1]
    summary = summarize(Ledger.in_dir(run_dir))
    report = run_dir / "report.html"
    summary["report"] = str(report) if report.exists() else None
    print(f"run folder:         {run_dir}")
    print(format_summary(summary))
    failed = [name for name, s in summary["stages"].items() if not s["ok"]]
    return 1 if failed else 0


def cmd_ckpt_verify(args: argparse.Namespace) -> int:
    """Every check on one checkpoint; one reason per line, exit 1 when invalid."""
    from trainyard.checkpoint.validate import validate
    from trainyard.spec import MetricExpectations, load_spec

    expect = load_spec(args.spec).checkpoint.expectations if args.spec else None
    if args.max_loss is not None:
        expect = (expect or MetricExpectations()).model_copy(update={"max_loss": args.max_loss})
    history = None
    if args.ledger:
        from trainyard.events.fold import TrainRun
        from trainyard.protocol.steps import loss_points

        history = loss_points(TrainRun.of(Ledger(args.ledger).events("train", "step")).steps)
    result = validate(args.path, expect, history)
    for problem in result.problems:
        print(f"{args.path}: {problem}")
    if result.valid:
        print(f"{args.path}: valid (step {result.step}, {result.seconds:.2f} s)")
    return 0 if result.valid else 1


def cmd_drill(args: argparse.Namespace) -> int:
    """Act out one fault in a real run of the spec and check the supervisor's answer."""
    from trainyard.pipeline.drill import run_drill
    from trainyard.spec import Drill

    drill = Drill(fault=args.fault, step=args.step, node=args.node, factor=args.factor)
    report = run_drill(args.spec, drill, args.date)
    action, end = report.expected.action, report.expected.end
    print(
        f"drill {report.fault} at step {args.step}{' on ' + args.node if args.node else ''}: "
        f"actions {report.actions or ['none']}, run {report.end}"
    )
    for why in report.refused:
        print(f"not acted out: {why}")
    print(f"expected: {action or 'no recovery needed'}, run {end} -> {'OK' if report.ok else 'UNEXPECTED'}")
    print(f"because: {report.expected.reason}")  # the policy's reason: the path (in place or relaunch) and why
    # world_sizes is the timed series behind world_path; a None figure or reason is one the run has none of
    figures = {k: v for k, v in report.figures.items() if k not in ("failures", "world_sizes") and v is not None}
    print("recovery figures: " + ", ".join(f"{k} {v}" for k, v in figures.items()))
    print(f"run folder: {report.run_dir}")
    return 0 if report.ok else 1


def lineage_root(target: Path) -> Path:
    """A pipeline's checkpoint root: ``target`` itself if it is a folder, else from the spec file ``target``."""
    from trainyard.pipeline.run import Run
    from trainyard.spec import load_spec
    from trainyard.spec.templating import TEMPLATE

    if target.is_dir():
        return target
    spec = load_spec(target)
    if TEMPLATE.search(spec.checkpoint.hot):
        raise TrainyardError(
            f"{target}: checkpoint.hot ({spec.checkpoint.hot}) differs per run; pass the checkpoint folder itself"
        )
    return Run(spec=spec, spec_path=target, dag_id=spec.dag_id(target), run_id="", ds="").checkpoint_root


def cmd_lineage_release(args: argparse.Namespace) -> int:
    """Free a pipeline's checkpoint lineage: an expired claim at once, a live one only with ``--force``."""
    import time

    from trainyard.checkpoint import lease

    root = lineage_root(args.target)
    claim, now = lease.read_claim(root), time.time()
    if claim is None:
        print(f"{root}: no run holds this lineage")
        return 0
    held = "a damaged claim" if claim is lease.UNREADABLE else claim.describe(now)
    if claim.expires > now and not args.force:
        print(
            f"{root}: held by {held}; its lease is live (the run is renewing it). If that run is dead,"
            " mark it failed in Airflow or pass --force",
            file=sys.stderr,
        )
        return 1
    if not lease.force_release(root, claim):
        print(f"{root}: the claim changed while we looked; run the command again", file=sys.stderr)
        return 1
    print(f"{root}: released; it was held by {held}")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trainyard", description="Declarative distributed-training pipelines on Airflow.")
    sub = p.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate pipeline spec files (a folder: its *.yaml files, checked together)")
    check.add_argument("files", nargs="+", type=Path)
    check.add_argument("-o", "--output", choices=["text", "json"], default="text", help="text lines or one JSON list")
    check.set_defaults(func=cmd_check)
    schema = sub.add_parser(
        "schema", help="print the spec's JSON Schema (for editors), or with --markdown its reference"
    )
    schema.add_argument("--markdown", action="store_true", help="the field reference (docs/spec.md) instead")
    schema.set_defaults(func=cmd_schema)
    demo = sub.add_parser("demo-data", help="write the synthetic demo corpora into the cold tier")
    demo.add_argument("--date", required=True, help="the nightly partition to write (YYYY-MM-DD)")
    demo.add_argument("--cold", default="${TRAINYARD_HOME}/cold")
    demo.add_argument("--shards", type=int, default=4)
    demo.set_defaults(func=cmd_demo_data)
    ckpt = sub.add_parser("ckpt", help="checkpoint tools").add_subparsers(dest="ckpt_command", required=True)
    verify = ckpt.add_parser("verify", help="validate a checkpoint folder (exit 0 valid, 1 not)")
    verify.add_argument("path", type=Path)
    verify.add_argument("--spec", type=Path, help="take checkpoint.expectations from this pipeline spec")
    verify.add_argument("--max-loss", type=float, help="the checkpoint's loss must not exceed this")
    verify.add_argument("--ledger", type=Path, help="a run's events.jsonl, for the loss-history checks")
    verify.set_defaults(func=cmd_ckpt_verify)
    drill = sub.add_parser("drill", help="act out a fault in a real run and check the recovery")
    drill.add_argument("spec", type=Path)
    drill.add_argument(
        "--fault",
        required=True,
        choices=["kill", "hang", "slow", "corrupt_checkpoint", "nan", "oom", "exception", "preempt"],
    )
    drill.add_argument("--step", type=int, required=True)
    drill.add_argument("--node", help="the node that acts it out (default: every node / node-0)")
    drill.add_argument("--factor", type=float, default=1.0, help="slow: extra time per step, x the step time")
    drill.add_argument("--date", help="the logical date ({{ ds }}) of the drilled run (default: today)")
    drill.set_defaults(func=cmd_drill)
    up = sub.add_parser(
        "upload", help="upload a file or folder to s3://bucket/prefix (parallel, sha256-verified, resumable)"
    )
    up.add_argument("src", type=Path, help="a file (uploaded under its name) or a folder (its files, recursively)")
    up.add_argument("dest", help="s3://bucket/prefix")
    ls = sub.add_parser("ls", help="list the objects under s3://bucket/prefix (size, sha256 or -, key)")
    ls.add_argument("dest", help="s3://bucket or s3://bucket/prefix")
    for s3_command, run in ((up, cmd_upload), (ls, cmd_ls)):
        s3_command.add_argument("--jobs", type=int, default=8, help="objects at once (default 8)")
        s3_command.add_argument(
            "--endpoint-url",
            help="the S3 API, e.g. http://127.0.0.1:9000 (default: AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, else AWS)",
        )
        s3_command.set_defaults(func=run)
    summary = sub.add_parser("summary", help="print the summary of a run")
    summary.add_argument("run_dir", nargs="?", help="a run folder (default: the latest run of --dag-id)")
    summary.add_argument("--dag-id")
    summary.add_argument("--runs-root", default="${TRAINYARD_HOME}/runs")
    summary.add_argument("--latest", action="store_true", help="the most recent run of --dag-id (the default)")
    summary.set_defaults(func=cmd_summary)
    lineage = sub.add_parser("lineage", help="a pipeline's checkpoint lineage").add_subparsers(
        dest="lineage_command", required=True
    )
    release = lineage.add_parser("release", help="free the lineage a dead run still holds (prints who held it)")
    release.add_argument("target", type=Path, help="the pipeline's spec file, or its checkpoint folder")
    release.add_argument("--force", action="store_true", help="free it even though its holder renewed it recently")
    release.set_defaults(func=cmd_lineage_release)
    return p


def project_home() -> None:
    """Without ``TRAINYARD_HOME``, a checkout's ``.trainyard`` (where ``make demo`` keeps its tiers and runs: the
    Makefile sets the variable for Airflow) is the home of a command run in that checkout, not ``~/.trainyard``."""
    if not os.environ.get(HOME_VARIABLE) and (local := Path.cwd() / ".trainyard").is_dir():
        os.environ[HOME_VARIABLE] = str(local)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    project_home()
    if args.command == "summary" and not (args.run_dir or args.dag_id):
        parser().error("summary needs a run folder or --dag-id")
    try:
        return args.func(args)
    except TrainyardError as exc:
        print(f"trainyard: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
