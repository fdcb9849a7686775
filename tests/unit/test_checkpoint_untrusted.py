"""A checkpoint is written by untrusted training code: validating it never runs what it carries.

Each hostile checkpoint below has a manifest that matches its bytes (training code writes the
manifest too), so it reaches the loading step, where a full unpickler would run its payload.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from test_checkpoint_validation import save
from waiting import WaitedTooLong, wait_for

from trainyard.checkpoint import validate as validation
from trainyard.checkpoint.format import write_manifest
from trainyard.checkpoint.validate import validate


class RunsCode:
    """Pickles as a call of ``fn(*args)``: what an attacker puts in a pickle."""

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def rewrite_manifest(path: Path) -> None:
    write_manifest(path, step=10, world_size=1, global_batch=8, micro_batch=2, metrics={"loss": 2.0}, run_id="t")


def touch_marker(marker: Path) -> str:
    return f"open({str(marker)!r}, 'w').write('pwned')"


@pytest.mark.parametrize("payload", ["os.system", "builtins.exec"])
def test_a_metadata_pickle_that_runs_code_is_refused_and_never_runs(tmp_path: Path, payload: str) -> None:
    path, marker = save(tmp_path / "ckpt", 10), tmp_path / "marker"
    code = touch_marker(marker)
    evil = RunsCode(os.system, f'{sys.executable} -c "{code}"') if payload == "os.system" else RunsCode(exec, code)
    (path / ".metadata").write_bytes(pickle.dumps(evil))
    rewrite_manifest(path)
    result = validate(path)
    assert not marker.exists(), "the checkpoint's pickle ran in the validating process"
    assert not result.valid
    [problem] = result.problems
    assert problem.startswith("torch.distributed.checkpoint metadata is unreadable")
    assert f"refers to {'posix' if payload == 'os.system' else 'builtins'}." in problem and "would run code" in problem


def test_a_tensor_entry_that_runs_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    """DCP stores non-tensor values with ``torch.save``; loading them must be weights-only too."""
    path, marker = tmp_path / "ckpt" / "step_000010", tmp_path / "marker"
    state = {"model": {"w": torch.ones(4)}, "extra": RunsCode(exec, touch_marker(marker))}
    dcp.save(state, checkpoint_id=path, no_dist=True)  # saving pickles the call; it does not make it
    rewrite_manifest(path)
    result = validate(path)
    assert not marker.exists(), "a stored entry's pickle ran in the validating process"
    [problem] = result.problems
    assert problem.startswith("entry extra does not load weights-only: UnpicklingError")


def test_metadata_pointing_outside_the_checkpoint_is_refused(tmp_path: Path) -> None:
    path = save(tmp_path / "ckpt", 10)
    secret = tmp_path / "secret.txt"
    secret.write_text("not yours")
    md = pickle.loads((path / ".metadata").read_bytes())  # our own file: this test trusts it
    for info in md.storage_data.values():
        info.relative_path = "../../secret.txt"
    (path / ".metadata").write_bytes(pickle.dumps(md))
    rewrite_manifest(path)
    problems = validate(path).problems
    assert problems and all("outside the checkpoint folder" in p for p in problems), problems


def test_the_allow_list_reads_real_dcp_metadata_and_nothing_else(tmp_path: Path) -> None:
    from trainyard.checkpoint import metadata as safe_meta

    path = tmp_path / "step_000010"
    model = torch.nn.Linear(4, 3).to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    model(torch.ones(2, 4, dtype=torch.bfloat16)).sum().backward()
    optim.step()  # optimizer state: tensors, and plain values DCP stores as bytes entries
    dcp.save(
        {"model": model.state_dict(), "optim": optim.state_dict(), "note": "text"}, checkpoint_id=path, no_dist=True
    )
    real = pickle.loads((path / ".metadata").read_bytes())  # what DCP itself reads (our own file: trusted)
    md = safe_meta.read_metadata(path)
    assert set(md.state_dict_metadata) == set(real.state_dict_metadata)
    for fqn, entry in real.state_dict_metadata.items():
        mine = md.state_dict_metadata[fqn]
        assert type(mine).__name__ == type(entry).__name__, fqn
        if hasattr(entry, "size"):
            assert (mine.size, mine.properties.dtype) == (entry.size, entry.properties.dtype)
            assert [(c.offsets, c.sizes) for c in mine.chunks] == [(c.offsets, c.sizes) for c in entry.chunks]
    assert {(k.fqn, k.offset, v.relative_path, v.offset, v.length) for k, v in md.storage_data.items()} == {
        (k.fqn, k.offset, v.relative_path, v.offset, v.length) for k, v in real.storage_data.items()
    }
    assert md.planner_data == real.planner_data
    rewrite_manifest(path)
    assert validate(path).problems == []  # optimizer state and plain values load weights-only
    for evil in (
        RunsCode(eval, "1"),
        RunsCode(getattr, 1, "real"),
        RunsCode(torch.load, "x"),
        RunsCode(subprocess.Popen, ["true"]),
    ):
        with pytest.raises(safe_meta.MetadataRefused, match="which DCP metadata never holds"):
            safe_meta.loads(pickle.dumps(evil))
    with pytest.raises(safe_meta.MetadataRefused, match="not torch.distributed.checkpoint Metadata"):
        safe_meta.loads(pickle.dumps({"state_dict_metadata": {}}))
    with pytest.raises(safe_meta.MetadataRefused, match="persistent id"):
        buf = io.BytesIO()
        pickler = pickle.Pickler(buf)
        pickler.persistent_id = lambda obj: "x" if obj == 1 else None
        pickler.dump([1])
        safe_meta.loads(buf.getvalue())


def test_the_inspecting_child_never_sees_the_workers_secrets(tmp_path: Path, monkeypatch) -> None:
    from trainyard.checkpoint.validate import child_env

    secrets = {
        "AIRFLOW__CORE__FERNET_KEY": "fernet-secret",
        "AIRFLOW__API_AUTH__JWT_SECRET": "jwt-secret",
        "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": "postgresql://u:pw@db/airflow",
        "AWS_SECRET_ACCESS_KEY": "aws-secret",
        "AIRFLOW_CONN_COLD": "aws://k:s@",
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    seen: list[dict] = []
    real = subprocess.Popen

    def spy(cmd, **kwargs):
        seen.append({"cmd": cmd, **kwargs})
        return real(cmd, **kwargs)

    monkeypatch.setattr(validation.subprocess, "Popen", spy)
    monkeypatch.setattr(validation, "_inspectors", {})
    for step in (10, 20):
        assert validate(save(tmp_path, step)).valid  # the child works with the scrubbed environment
    [call] = seen  # one server per process, not one child per validation or per file
    assert call["cmd"] == [sys.executable, "-P", "-m", "trainyard.checkpoint.tensors", "--serve"]
    env = call["env"]
    assert not set(secrets) & set(env) and not set(secrets.values()) & set(env.values())
    assert not [k for k in env if k.startswith(("AIRFLOW", "AWS_"))]
    assert set(child_env({"PATH": "/bin", **secrets})) == {
        "PATH",
        "PYTHONPATH",
        "PYTHONDONTWRITEBYTECODE",
        "CUDA_VISIBLE_DEVICES",
    }


def test_the_inspecting_child_cannot_write_files(tmp_path: Path) -> None:
    from trainyard.checkpoint.validate import child_env

    target = tmp_path / "written"
    script = (
        f"from trainyard.checkpoint.tensors import _no_writes; _no_writes()\n"
        f"with open({str(target)!r}, 'w') as fh: fh.write('x' * 10)"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=child_env())
    assert done.returncode != 0 and "File too large" in done.stderr
    assert not target.exists() or target.stat().st_size == 0


def test_a_child_that_dies_hangs_or_says_no_json_is_a_problem_not_a_pass(tmp_path: Path) -> None:
    ckpt = save(tmp_path, 10)
    chatty = validation.Inspector([sys.executable, "-c", "print('all good')"])
    [problem] = chatty.problems(ckpt)
    assert problem == "the process inspecting the tensors failed: it answered 'all good', not JSON"
    [problem] = validation.Inspector([sys.executable, "-c", "import os; os.abort()"]).problems(ckpt)
    assert problem == "the process inspecting the tensors failed: it ended (exit -6) without an answer"
    [problem] = validation.Inspector([sys.executable, "-c", "import time; time.sleep(60)"]).problems(ckpt, 0.5)
    assert problem == "the process inspecting the tensors failed: no answer within 0 s; it was stopped"
    assert chatty.proc is None  # stopped: the next request starts a new server


def test_each_checkpoint_is_inspected_by_a_fresh_process(tmp_path: Path) -> None:
    """The server forks per request and answers for it: a checkpoint that subverted its inspector
    (past the allow-list) could still not touch the next checkpoint's answer."""
    import json

    from trainyard.checkpoint.validate import child_command, child_env

    server = subprocess.Popen(
        child_command(), env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    answers = []
    for step in (10, 20):
        server.stdin.write(f"{save(tmp_path, step)}\n")
        server.stdin.flush()
        answers.append(json.loads(server.stdout.readline()))
    server.stdin.close()
    assert server.wait(timeout=30) == 0  # its stdin closed: it ends, no process is left behind
    assert [a["problems"] for a in answers] == [[], []]
    assert len({a["pid"] for a in answers} | {server.pid}) == 3


def hostile_hash(path: Path) -> None:
    """A ``.metadata`` with no global at all: a set holding a tuple nested 100 deep, each level the one below
    twice (DUP, TUPLE2: 200 bytes), so adding it to the set hashes 2**100 tuples. Written by hand, as
    building it here would hash it here."""
    levels = pickle.DUP + pickle.TUPLE2
    hostile = pickle.PROTO + b"\x04" + pickle.EMPTY_SET + pickle.MARK + pickle.EMPTY_TUPLE + levels * 100
    (path / ".metadata").write_bytes(hostile + pickle.ADDITEMS + pickle.STOP)
    rewrite_manifest(path)


def _children(pid: int) -> set[int]:
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan that died may wait for a pid 1 that never reaps)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _still_running(pids: set[int], within_s: float = 5) -> list[int]:
    """The ``pids`` still running after ``within_s`` at most: a SIGKILLed process is gone only once the kernel
    has torn it down, which a loaded machine takes a moment to do."""
    with contextlib.suppress(WaitedTooLong):  # the caller asserts on what is still running
        wait_for(lambda: not [pid for pid in pids if _running(pid)], within_s, "the processes to end")
    return [pid for pid in pids if _running(pid)]


def _forks_of(server: subprocess.Popen, seen: set[int], within_s: float, first: bool = False) -> None:
    """Collect ``server``'s children for ``within_s`` at most, until it ends or (``first``) one is seen."""

    def ended() -> bool:
        if server.poll() is not None:
            return True
        seen.update(_children(server.pid))
        return first and bool(seen)

    with contextlib.suppress(WaitedTooLong):  # the caller asserts on what was seen
        wait_for(ended, within_s, "the inspector's forks")


def test_a_metadata_that_hashes_for_years_leaves_no_inspector_running(tmp_path: Path) -> None:
    """Issue 29: the fork inspecting such a checkpoint dies with its server (killed, or its group stopped
    after the time limit) and runs under CPU and memory limits; nothing is left spinning with parent 1."""
    import signal
    import threading

    hostile_hash(path := save(tmp_path / "a", 10))
    own = validation.Inspector()
    seen: set[int] = set()
    try:
        assert own.problems(save(tmp_path / "b", 10)) == []  # the server is up: torch imported
        with own.asking(path, 30) as _answer:
            _forks_of(own.proc, seen, 10, first=True)
            [fork] = seen
            limits = Path(f"/proc/{fork}/limits").read_text()
            assert "Max cpu time              unlimited" not in limits
            assert "Max address space         unlimited" not in limits
            os.kill(own.proc.pid, signal.SIGKILL)  # the server alone: its fork must follow it
            assert not _still_running({fork}), "the fork outlived its server"
        validation.inspector().problems(save(tmp_path / "c", 10))  # warm the validator's own server
        server = validation.inspector().proc
        watch = threading.Thread(target=_forks_of, args=(server, seen, 20))
        watch.start()
        result = validate(path, timeout_s=2)
        watch.join()
        assert not result.valid
        assert result.problems == ["the process inspecting the tensors failed: no answer within 2 s; it was stopped"]
        assert len(seen) == 2 and not _still_running(seen), "an inspector was left running"  # SIGKILLed with its group
    finally:
        own.stop()
        for pid in seen:  # never leave one spinning, even where the test fails
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
