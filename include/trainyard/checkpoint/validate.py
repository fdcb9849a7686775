"""Deep validation of one checkpoint: whole, loadable, finite, consistent, and good enough.

``format.verify`` proves the bytes are the ones the manifest lists (parallel
sha256). This module adds what only loading can tell: the DCP metadata reads,
every tensor loads on CPU and is finite, the rank files agree with the
manifest's world size, the step moves forward, and the metrics meet the
spec. One reason per problem; an empty list means valid.

Loading interprets bytes that training code wrote (untrusted: docs/architecture.md, untrusted input),
so it never happens in this process, which may hold the worker's secrets: a
child (``trainyard.checkpoint.tensors``, a fresh fork of one server per
process for each checkpoint) does it with an allow-list environment, no file
writes, a time limit, and answers in JSON. The server leads its own process
group: stopping it kills its forks too (which also die with it, and run under
CPU and memory limits of their own). This module imports no torch.

The bytes checked are the bytes hashed: each file a check interprets (the
child's DCP and torch.save files, this process's safetensors) is read once by
that check, which hashes what it reads (``readonce``); those digests, not a
second read here, are compared with the manifest (``format.digest_problems``).
Every other listed file is hashed here. Problems and notes name files and
tensors a rank chose: they pass through ``text.printable``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trainyard
from trainyard.atomic import loads_untrusted
from trainyard.checkpoint import foreign, frameworks, safetensor
from trainyard.checkpoint.format import digest_problems, read_manifest, verify
from trainyard.errors import CheckpointInvalid
from trainyard.quality.metrics import MAX_LOSS_FIELD, History, metric_problems
from trainyard.spec import MetricExpectations
from trainyard.text import printable

_RANK_FILE = re.compile(r"__(\d+)_\d+\.distcp\Z")
PROBLEM_CHARS = 1000
CHILD = "trainyard.checkpoint.tensors"
CHILD_TIMEOUT_S = 1800.0
# What the child may inherit: where programs and libraries are, locale, thread counts. Nothing else:
# never AIRFLOW__* (Fernet key, JWT secret, database URL), AWS_*, connections or tokens.
CHILD_ENV = (
    "PATH",
    "LANG",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "LD_LIBRARY_PATH",
)


@dataclass(frozen=True)
class Validation:
    path: Path
    step: int | None
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    """Files accepted without inspecting their tensors (a framework's pickled RNG state, its arguments)."""

    @property
    def valid(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "step": self.step,
            "valid": self.valid,
            "problems": self.problems,
            "seconds": self.seconds,
            **({"notes": self.notes} if self.notes else {}),
        }


def child_env(parent: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the inspecting child: the allow-list, trainyard importable, no GPU, no bytecode writes."""
    parent = dict(os.environ) if parent is None else parent
    env = {k: parent[k] for k in CHILD_ENV if k in parent}
    here = str(Path(trainyard.__file__).resolve().parents[1])  # the folder that holds this trainyard
    paths = [here, *(p for p in parent.get("PYTHONPATH", "").split(os.pathsep) if p and p != here)]
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONDONTWRITEBYTECODE="1", CUDA_VISIBLE_DEVICES="")
    return env


def child_command() -> list[str]:
    # -P (3.11+): the working directory never lands on sys.path, so no planted module is imported; before
    # 3.11 the child's working directory, "/", is what lands there.
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", CHILD, "--serve"]


class Inspector:
    """This process's inspection server (``tensors --serve``): torch is imported once, not once per checkpoint.

    The server forks a fresh process per checkpoint and reads none itself, so a
    checkpoint can influence only its own answer. One request at a time; a
    server that dies, hangs past the time limit or answers with anything but
    JSON is stopped, its answer is a problem (never a pass), and the next
    request starts a new one.
    """

    def __init__(self, argv: list[str] | None = None):
        self.argv = argv
        self.proc: subprocess.Popen[bytes] | None = None
        self.lock = threading.Lock()
        self.last: dict[str, Any] = {}
        """The last answer whole: its ``notes`` (framework saves) and ``step`` (a step request)."""

    def problems(
        self, ckpt_dir: Path, timeout_s: float = CHILD_TIMEOUT_S, fmt: str | None = None, files: list[str] | None = None
    ) -> list[str]:
        with self.asking(ckpt_dir, timeout_s, fmt, files) as answer:
            return answer()

    def step_of(self, file: Path, timeout_s: float = 300.0, key: str | None = None) -> int | None:
        """The step a framework's torch.save file (or a folder of them) holds (``key``, the spec's
        ``checkpoint.step_key``, else the first of ``frameworks.STEP_KEYS``), read weights-only by the child:
        never unpickled here."""
        with self.asking(file, timeout_s, "step", key=key) as answer:
            if answer():
                return None
            step = self.last.get("step")
            return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None

    @contextmanager
    def asking(
        self,
        ckpt_dir: Path,
        timeout_s: float = CHILD_TIMEOUT_S,
        fmt: str | None = None,
        files: list[str] | None = None,
        key: str | None = None,
    ) -> Iterator[Callable[[], list[str]]]:
        """Send ``ckpt_dir`` now, take the answer when called: the caller hashes while the child loads.

        ``fmt``: an adopted save's framework (``checkpoint.foreign``), or "step"; None: a DCP folder.
        ``files``: the listed files the child reads and hashes (its digests: ``last["digests"]``).
        An answer not taken is still read before the next request, so each request reads its own.
        """
        with self.lock:
            failed = self._send(ckpt_dir, fmt, files, key)
            taken = False

            def answer() -> list[str]:
                nonlocal taken
                taken = True
                return failed or self._receive(timeout_s)

            try:
                yield answer
            finally:
                if not taken and not failed:
                    self._receive(timeout_s)

    def start(self) -> None:
        """Start the server (torch imports in the background) before the first checkpoint needs it."""
        with self.lock:
            try:
                self._running()
            except OSError:
                pass  # the first request says why

    def _send(
        self, ckpt_dir: Path, fmt: str | None = None, files: list[str] | None = None, key: str | None = None
    ) -> list[str]:
        self.last = {}
        path = str(ckpt_dir.resolve())
        asked = fmt or files is not None or path.startswith("{")
        line = json.dumps({"path": path, "format": fmt, "files": files, "key": key}) if asked else path
        try:
            proc = self._running()
            assert proc.stdin is not None
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
            return []
        except OSError as exc:
            self.stop()
            return [f"the process inspecting the tensors failed: {exc}"]

    def _receive(self, timeout_s: float) -> list[str]:
        assert self.proc is not None
        try:
            line = self._line(self.proc, timeout_s)
        except (OSError, TimeoutError) as exc:
            self.stop()
            return [f"the process inspecting the tensors failed: {exc}"]
        try:
            answer = loads_untrusted(line, "the inspector's answer")  # it read the rank's bytes: trusted no more
        except ValueError:
            answer = None
        if isinstance(answer, dict) and isinstance(answer.get("problems"), list):
            notes, digests = answer.get("notes"), answer.get("digests")
            self.last = {
                "step": answer.get("step"),
                "notes": [printable(n, PROBLEM_CHARS) for n in notes[:100]] if isinstance(notes, list) else [],
                "digests": {str(k): v for k, v in digests.items() if isinstance(v, list)}
                if isinstance(digests, dict)
                else {},
            }
            return [printable(p, PROBLEM_CHARS) for p in answer["problems"]]
        self.stop()
        return [f"the process inspecting the tensors failed: it answered {line[:200]!r}, not JSON"]

    def _running(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                self.argv or child_command(),
                env=child_env(),
                cwd="/",
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                start_new_session=True,  # a process group of its own: its forks are stopped with it
            )
        return self.proc

    @staticmethod
    def _line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
        """One answer line; raw reads, so ``select`` sees every byte that is not yet consumed."""
        assert proc.stdout is not None
        fd, data, deadline = proc.stdout.fileno(), b"", time.monotonic() + timeout_s
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"no answer within {timeout_s:.0f} s; it was stopped")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise OSError(f"it ended (exit {proc.wait()}) without an answer")
            data += chunk
        return data.decode("utf-8", "replace").strip()

    def stop(self) -> None:
        """Kill the server and its process group: a fork spinning on a hostile checkpoint goes with it."""
        if self.proc is not None:
            if self.proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.kill()
            self.proc.communicate()  # reap it and close its pipes
            self.proc = None


_inspectors: dict[int, Inspector] = {}


def inspector() -> Inspector:
    """This process's inspector (a forked process makes its own: pipes are not shared across a fork)."""
    return _inspectors.setdefault(os.getpid(), Inspector())


def tensor_problems(ckpt_dir: Path, timeout_s: float = CHILD_TIMEOUT_S) -> list[str]:
    """The checkpoint loads weights-only and every floating-point tensor is finite, judged in a child process."""
    return inspector().problems(ckpt_dir, timeout_s)


def inspected_files(listed: dict[str, Any], fw: str | None) -> list[str]:
    """The listed files the inspecting child reads (and hashes): DCP's metadata and data files, or a
    framework save's torch.save files."""
    how = frameworks.inspector_of(fw)
    return sorted(rel for rel in listed if frameworks.inspected(how, rel))


def validate(
    ckpt_dir: str | Path,
    expect: MetricExpectations | None = None,
    history: History | None = None,
    after_step: int | None = None,
    timeout_s: float = CHILD_TIMEOUT_S,
    hashed: Callable[[dict[str, Any]], list[str]] | None = None,
    max_loss_from: str = MAX_LOSS_FIELD,
) -> Validation:
    """Every check on ``ckpt_dir``; ``after_step`` is the latest valid step it must follow; ``timeout_s``
    bounds the inspecting child's answer; ``hashed`` checks the listed files instead of this process
    (``format.verify``); ``max_loss_from`` names where ``expect.max_loss`` came from.

    An adopted framework save (``checkpoint.foreign``; its manifest's ``framework``) is checked by its
    format: DCP (torchtitan) like trainyard's own; Hugging Face's ``*.safetensors`` here, without torch
    (``checkpoint.safetensor``), and every torch.save file (HF's ``optimizer.pt``, ``pytorch_model*.bin``,
    a Lightning ``.ckpt``, a ``.pt``) in the child, weights-only. Each is hashed by the check that reads it."""
    started = time.monotonic()
    path = Path(ckpt_dir)
    fw = foreign.framework(path) if path.is_dir() else None
    try:
        manifest = read_manifest(path)  # read once: the files sent, verified and compared are this one's
    except CheckpointInvalid:
        return Validation(path, None, _shown(verify(path, hashed)), round(time.monotonic() - started, 3))
    inspected = inspected_files(manifest["files"], fw)
    here = frameworks.FORMATS[fw].checked_here if fw is not None else ()
    safe = sorted(rel for rel in manifest["files"] if here and rel.endswith(here))
    notes: list[str] = []
    # The child loads (and hashes what it loads) while this process hashes the files nobody interprets.
    with inspector().asking(
        path, timeout_s, None if frameworks.inspector_of(fw) == "dcp" else fw, inspected
    ) as inspection:
        problems = verify(path, hashed, elsewhere={*inspected, *safe}, manifest=manifest)
        if problems:
            return Validation(path, None, _shown(problems), round(time.monotonic() - started, 3))
        step = int(manifest["step"])
        ranks = [int(m.group(1)) for p in path.iterdir() if (m := _RANK_FILE.match(p.name))]
        if any(rank >= manifest["world_size"] for rank in ranks):
            problems.append(f"rank files up to {max(ranks)} but the manifest says world size {manifest['world_size']}")
        if after_step is not None and step <= after_step:
            problems.append(f"step {step} does not follow the latest valid step {after_step}")
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
            checked = list(pool.map(lambda rel: safetensor.check(path, rel), safe))
        digests: dict[str, Any] = {rel: c.digest for rel, c in zip(safe, checked, strict=True) if c.digest}
        problems += [p for c in checked for p in c.problems]
        problems += inspection()
        notes = list(inspector().last.get("notes") or [])
        digests.update(inspector().last.get("digests") or {})
        judged = [*inspected, *safe]  # once a check has failed, a file it did not reach needs no second reason
        problems += digest_problems(manifest, digests, [r for r in judged if r in digests] if problems else judged)
    if expect is not None:
        loss = manifest.get("metrics", {}).get("loss")
        if loss is None and fw is not None:  # a framework's save: the loss the run's step events logged, if any
            loss = dict(history or []).get(step)
        if loss is None and fw is not None:
            notes.append(f"no loss known at step {step} (a {fw} save, no step events): loss expectations not checked")
        else:
            problems += metric_problems(history or [(step, loss)], step, loss, expect, max_loss_from)
    return Validation(path, step, _shown(problems), round(time.monotonic() - started, 3), _shown(notes))


def _shown(lines: list[str]) -> list[str]:
    """Problems and notes as the gate, the ledger and the log show them: rank-chosen names made printable."""
    return [printable(line, PROBLEM_CHARS) for line in lines]
