"""Checkpoints: the on-disk format (manifest + hashes), validation and commit.

``format`` owns the directory layout and integrity check; it imports no torch,
so the CLI, the integrity gate and the Airflow layer can verify checkpoints
without loading tensors. The training-side save and load live in
``trainyard.runtime.checkpoints``.
"""

from trainyard.checkpoint.format import (
    FORMAT,
    MANIFEST,
    SUPERSEDED,
    VERSION,
    commit,
    latest_valid,
    list_checkpoints,
    prepare_staging,
    read_manifest,
    sha256_file,
    staging_dir,
    step_dir,
    step_of,
    verify,
    write_manifest,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "SUPERSEDED",
    "VERSION",
    "commit",
    "latest_valid",
    "list_checkpoints",
    "prepare_staging",
    "read_manifest",
    "sha256_file",
    "staging_dir",
    "step_dir",
    "step_of",
    "verify",
    "write_manifest",
]
