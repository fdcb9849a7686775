"""Checkpoints: the on-disk format (manifest + hashes), validation, retention, tiering and the lineage lease.

``format`` owns the directory layout and integrity check; it imports no torch,
so the CLI, the integrity gate and the Airflow layer can verify checkpoints
without loading tensors. ``validate``, ``metadata`` and ``tensors`` inspect
what training code wrote without trusting it; ``registry`` keeps the lineage's
list, ``cold`` its published copies, ``lease`` which run holds it. The
training-side save and load live in ``trainyard.runtime.checkpoints``.
"""
