"""What of the hot tier an attempt's pods see, and the folders the orchestrator makes for them.

Pods mount folders of the ``hot_pvc`` claim (``subPath``) at the paths the
orchestrator sees them at, so a path means the same thing on both sides.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from trainyard.backends.base import LaunchPlan
from trainyard.backends.kubernetes.pods import PathMount
from trainyard.protocol.heartbeat import node_folder
from trainyard.spec import KubernetesSpec

HEARTBEAT_VARIABLE = "TRAINYARD_HEARTBEAT_DIR"

# Folders the orchestrator makes for the pods: group-writable, setgid (new files keep SHARED_GID).
SHARED_DIR_MODE = 0o2775


def attempt_paths(plan: LaunchPlan) -> list[PathMount]:
    """What an attempt's pods may see of the hot tier, and which of it they may write.

    What the contract declares (``TrainEnv.paths``): its node's folder of the
    attempt's heartbeat folder (``per_node``: a pod can write no other node's beats
    or failure records, so its record can blame no other node), its lineage's
    checkpoint folder and the run's events folder (``events.d``) read-write; its
    dataset (and a ``resume_from`` path outside the checkpoint folder) read-only.
    Nothing else: not the run folder (its pinned spec, report and the
    orchestrator's ``events.jsonl``), not other pipelines' checkpoints or locks.
    """
    mounts = [
        PathMount(str(p.path), not p.writable, per_node=p.name == HEARTBEAT_VARIABLE) for p in plan.train_env.paths()
    ]
    for m in mounts:
        if not m.path.startswith("/") or ".." in PurePosixPath(m.path).parts:
            raise ValueError(f"launch plan: {m.path!r} must be an absolute path without '..' to be mounted in a pod")
    return _covering(mounts)


def _covering(mounts: list[PathMount]) -> list[PathMount]:
    """Drop a mount another one already grants (inside a writable one, or read-only inside a read-only one).

    A per-node mount is kept, and grants nothing: what a pod sees there is only its node's folder."""
    keep: list[PathMount] = []
    for m in sorted(mounts, key=lambda m: (len(PurePosixPath(m.path).parts), m.read_only, m.path)):
        inside = [k for k in keep if not k.per_node and PurePosixPath(m.path).is_relative_to(k.path)]
        if m.per_node or not any(m.read_only or not k.read_only for k in inside):
            keep.append(m)
    return keep


def hot_mount_path(plan: LaunchPlan, spec: KubernetesSpec) -> str:
    """Where the orchestrator sees the root of ``hot_pvc``: ``spec.hot_mount``, else the deepest folder the
    plan's paths share. Pods mount folders of the claim (``subPath``) at the same paths, so they mean the
    same thing there.
    """
    folders = [PurePosixPath(m.path) for m in attempt_paths(plan)]  # every path of the contract is a folder
    if spec.hot_mount:
        outside = [str(f) for f in folders if not f.is_relative_to(spec.hot_mount)]
        if outside:
            raise ValueError(f"nodes.kubernetes.hot_mount: {spec.hot_mount} does not hold {', '.join(outside)}")
        return spec.hot_mount
    if not folders:
        raise ValueError("nodes.kubernetes.hot_mount: the plan names no paths; set where hot_pvc is mounted")
    root = PurePosixPath(*_common_parts([f.parts for f in folders]))
    if str(root) == "/":
        raise ValueError(
            "nodes.kubernetes.hot_mount: the run's paths share no folder but '/'; "
            "set where hot_pvc is mounted (e.g. $TRAINYARD_HOME)"
        )
    return str(root)


def _common_parts(parts: list[tuple[str, ...]]) -> tuple[str, ...]:
    common = parts[0]
    for other in parts[1:]:
        n = 0
        while n < min(len(common), len(other)) and common[n] == other[n]:
            n += 1
        common = common[:n]
    return common


def prepare_paths(plan: LaunchPlan) -> None:
    """Create the folders the pods mount read-write, as the orchestrator's user, before the Job.

    The kubelet would create a missing ``subPath`` itself, owned by root (not
    writable by the pods' user); so each host's folder of the heartbeat folder is made
    here too (a pod mounts the one of the host it lands on).
    Each folder made here is ``SHARED_DIR_MODE`` (group-writable, setgid), so
    the pods (in ``SHARED_GID``) write there and what they create stays in
    the group the orchestrator reads and tidies as.
    """
    for p in plan.train_env.paths():
        if p.writable and p.is_dir:
            shared_dirs(p.path)
        if p.name == HEARTBEAT_VARIABLE:  # the kubelet would make a node's folder owned by root
            for host in plan.nodes:  # the plan's hosts: every pod is pinned to one of them
                shared_dirs(node_folder(p.path, host))


def shared_dirs(path: Path) -> None:
    """``mkdir -p`` with ``SHARED_DIR_MODE`` on every folder it makes (not masked by the umask)."""
    missing = []
    for folder in (path, *path.parents):
        if folder.is_dir():
            break
        missing.append(folder)
    for folder in reversed(missing):
        try:
            folder.mkdir()
        except FileExistsError:
            if not folder.is_dir():
                raise
            continue  # made meanwhile by someone else: theirs to set
        os.chmod(folder, SHARED_DIR_MODE)
    if path.is_dir() and path.stat().st_uid == os.geteuid():
        os.chmod(path, stat.S_IMODE(path.stat().st_mode) | SHARED_DIR_MODE)  # an older folder of ours, too
